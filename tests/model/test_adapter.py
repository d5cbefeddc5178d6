"""Model adapter and host store: structure discovery, clear errors, one copy of the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig

from megatrain.cli import main
from megatrain.model.loading import load_causal_lm
from megatrain.model.router import RouterAux
from megatrain.model.structure import discover
from megatrain.model.tiny import tiny_config
from megatrain.store.host import HostStore


def test_groups_of_a_hybrid_moe_model() -> None:
    structure = discover(load_causal_lm(None, model_type="qwen3_next", tiny=True))
    kinds = {g.kind: g.layer_indices for g in structure.groups}
    assert kinds == {"linear_attention+moe": [0, 2], "full_attention+moe": [1, 3]}
    dense_then_moe = discover(load_causal_lm(None, model_type="deepseek_v3", tiny=True))
    assert [len(g.layer_indices) for g in dense_then_moe.groups] == [1, 2]


def test_store_holds_the_only_copy_and_binds_it_back(tmp_path: Path) -> None:
    model = load_causal_lm(
        None, model_type="qwen2", tiny=True, config_overrides={"tie_word_embeddings": True}
    )
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    store = HostStore(discover(model), compute_dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert store.numel == sum(t.numel() for t in original.values())  # tied weight stored once
    assert store.host_bytes() == 14 * store.numel
    with store.bound(torch.float32) as bound:
        for name, p in bound.named_parameters():
            assert torch.equal(p, original[name]), name
        assert bound.lm_head.weight is bound.model.embed_tokens.weight
    assert all(p.device.type == "meta" for p in model.parameters())


def test_weight_decay_groups() -> None:
    store = HostStore(
        discover(load_causal_lm(None, model_type="qwen2", tiny=True)), compute_dtype=torch.float32
    )
    decayed = {e.full_name for b in store.blocks for e in b.entries if e.decay}
    assert "model.layers.0.self_attn.q_proj.weight" in decayed
    assert not any("norm" in n or n.endswith("bias") for n in decayed)
    for block in store.blocks:  # decayed parameters first, one contiguous range
        flags = [e.decay for e in block.entries]
        assert flags == sorted(flags, reverse=True)
        assert block.decay_numel == sum(e.numel for e in block.entries if e.decay)


def test_router_decomposition_checked_against_hf() -> None:
    model = load_causal_lm(
        None, model_type="mixtral", tiny=True, config_overrides={"output_router_logits": True}
    )
    assert RouterAux.for_model(discover(model)) is not None
    plain = load_causal_lm(None, model_type="mixtral", tiny=True)
    assert RouterAux.for_model(discover(plain)) is None  # HF would not add it either


def test_encoder_decoder_is_refused() -> None:
    with pytest.raises(ValueError, match="encoder-decoder"):
        load_causal_lm(None, model_type="t5", tiny=True)


def test_non_causal_lm_is_refused() -> None:
    with pytest.raises(ValueError, match="no AutoModelForCausalLM"):
        load_causal_lm(None, model_type="vit", tiny=True)


def test_model_without_a_layer_list_is_refused() -> None:
    bert = AutoModelForCausalLM.from_config(
        BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            is_decoder=True,
        )
    )
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        discover(bert)


def test_shared_layer_weights_are_refused() -> None:
    model = load_causal_lm(None, model_type="llama", tiny=True)
    model.model.layers[1].mlp.up_proj = model.model.layers[0].mlp.up_proj
    with pytest.raises(ValueError, match="shared between decoder layers 0 and 1"):
        discover(model)


def test_extra_trainable_module_is_refused() -> None:
    model = load_causal_lm(None, model_type="llama", tiny=True)
    model.model.adapter = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"model\.adapter\.weight"):
        discover(model)


def test_body_that_changes_hidden_states_between_layers_is_refused() -> None:
    from megatrain.verify import run_verify, verify_config

    real = type(load_causal_lm(None, model_type="llama", tiny=True).model).forward

    def scaled_forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        layers = list(self.layers)
        for i, layer in enumerate(layers):
            self.layers[i] = _Doubling(layer)
        try:
            return real(self, *args, **kwargs)
        finally:
            for i, layer in enumerate(layers):
                self.layers[i] = layer

    import transformers.models.llama.modeling_llama as llama

    original = llama.LlamaModel.forward
    llama.LlamaModel.forward = scaled_forward
    try:
        with pytest.raises(ValueError, match="changes hidden states between decoder layers"):
            run_verify(verify_config(model_type="llama", tiny=True), steps=1)
    finally:
        llama.LlamaModel.forward = original


class _Doubling(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self.inner(hidden, *args, **kwargs) * 2


def test_cli_errors_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["verify", "--model-type", "t5", "--tiny"]) == 2
    assert "encoder-decoder" in capsys.readouterr().err


def test_verify_cli_passes_and_reports(capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", "--model-type", "qwen3_moe", "--tiny", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "excess" in out


def test_tiny_config_keeps_structure() -> None:
    cfg = tiny_config("gemma3_text")
    assert cfg.sliding_window < 24 and set(cfg.layer_types) == {
        "sliding_attention",
        "full_attention",
    }


@pytest.mark.parametrize("model_type", ["qwen3_5", "llama4"])
def test_text_model_of_a_vision_language_checkpoint(model_type: str, tmp_path: Path) -> None:
    """Qwen3.5 and Llama 4 checkpoints are vision-language. Qwen3.5's body holds its language
    model: the whole model loads (vision frozen, model/multimodal.py) and verify trains it with
    images. Llama 4's does not: AutoModelForCausalLM loads its text model, the engine trains it."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from megatrain.verify import run_verify, verify_config, within

    cfg = AutoConfig.for_model(model_type)
    cfg.text_config = tiny_config(cfg.text_config.model_type)
    for key, value in {
        "depth": 1,
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_attention_heads": 2,
        "out_hidden_size": 64,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "vision_output_dim": 64,
    }.items():
        if hasattr(cfg.vision_config, key):
            setattr(cfg.vision_config, key, value)
    if model_type == "qwen3_5":  # the image ids inside the tiny vocabulary
        vocab = cfg.text_config.vocab_size
        cfg.vision_start_token_id, cfg.vision_end_token_id = vocab - 4, vocab - 3
        cfg.image_token_id, cfg.video_token_id = vocab - 2, vocab - 1
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path)
    structure = discover(load_causal_lm(str(tmp_path)))
    assert structure.num_layers == cfg.text_config.num_hidden_layers
    assert structure.is_multimodal == (model_type == "qwen3_5")
    assert within(run_verify(verify_config(model=str(tmp_path)), steps=1))
