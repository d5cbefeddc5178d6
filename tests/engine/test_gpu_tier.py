"""The GPU tier of optimizer states, run as its device-side code path on the CPU.

The first k blocks (layers, then embedding, then head) keep master, m, v (and, bf16 compute,
their weights, where the gradient lands) "on the device" (here: the CPU device) and are updated
by the engine (`CpuAdamW.update_device`: here the torch reference of the C kernel), not the
host worker. Checked against two references:
- the host path (the C kernel for fp32 states; the compressed formats' reference elsewhere):
  every loss, gradient norm, weight and state is equal bit for bit, in fp32 and bf16 compute,
  because the same operations run in the same order on the same numbers (a tier block's
  gradient lands in its shadow rounded as the host's lands in the host shadow);
- plain PyTorch (megatrain verify), for k = 1, 2 and all blocks, with and without clipping,
  with gradient accumulation, in fp32 and bf16 compute, tied and untied embeddings.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from megatrain.config import TrainConfig
from megatrain.engine.layout import DeviceLayout, held_bytes
from megatrain.native import load_adamw_kernel
from megatrain.optim.adamw import CpuAdamW
from megatrain.planning.spec import block_sizes
from megatrain.recipes.builder import RunBuilder
from megatrain.store.blocks import ParamBlock
from megatrain.verify import run_verify, verify_config, within
from run_helpers import engine_steps

LAYERS = 4  # the tiny llama's decoder layers
ORDER = [*(f"layer.{i}" for i in range(LAYERS)), "embed", "head"]  # tier order
STATES = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
needs_c = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler for the kernel")


def _cfg(tier: int, *args: str, tied: bool = False, **shorthands: Any) -> TrainConfig:
    return verify_config(
        None,
        ["--memory.gpu_state_blocks", str(tier), *args],
        model_type="llama",
        tiny=True,
        config_overrides={"num_hidden_layers": LAYERS, "tie_word_embeddings": tied},
        **shorthands,
    )


class _RecordingAdamW(CpuAdamW):
    """The real optimizer, noting which blocks it updated where (True: on the device)."""

    def __init__(self, base: CpuAdamW) -> None:
        super().__init__(base.hyper, impl=base.impl, num_threads=base.num_threads)
        self.calls: list[tuple[str, bool]] = []

    def update(self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0) -> None:
        self.calls.append((block.name, False))
        super().update(block, lr=lr, grad_scale=grad_scale)

    def update_device(
        self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0, chunk: int
    ) -> None:
        self.calls.append((block.name, True))
        super().update_device(block, lr=lr, grad_scale=grad_scale, chunk=chunk)


def _layout_as_planned(engine: Any, builder: Any, store: Any) -> None:
    """The engine's device buffers are the planner's layout (the tier's bytes included)."""
    planned = DeviceLayout.of(
        engine.plan, block_sizes(builder.spec), store.compute_dtype, engine.share.formats
    )
    assert held_bytes(engine.device_buffers()) == planned.bytes_by_name()


def _train(cfg: TrainConfig, steps: int) -> tuple[list[tuple[float, float]], dict, list]:
    optimizer = _RecordingAdamW(RunBuilder(cfg).optimizer())
    results, builder, store, engine = engine_steps(
        cfg, steps, optimizer=optimizer, check=_layout_as_planned
    )
    assert len(engine.tier) == builder.engine_plan().gpu_state_blocks
    assert engine.slots.resident == min(len(engine.tier), LAYERS)
    state = {
        (b.name, kind): getattr(b, kind).clone()
        for b in store.blocks
        for kind in ("master", "shadow", *STATES)
        if getattr(b, kind) is not None
    }
    state |= {(b.name, "step"): torch.tensor(b.step) for b in store.blocks}
    return results, state, optimizer.calls


C = ("--optimizer.impl", "c")


@pytest.mark.parametrize(
    ("tier", "clip", "tied", "dtype"),
    [
        (1, 1.0, False, "fp32"),
        (2, 0.0, False, "fp32"),
        (LAYERS, 1.0, True, "fp32"),
        (LAYERS + 1, 0.0, True, "fp32"),  # + the embedding (the tied lm_head)
        (LAYERS + 2, 1.0, False, "fp32"),  # everything
        (LAYERS + 2, 0.0, True, "fp32"),
        (2, 1.0, False, "bf16"),  # the gradient lands in the tier's bf16 weights
        (LAYERS + 1, 1.0, True, "bf16"),
        (LAYERS + 2, 0.0, False, "bf16"),
    ],
)
@needs_c
def test_tier_equals_host_path_bit_for_bit(tier: int, clip: float, tied: bool, dtype: str) -> None:
    kw: dict[str, Any] = {"max_grad_norm": clip, "tied": tied, "dtype": dtype}
    host, host_state, host_calls = _train(_cfg(0, *C, **kw), steps=3)
    ours, our_state, calls = _train(_cfg(tier, *C, **kw), steps=3)
    assert ours == host  # losses and gradient norms, exactly
    if clip:
        assert any(norm > clip for _, norm in host), "clipping never triggered"
    assert our_state.keys() == host_state.keys()
    for key, value in host_state.items():
        assert torch.equal(our_state[key], value), key
    tier_names = set(ORDER[:tier])
    assert all(not on_device for _, on_device in host_calls)
    # tier blocks only on the device path, every other block only through the host worker
    assert {name for name, on_device in calls if on_device} == tier_names
    assert not tier_names & {name for name, on_device in calls if not on_device}
    assert sorted(calls) == sorted((name, name in tier_names) for name, _ in host_calls)


@pytest.mark.parametrize("states", ["bf16", "int8"])
@pytest.mark.parametrize(("tier", "clip", "dtype"), [(2, 1.0, "fp32"), (LAYERS + 2, 0.0, "bf16")])
def test_a_compressed_tier_equals_the_host_update_bit_for_bit(
    states: str, tier: int, clip: float, dtype: str
) -> None:
    """bf16 (stochastic rounding) and int8 states stay in their stored format on the device and
    are updated there by `CpuAdamW.update_device` (on CUDA the fused kernel, here the torch
    reference of the C kernel): the same codes, scales, masters and losses as the host's update
    of the same gradients."""
    args = ("--optimizer.state_dtype", states)
    host, host_state, _ = _train(_cfg(0, *args, max_grad_norm=clip, dtype=dtype), steps=3)
    ours, our_state, calls = _train(_cfg(tier, *args, max_grad_norm=clip, dtype=dtype), steps=3)
    assert ours == host
    assert our_state.keys() == host_state.keys()
    for key, value in host_state.items():
        assert torch.equal(our_state[key].cpu(), value), key
    assert {name for name, on_device in calls if on_device} == set(ORDER[:tier])
    if states == "int8":
        assert ("layer.0", "exp_avg_scale") in host_state  # the scales were compared too


@pytest.mark.parametrize(
    ("tier", "clip", "dtype", "tied"),
    [
        (1, 1.0, "fp32", False),
        (2, 0.0, "fp32", True),
        (LAYERS + 2, 1.0, "fp32", True),
        (2, 1.0, "bf16", False),
        (LAYERS + 2, 0.0, "bf16", False),
    ],
)
def test_tier_matches_pytorch(tier: int, clip: float, dtype: str, tied: bool) -> None:
    cfg = _cfg(tier, max_grad_norm=clip, dtype=dtype, grad_accum=2, tied=tied)
    reports = run_verify(cfg)
    assert within(reports), [(r.excess, r.worst) for r in reports]
    if clip:
        assert any(r.clipped for r in reports)
    assert all(r.loss_rel < (1e-5 if dtype == "fp32" else 1e-3) for r in reports)


def test_more_blocks_than_the_model_has_means_all() -> None:
    builder = RunBuilder(_cfg(99))
    assert builder.engine_plan().gpu_state_blocks == LAYERS + 2
    assert builder.plan().gpu_state_blocks == LAYERS + 2


class _SlowDeviceAdamW(_RecordingAdamW):
    """The real optimizer; each tier update (on the device) takes SLOW_S more host time."""

    SLOW_S = 0.02

    def update_device(
        self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0, chunk: int
    ) -> None:
        time.sleep(self.SLOW_S)
        super().update_device(block, lr=lr, grad_scale=grad_scale, chunk=chunk)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_the_step_times_the_tier_updates_apart_from_compute(
    clip: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """time/tier_update_s: the tier's AdamW of the step (on the CPU, its host time), where
    the updates are queued, after the backward with clipping, inside it without; compute_s
    keeps layer compute only."""
    from megatrain.engine.engine import StreamingEngine

    timelines: list[Any] = []
    train_step = StreamingEngine.train_step

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = train_step(self, *args, **kwargs)
        timelines.append(result.timeline)
        return result

    monkeypatch.setattr(StreamingEngine, "train_step", recorded)
    for tier in (0, 2):
        cfg = _cfg(tier, max_grad_norm=clip)
        timelines.clear()
        engine_steps(cfg, 2, optimizer=_SlowDeviceAdamW(RunBuilder(cfg).optimizer()))
        slow = tier * _SlowDeviceAdamW.SLOW_S
        for timeline in timelines:
            assert (timeline.tier_update_s >= slow) if tier else timeline.tier_update_s == 0
            assert timeline.compute_s < timeline.step_s - timeline.tier_update_s
