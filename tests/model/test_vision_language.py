"""Vision-language models: the language part streams, the vision tower runs in the capture.

verify (fp32, CPU) against plain PyTorch with images in the rows, per family: Qwen2.5-VL and
Qwen3-VL (M-RoPE per packed sample; Qwen3-VL's deepstack injections between layers), Gemma 3
(pooled SigLIP tokens, bidirectional attention over an image), LLaVA (CLIP feature layer).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain.batch import Batch
from megatrain.model.loading import load_causal_lm
from megatrain.model.multimodal import MultimodalInputs, image_inputs, unused_vision_params
from megatrain.model.structure import discover
from megatrain.model.tiny_vision import IMAGE_ID, tiny_vlm_config
from megatrain.verify import run_verify, verify_config
from megatrain.verify.images import with_images


@pytest.mark.parametrize(
    ("model_type", "packed", "seq"),
    [
        ("qwen2_5_vl", True, 48),
        ("qwen3_vl", True, 48),
        ("gemma3", True, 64),
        ("llava", False, 64),
    ],
)
def test_verify_with_images(model_type: str, packed: bool, seq: int) -> None:
    cfg = verify_config(model_type=model_type, tiny=True, seq_len=seq, packed=packed)
    reports = run_verify(cfg, steps=2)
    assert all(r.excess <= 1 for r in reports), [(r.excess, r.worst) for r in reports]


def test_structure_of_a_vision_language_model() -> None:
    model = load_causal_lm(None, model_type="qwen2_5_vl", tiny=True)
    st = discover(model)
    assert st.is_multimodal and st.body is model.model.language_model
    assert list(st.vision) == ["visual"]
    assert st.num_layers == model.config.text_config.num_hidden_layers


def test_verify_batches_hold_images_in_placeholder_order() -> None:
    config = tiny_vlm_config("qwen2_5_vl")
    ids = torch.randint(3, 200, (3, 48))
    pos = torch.cat([torch.arange(23), torch.arange(25)]).expand(3, -1).clone()
    batch = with_images(Batch(ids, ids.clone(), None, pos), config, seed=0)
    assert batch.images is not None
    grids = batch.images["image_grid_thw"]
    tokens = int((grids.prod(-1) // 4).sum())
    assert tokens == int((batch.input_ids == IMAGE_ID).sum()) and len(grids) == 4
    assert bool((batch.labels[batch.input_ids == IMAGE_ID] == -100).all())


def test_mrope_per_packed_sample_equals_the_sample_alone() -> None:
    model = load_causal_lm(None, model_type="qwen2_5_vl", tiny=True)
    inputs = MultimodalInputs(model.model)
    config = model.config
    ids = torch.randint(3, 200, (2, 48))
    pos = torch.cat([torch.arange(23), torch.arange(25)]).expand(2, -1).clone()
    batch = with_images(Batch(ids, ids.clone(), None, pos), config, seed=0)
    got = inputs.rope_positions(batch.input_ids, batch.position_ids, batch.images)
    assert got.shape == (4, 2, 48) and torch.equal(got[0], batch.position_ids)
    assert batch.images is not None
    grids = batch.images["image_grid_thw"]
    for k, (s, e) in enumerate([(0, 23), (23, 48)]):  # row 0: an image in each sample
        alone, _ = model.model.get_rope_index(
            batch.input_ids[:1, s:e],
            image_grid_thw=grids[k : k + 1],
            mm_token_type_ids=(batch.input_ids[:1, s:e] == IMAGE_ID).int(),
        )
        assert torch.equal(got[1:, 0, s:e], alone[:, 0])
    # row 1 has no images (the last row): text positions in all three rows
    assert torch.equal(got[1:, 1], batch.position_ids[1].expand(3, -1))


def test_placeholders_without_images_are_refused() -> None:
    model = load_causal_lm(None, model_type="llava", tiny=True)
    ids = torch.full((1, 8), 5)
    ids[0, 2] = IMAGE_ID
    with pytest.raises(ValueError, match="no images"):
        MultimodalInputs(model.model).kwargs(ids, None, None, None)


def test_a_non_additive_change_between_layers_is_refused() -> None:
    import transformers.models.qwen3_vl.modeling_qwen3_vl as qwen3_vl

    original = qwen3_vl.Qwen3VLTextModel._deepstack_process

    def scaled(self, hidden, mask, embeds):  # type: ignore[no-untyped-def]
        hidden = hidden.clone()
        hidden[mask, :] = hidden[mask, :] * 1.5 + embeds
        return hidden

    qwen3_vl.Qwen3VLTextModel._deepstack_process = scaled
    try:
        cfg = verify_config(model_type="qwen3_vl", tiny=True, seq_len=48)
        with pytest.raises(ValueError, match="not an addition"):
            run_verify(cfg, steps=1)
    finally:
        qwen3_vl.Qwen3VLTextModel._deepstack_process = original


def test_image_inputs_match_the_models_token_counts() -> None:
    for model_type in ("qwen2_5_vl", "gemma3", "llava"):
        config = tiny_vlm_config(model_type)
        _, counts = image_inputs(config, [(16, 16)])
        assert counts[0] in (4, 16), (model_type, counts)


@pytest.mark.parametrize(
    ("model_type", "seq", "flags"),
    [
        ("qwen3_vl", 48, ("--model.freeze_vision", "false", "--model.freeze_projector", "false")),
        ("llava", 64, ("--model.freeze_vision", "false")),  # its last layer unused: frozen
        ("gemma3", 64, ("--model.freeze_projector", "false")),
    ],
)
def test_verify_with_trained_vision(model_type: str, seq: int, flags: tuple[str, ...]) -> None:
    """Trained vision parts (fp32 master, host AdamW; the backward runs the capture again)
    equal plain PyTorch training the same parameters, deepstack injections included."""
    cfg = verify_config(None, list(flags), model_type=model_type, tiny=True, seq_len=seq)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packing=True))
    reports = run_verify(cfg, steps=2)
    assert all(r.excess <= 1 for r in reports), [(r.excess, r.worst) for r in reports]


def test_parameters_the_features_never_reach_stay_frozen() -> None:
    st = discover(load_causal_lm(None, model_type="llava", tiny=True))
    unused = unused_vision_params(st)
    names = {n for n, p in st.causal_lm.named_parameters() if id(p) in unused}
    # vision_feature_layer -2 of a 2-layer tower: its last layer and final norm are unused
    assert names and all(
        n.startswith(("model.vision_tower.encoder.layers.1.", "model.vision_tower.post_"))
        for n in names
    )
    assert (
        unused_vision_params(discover(load_causal_lm(None, model_type="qwen2_5_vl", tiny=True)))
        == set()
    )
