"""The GPU update share (engine/gpu_share.py), its device path run on the CPU device.

The last N streamed blocks (the head, then the layers from the last) keep their gradient on
the device, rounded as the host landing holds it, and are updated there by the torch reference
of the host's C kernel (`CpuAdamW.update_reference`). The reference performs each float32
operation of the kernel once, correctly rounded, in the kernel's order, with the same scalars
and the same stochastic-rounding keys (tests/optim/test_optim_states_parity.py and the bf16
master tests check this per format); the held gradient is the same rounding of the same fp32
accumulator. So a run with N > 0 equals the run with N = 0 bit for bit: losses, gradient norms,
master, states, bf16 shadow and step counts, for every store format, with and without
clipping, beside a GPU tier, and across a resume. fp32 states with an fp32 master need the C
kernel on the host side (optimizer.impl torch runs torch's fused AdamW there, another order of
operations), so those cases take impl c.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

from megatrain.config import TrainConfig, load_config
from megatrain.engine import gpu_share
from megatrain.engine.gpu_share import BlockFormats, covered
from megatrain.engine.layout import SHARE_GRADS, SHARE_STAGING, DeviceLayout, held_bytes
from megatrain.native import load_adamw_kernel
from megatrain.planning.spec import block_sizes
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.sft import Trainer
from megatrain.verify import run_verify, verify_config, within
from run_helpers import FEW_SAMPLES, block_states, engine_steps

LAYERS = 4  # the tiny llama's decoder layers
BF16_MASTER = ("--optimizer.master_dtype", "bf16")
INT8_GRADS = ("--optimizer.grad_dtype", "int8")
needs_c = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler for the kernel")


def _cfg(share: int, *args: str, **shorthands: Any) -> TrainConfig:
    return verify_config(
        None,
        ["--optimizer.gpu_update_blocks", str(share), "--optimizer.weight_decay", "0.1", *args],
        model_type="llama",
        tiny=True,
        config_overrides={"num_hidden_layers": LAYERS, "tie_word_embeddings": False},
        **shorthands,
    )


def _layout_as_planned(engine: Any, builder: Any, store: Any) -> None:
    planned = DeviceLayout.of(
        engine.plan, block_sizes(builder.spec), store.compute_dtype, engine.share.formats
    )
    assert held_bytes(engine.device_buffers()) == planned.bytes_by_name()


def _train(cfg: TrainConfig, steps: int = 3) -> tuple[list[tuple[float, float]], dict, list]:
    results, _, store, engine = engine_steps(cfg, steps, check=_layout_as_planned)
    return results, block_states(store), [b.name for b in engine.share.blocks]


SHARE_ORDER = ["head", *(f"layer.{i}" for i in reversed(range(LAYERS)))]
C = ("--optimizer.impl", "c")
CASES = [
    # (share, overrides, compute dtype, max_grad_norm, GPU-tier layers)
    pytest.param(2, C, "bf16", 1.0, 0, marks=needs_c, id="fp32-states-bf16-compute"),
    pytest.param(3, C, "fp32", 1.0, 0, marks=needs_c, id="fp32-compute"),
    pytest.param(2, C, "bf16", 0.0, 0, marks=needs_c, id="fp32-states-no-clipping"),
    pytest.param(9, C, "fp32", 1.0, 2, marks=needs_c, id="beside-a-gpu-tier"),
    pytest.param(2, ("--optimizer.state_dtype", "int8"), "bf16", 1.0, 0, id="int8-states"),
    pytest.param(
        3, ("--optimizer.state_dtype", "int8", "--optimizer.gpu_update_sets", "2"), "bf16", 1.0,
        0, id="int8-states-two-staging-sets",
    ),
    pytest.param(99, ("--optimizer.state_dtype", "bf16"), "bf16", 1.0, 0, id="bf16-states-all"),
    pytest.param(
        2, (*BF16_MASTER, "--optimizer.state_dtype", "int4", *INT8_GRADS), "bf16", 1.0, 0,
        id="bf16-master-int4-int8-grads",
    ),
    pytest.param(
        2, (*BF16_MASTER, "--optimizer.state_dtype", "int4"), "bf16", 0.0, 0,
        id="bf16-master-int4-pool",
    ),
    pytest.param(
        3, (*BF16_MASTER, "--optimizer.state_dtype", "int8"), "bf16", 1.0, 0,
        id="bf16-master-int8",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("share", "args", "dtype", "clip", "tier"), CASES)
def test_share_equals_host_updates_bit_for_bit(
    share: int, args: tuple[str, ...], dtype: str, clip: float, tier: int
) -> None:
    tiered = ("--memory.gpu_state_blocks", str(tier))
    host, host_state, none = _train(_cfg(0, *args, *tiered, dtype=dtype, max_grad_norm=clip))
    ours, our_state, names = _train(_cfg(share, *args, *tiered, dtype=dtype, max_grad_norm=clip))
    assert none == []
    streamed = [n for n in SHARE_ORDER if n not in {f"layer.{i}" for i in range(tier)}]
    assert names == streamed[:share]
    assert ours == host  # losses and gradient norms, exactly
    if clip:
        assert any(norm > clip for _, norm in host), "clipping never triggered"
    assert our_state.keys() == host_state.keys()
    for key, value in host_state.items():
        assert torch.equal(our_state[key], value), key
    assert all(our_state[(n, "step")] == 3 for n in names)


@pytest.mark.parametrize("sets", [1, 2])
def test_share_buffers_are_planned(sets: int) -> None:
    """The held gradients and the staging sets (optimizer.gpu_update_sets: a set's next block's
    copies in wait for its previous block's copies back) are in the layout, sized by the
    formats."""
    cfg = _cfg(
        2,
        *BF16_MASTER,
        *("--optimizer.state_dtype", "int8", *INT8_GRADS),
        *("--optimizer.gpu_update_sets", str(sets)),
        dtype="bf16",
    )
    builder = RunBuilder(cfg)
    spec, plan = builder.spec, builder.engine_plan()
    formats = BlockFormats(master_dtype="bf16", state_dtype="int8", hold="int8")
    layout = DeviceLayout.of(plan, block_sizes(spec), torch.bfloat16, formats)
    assert builder.plan().estimate.gpu.items[SHARE_GRADS] == layout[SHARE_GRADS].bytes  # planned
    head, last = spec.head_params, spec.layers[-1].params
    # int8 codes + one fp32 unit per 2048 values, each part 256-byte aligned
    assert layout[SHARE_GRADS].bytes >= head + last + 4 * ((head + last) // 2048)
    assert layout[SHARE_GRADS].bytes <= head + last + 4 * ((head + last) // 2048 + 2) + 4 * 256
    # bf16 master, int8 m and v, their scales: the larger block's, no shadow
    big = max(head, last)
    staging = layout[SHARE_STAGING]
    assert plan.share_sets == staging.count == sets
    assert 4 * big <= staging.numel <= 4 * big + 8 * (big // 2048 + 1) + 5 * 256


DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def _demo(tmp: Path, *overrides: str) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """Train the demo 3 steps of 2 rows (a checkpoint every step; bf16 compute, slow on CPUs
    without native bf16); the last checkpoint's blocks, and the names of the share's blocks."""
    quiet = ["--logging.progress_bar", "false", "--logging.report_to", "none"]
    steps = ["--training.max_steps", "3", "--training.micro_batch_size", "2"]
    steps += ["--checkpoint.save_every", "1"]
    keep = ["--checkpoint.keep_last", "3", "--checkpoint.export_hf", "false"]
    args = [*quiet, *steps, *keep, "--data.val_size", "0", "--model.compute_dtype", "bf16"]
    args += FEW_SAMPLES
    cfg = load_config(DEMO, ["--training.output_dir", str(tmp), *args, *overrides])
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    names = [b.name for b in trainer.engine.share.blocks]
    out = {}
    for file in sorted((tmp / "checkpoints" / "step-00000003" / "blocks").iterdir()):
        with safe_open(str(file), framework="pt") as f:
            out[file.name] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out, names


def test_share_resumes_exactly(tmp_path: Path) -> None:
    """Resumed after step 1, a run with a share ends where the uninterrupted one does, which
    is where the run without a share ends (bf16 master, int4 states, int8 gradients)."""
    store = (*BF16_MASTER, "--optimizer.state_dtype", "int4", *INT8_GRADS)
    share = (*store, "--optimizer.gpu_update_blocks", "3")
    straight, names = _demo(tmp_path / "a", *share)
    assert names == ["head", "layer.3", "layer.2"]
    first = str(tmp_path / "a" / "checkpoints" / "step-00000001")
    resumed, _ = _demo(tmp_path / "b", *share, "--checkpoint.resume_from", first)
    baseline, none = _demo(tmp_path / "c", *store)
    assert none == []
    assert straight.keys() == resumed.keys() == baseline.keys()
    for name, tensors in straight.items():
        for key, saved in tensors.items():
            assert torch.equal(resumed[name][key], saved), (name, key)
            assert torch.equal(baseline[name][key], saved), (name, key)


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_share_matches_pytorch(clip: float) -> None:
    """megatrain verify with a share: the gradients it snapshots (the share's on the device)
    and the weights within the bf16 recipe's drift of plain PyTorch."""
    reports = run_verify(_cfg(3, dtype="bf16", max_grad_norm=clip, grad_accum=2))
    assert within(reports), [(r.excess, r.worst) for r in reports]


def test_covered_counts_overlapping_spans_once() -> None:
    """The share's GPU seconds: the union of the blocks' (start, end) spans, any order."""
    assert covered([]) == 0.0
    assert covered([(2.0, 5.0), (0.0, 1.0), (4.0, 6.0), (4.5, 5.5)]) == 5.0
    assert covered([(0.0, 10.0), (1.0, 2.0)]) == 10.0


def test_tensors_cuda_refuses_to_register_are_counted_as_pageable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_pin` page-locks large tensors where they lie; one it cannot stays where it is (a
    copy into pinned memory would take its size again) and its bytes are reported, so the run
    can say why the share's copies are slow. Large enough: `pinnable` (store/memory.py)."""
    master, m, v = (torch.zeros(64) for _ in range(3))
    block = SimpleNamespace(
        master=master, shadow=None, state_tensors=lambda: {"exp_avg": m, "exp_avg_sq": v}
    )
    monkeypatch.setattr(gpu_share, "pinnable", lambda nbytes: True)
    monkeypatch.setattr(gpu_share, "pin_in_place", lambda t: t is master)  # m, v refused
    assert gpu_share._pin(block) == 2 * 64 * 4  # type: ignore[arg-type]
    assert block.master is master  # nothing moved
