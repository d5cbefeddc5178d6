"""The engine equals plain PyTorch training (HF model + AdamW + clip_grad_norm_) on the CPU.

fp32 compute, 3 optimizer steps, 2 micro-batches, a padded row per micro-batch, clipping that
triggers: for every architecture the issue lists, tied and untied embeddings, packed rows,
MoE router aux losses, with and without clipping, and several slot counts.
"""

from __future__ import annotations

import pytest

from megatrain.config import TrainConfig
from megatrain.model.tiny import TESTED_MODEL_TYPES
from megatrain.verify import MIN_ROUTING_MARGIN, run_verify, verify_config, within


def _check(cfg: TrainConfig, expect_clipping: bool = True, steps: int = 3) -> None:
    reports = run_verify(cfg, steps=steps)
    assert len(reports) == steps
    detail = "\n".join(f"step {r.step}: excess {r.excess:.3f} at {r.worst}" for r in reports)
    assert within(reports), detail
    if expect_clipping:
        assert any(r.clipped for r in reports), "clipping never triggered"
    # the fp32 engine is close to fp32 PyTorch in the loss on every step
    assert all(r.loss_rel < 1e-5 for r in reports)
    # MoE: no routing decision was close enough to a tie for rounding to flip it
    margins = [r.routing_margin for r in reports if r.routing_margin is not None]
    assert all(m >= MIN_ROUTING_MARGIN for m in margins), margins


@pytest.mark.parametrize("model_type", TESTED_MODEL_TYPES)
def test_fp32_padded_matches_pytorch(model_type: str) -> None:
    _check(verify_config(model_type=model_type, tiny=True))


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen3_5_text", "gemma3_text", "qwen3_moe", "gpt_oss"]
)
def test_fp32_packed_matches_pytorch(model_type: str) -> None:
    _check(verify_config(model_type=model_type, tiny=True, packed=True))


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied: bool) -> None:
    _check(
        verify_config(model_type="qwen2", tiny=True, config_overrides={"tie_word_embeddings": tied})
    )


@pytest.mark.parametrize(
    "model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", "qwen3_next"]
)
def test_router_aux_loss_matches_hf(model_type: str) -> None:
    _check(
        verify_config(
            model_type=model_type,
            tiny=True,
            config_overrides={"output_router_logits": True, "router_aux_loss_coef": 0.5},
        )
    )


def test_no_clipping_updates_during_backward() -> None:
    # Without clipping each block is updated as soon as its gradient lands.
    _check(verify_config(model_type="llama", tiny=True, max_grad_norm=0.0), expect_clipping=False)


@pytest.mark.parametrize("num_slots", [1, 3, 8])
def test_slot_counts(num_slots: int) -> None:
    _check(verify_config(model_type="qwen3", tiny=True, num_slots=num_slots), steps=2)


def test_clipping_on_some_steps_only() -> None:
    reports = run_verify(verify_config(model_type="llama", tiny=True, max_grad_norm=2.2), steps=4)
    assert within(reports)
    assert 0 < sum(r.clipped for r in reports) < 4


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_text"])
def test_bf16_compute_within_pytorch_bf16_drift(model_type: str) -> None:
    reports = run_verify(verify_config(model_type=model_type, tiny=True, dtype="bf16"))
    assert within(reports), [(r.excess, r.worst) for r in reports]
    assert all(r.loss_rel < 1e-3 for r in reports)


@pytest.mark.parametrize("model_type", ["llama4_text", "deepseek_v2"])
def test_other_example_families_match_pytorch(model_type: str) -> None:
    # architectures of examples/ beyond the list above (Llama 4 Scout, DeepSeek-V2-Lite)
    _check(verify_config(model_type=model_type, tiny=True), steps=2)
