"""The GPU tier on a real device (skipped without CUDA): states on the GPU, updates there,
results within PyTorch's own drift, checkpoints and export from device memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain.checkpoint.saving import load_checkpoint, save_checkpoint
from megatrain.config import TrainConfig
from megatrain.recipes.builder import RunBuilder
from megatrain.verify import make_batches, run_verify, verify_config, within
from run_helpers import engine_steps

pytestmark = pytest.mark.gpu

LAYERS = 4


def _cfg(tier: int | str, *args: str, tied: bool = False, **shorthands: Any) -> TrainConfig:
    return verify_config(
        None,
        ["--memory.gpu_state_blocks", str(tier), *args],
        model_type=shorthands.pop("model_type", "llama"),
        tiny=True,
        device="cuda",
        config_overrides={"num_hidden_layers": LAYERS, "tie_word_embeddings": tied},
        **shorthands,
    )


@pytest.mark.parametrize(
    ("tier", "clip", "tied"),
    [(1, 1.0, False), (2, 0.0, False), (LAYERS + 1, 1.0, True), (LAYERS + 2, 0.0, False)],
)
def test_bf16_tier_within_pytorch_bf16_drift(tier: int, clip: float, tied: bool) -> None:
    cfg = _cfg(tier, dtype="bf16", max_grad_norm=clip, grad_accum=2, tied=tied)
    reports = run_verify(cfg)
    assert within(reports), [(r.excess, r.worst) for r in reports]
    assert all(r.loss_rel < 1e-3 for r in reports)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_fp32_tier_matches_pytorch(model_type: str) -> None:
    reports = run_verify(_cfg(LAYERS + 2, model_type=model_type))
    assert within(reports), [(r.excess, r.worst) for r in reports]


def test_compiled_tier_layers_match_pytorch() -> None:
    cfg = _cfg(2, "--training.compile_layers", "true", dtype="bf16")
    reports = run_verify(cfg)
    assert within(reports), [(r.excess, r.worst) for r in reports]


def _states_after(cfg: TrainConfig, steps: int) -> tuple[list, dict[str, torch.Tensor]]:
    results, _, store, _ = engine_steps(cfg, steps)
    kinds = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
    state = {
        f"{b.name}.{k}": getattr(b, k).cpu()
        for b in store.blocks
        for k in kinds
        if getattr(b, k) is not None
    }
    return results, state


@pytest.mark.parametrize(
    ("states", "dtype"), [("bf16", "fp32"), ("int8", "fp32"), ("fp32", "bf16"), ("int8", "bf16")]
)
def test_the_tier_updates_as_the_host_does(states: str, dtype: str) -> None:
    """Every block in the tier, its states updated on the GPU by the fused kernel
    (optim/triton_adamw.py), against every block updated on the host by the C kernel: the same
    gradients reach both (fp32 compute: fp32; bf16 compute: the accumulator's bf16 rounding,
    in the tier's device shadow as in the host shadow); losses, gradient norms, masters, codes
    and scales bit for bit."""
    args = ("--optimizer.state_dtype", states, "--training.compile_layers", "false")
    host, host_state = _states_after(_cfg(0, *args, max_grad_norm=1.0, dtype=dtype), 3)
    ours, our_state = _states_after(_cfg(LAYERS + 2, *args, max_grad_norm=1.0, dtype=dtype), 3)
    assert ours == host
    for key, value in host_state.items():
        assert torch.equal(our_state[key], value), key


def test_tier_states_live_on_the_gpu_and_leave_the_host() -> None:
    builder = RunBuilder(_cfg(2, dtype="bf16"))
    structure = builder.model()
    store = builder.store(structure)
    host_before = store.host_bytes()
    allocated_before = torch.cuda.memory_allocated()
    engine = builder.engine(structure, store)
    try:
        tier_params = sum(b.numel for b in store.layers[:2])
        for block in store.layers[:2]:
            for t in (block.master, block.exp_avg, block.exp_avg_sq, block.shadow):
                assert t is not None and t.is_cuda
            assert block.shadow.dtype == torch.bfloat16  # type: ignore[union-attr]
            assert block.grad is None  # the gradient lands in the shadow (engine/tier.py)
        for block in [store.embed, *store.layers[2:], store.head]:
            assert not block.master.is_cuda and block.grad is None
        # host store: 14 B/param fewer (master, m, v, bf16 shadow); GPU: as many more
        assert host_before - store.host_bytes() == 14 * tier_params
        assert torch.cuda.memory_allocated() - allocated_before >= 14 * tier_params
        assert engine.slots.resident == 2 and engine.slots.num_slots == 2
    finally:
        engine.close()


def _trained_store(cfg: TrainConfig, steps: int) -> tuple[Any, Any]:
    builder = RunBuilder(cfg)
    structure = builder.model()
    store = builder.store(structure)
    engine = builder.engine(structure, store)
    vocab = structure.causal_lm.config.vocab_size
    for micro in make_batches(cfg, steps, vocab, 0, *builder.batch()):
        engine.train_step(micro, lr=cfg.optimizer.learning_rate)
    engine.wait_updates()
    return store, engine


def test_checkpoint_from_device_blocks_loads_anywhere(tmp_path: Path) -> None:
    store, engine = _trained_store(_cfg(2, dtype="bf16"), steps=2)
    try:
        path = save_checkpoint(tmp_path, 2, store, {}, keep_last=1, run_id="tier-test")
        # export binds the device blocks' bf16 weights (copied to the host)
        with store.bound(torch.bfloat16) as model:
            for block in store.layers[:2]:
                for e in block.entries:
                    got = model.get_parameter(e.full_name)
                    assert torch.equal(got, block.view(block.shadow, e).cpu())
    finally:
        engine.close()
    for tier in (0, LAYERS + 2):  # into host blocks, and into device blocks (all of them)
        fresh_store, fresh = _trained_store(_cfg(tier, dtype="bf16"), steps=0)
        try:
            load_checkpoint(path, fresh_store)
            for old, new in zip(store.blocks, fresh_store.blocks, strict=True):
                assert new.step == old.step == 2
                for kind in ("master", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(getattr(new, kind).cpu(), getattr(old, kind).cpu())
                assert torch.equal(new.source.cpu(), old.source.cpu())  # weights rewritten
        finally:
            fresh.close()
