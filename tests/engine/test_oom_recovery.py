"""A step that runs out of GPU memory is undone and run again on a smaller plan
(megatrain/recipes/oom.py).

On the CPU the GPU tier runs its device code path (tests/engine/test_gpu_tier.py), so a run
planned with 3 tier blocks, whose step 2 raises torch's OutOfMemoryError in the middle of its
backward (after the last layers' gradients were shipped into the host shadows), must step down
to a smaller tier and finish with exactly the losses of a run planned with that tier from the
start: the tier's update is the host's C kernel bit for bit (its torch reference, on the same
gradient rounding), so the losses are equal in fp32 and bf16 compute. The shadows that received
gradients (the host's, and in bf16 compute the tier's on the device) must get their weights
back, or step 2's rerun would compute on gradients as weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.engine.engine import StreamingEngine
from megatrain.errors import GpuOutOfMemory
from megatrain.native import load_adamw_kernel
from megatrain.planning.hardware import GIB
from megatrain.recipes import oom
from megatrain.recipes.sft import Trainer
from megatrain.recipes.step_down import is_out_of_memory
from run_helpers import FEW_SAMPLES

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
STEPS = 4
needs_c = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler for the kernel")
OOM = "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _trainer(tmp: Path, tier: int, *overrides: str) -> Trainer:
    cfg = load_config(
        DEMO,
        [
            *("--training.output_dir", str(tmp)),
            *("--training.max_steps", str(STEPS)),
            *("--memory.gpu_state_blocks", str(tier)),
            *("--optimizer.impl", "c" if load_adamw_kernel() is not None else "torch"),
            *("--logging.progress_bar", "false"),
            *("--logging.report_to", "none"),
            *("--checkpoint.export_hf", "false"),
            *("--data.val_size", "0"),
            *FEW_SAMPLES,
            *overrides,
        ],
    )
    return Trainer(cfg)


def _losses(trainer: Trainer) -> list[float]:
    try:
        return trainer.train().losses
    finally:
        trainer.close()


def _oom_once(
    monkeypatch: pytest.MonkeyPatch,
    *,
    step: int,
    layer: int,
    error: Exception | None = None,
    times: int = 1,
) -> list[int]:
    """Raise OutOfMemoryError (or `error`) once (or `times` times: the step's reruns too), in
    `step`'s backward of decoder layer `layer`."""
    real = StreamingEngine._backward_layer
    seen = {"backwards": 0}
    raised: list[int] = []

    def backward_layer(self, i, *args, **kwargs):  # type: ignore[no-untyped-def]
        if i == 0:
            seen["backwards"] += 1
        if len(raised) < times and i == layer and seen["backwards"] == step - 1:
            raised.append(i)
            raise error if error is not None else torch.OutOfMemoryError(OOM)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(StreamingEngine, "_backward_layer", backward_layer)
    return raised


@pytest.mark.parametrize(
    ("dtype", "states"), [("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "int8")]
)
@needs_c
def test_out_of_memory_steps_down_and_matches_a_run_planned_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, states: str
) -> None:
    """int8 states: a compressed tier's blocks (docs/optimizer_states.md) step down to the host
    worker's update with their codes and scales, the same arithmetic (on the CPU the tensors
    stay where they are: the copies of ParamBlock.to_host are CUDA's)."""
    dt = ("--model.compute_dtype", dtype, "--optimizer.state_dtype", states)
    if dtype == "bf16":  # 2 rows a step: CPU bf16 matmuls are slow without native bf16
        dt += ("--training.micro_batch_size", "2")
    expected = _losses(_trainer(tmp_path / "small", 0, *dt))
    raised = _oom_once(monkeypatch, step=2, layer=1)  # layers 3, 2 shipped, layer 1 fails
    trainer = _trainer(tmp_path / "recovered", 3, *dt)
    losses = _losses(trainer)
    assert raised == [1]
    assert trainer.builder.engine_plan().gpu_state_blocks == 0  # the CPU's "auto" tier, and below 3
    assert len(trainer.engine.tier) == 0
    assert losses == expected  # bit for bit: same AdamW, same numbers, same order
    events = [
        json.loads(line)
        for line in (tmp_path / "recovered" / "metrics.jsonl").read_text().splitlines()
    ]
    down = [e for e in events if e["kind"] == "plan_step_down"]
    assert len(down) == 1 and down[0]["step"] == 2
    assert down[0]["gpu_state_blocks"] == [3, 0]
    assert down[0]["gpu_margin_gib"][1] >= down[0]["gpu_margin_gib"][0] + 1.5
    assert [e["step"] for e in events if e["kind"] == "train"] == list(range(1, STEPS + 1))


def test_no_smaller_plan_stops_with_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _oom_once(monkeypatch, step=2, layer=1)
    trainer = _trainer(tmp_path, 0)
    with pytest.raises(GpuOutOfMemory, match=r"step 2 ran out of GPU memory .*micro_batch_size"):
        _losses(trainer)


def test_updates_already_applied_stop_with_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without clipping each layer is updated as its gradient lands: layer 3's update is
    applied before layer 1 fails, so the step cannot be undone."""
    _oom_once(monkeypatch, step=2, layer=1)
    trainer = _trainer(tmp_path, 3, "--optimizer.max_grad_norm", "0")
    with pytest.raises(GpuOutOfMemory, match="first optimizer updates were applied"):
        _losses(trainer)


def _events(run: Path, kind: str) -> list[dict[str, object]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of a run planned with 3 tier blocks that never fails: what the kernel-launch
    tests' recovered runs must give (one run, shared)."""
    return _losses(_trainer(tmp_path_factory.mktemp("planned"), 3))


TRITON_OOM = "Triton Error [CUDA]: out of memory"


@needs_c
def test_a_kernel_launch_out_of_memory_reruns_the_step_on_the_same_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planned: list[float]
) -> None:
    """Triton reports a launch the driver could not place (flash-linear-attention's autotuning
    beside a packed plan, while PyTorch's allocator held GiB cached: docs/performance.md run
    41) as a RuntimeError, not torch's OutOfMemoryError. The first in a step keeps the plan:
    the cache released, the step runs again, the losses those of a run that never failed."""
    raised = _oom_once(monkeypatch, step=2, layer=1, error=RuntimeError(TRITON_OOM))
    trainer = _trainer(tmp_path / "recovered", 3)
    assert _losses(trainer) == planned and raised == [1]
    assert trainer.builder.engine_plan().gpu_state_blocks == 3
    retry = _events(tmp_path / "recovered", "oom_retry")
    assert len(retry) == 1 and retry[0]["step"] == 2 and retry[0]["error"] == TRITON_OOM
    assert not _events(tmp_path / "recovered", "plan_step_down")


@needs_c
def test_a_second_kernel_launch_out_of_memory_steps_down_for_the_step_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planned: list[float]
) -> None:
    """The same launch failing again in the step's rerun (flash-linear-attention's autotuning
    beside the step's own peak, run 41): the step runs on a smaller plan, then the plan goes
    back up (the tuned kernels launch in far less): tier 3 -> 0 for step 2, 3 again from step
    3, and the losses of a run that never failed (the tier's and the host's AdamW agree bit
    for bit here)."""
    raised = _oom_once(monkeypatch, step=2, layer=1, error=RuntimeError(TRITON_OOM), times=2)
    trainer = _trainer(tmp_path / "recovered", 3)
    assert _losses(trainer) == planned and raised == [1, 1]
    assert trainer.builder.engine_plan().gpu_state_blocks == 3
    assert len(trainer.engine.tier) == 3
    run = tmp_path / "recovered"
    assert len(_events(run, "oom_retry")) == 1
    (down,) = _events(run, "plan_step_down")
    assert down["step"] == 2 and down["gpu_state_blocks"] == [3, 0] and down["transient"]
    (up,) = _events(run, "plan_step_up")
    assert up["step"] == 2 and up["gpu_state_blocks"] == [0, 3]
    assert up["outside_allocator_gib"] == 0  # nothing held outside an allocator on the CPU
    assert [e["step"] for e in _events(run, "train")] == list(range(1, STEPS + 1))


@needs_c
def test_the_plan_stays_down_where_kernels_hold_memory_outside_the_allocator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planned: list[float]
) -> None:
    """After the step-down for one step, the process holds 2 GiB more outside PyTorch's
    allocator than when the run began (the autotuned kernels' modules and local memory, which
    stay loaded: run 42 went back up and ran out of memory in the next step). The plan that
    leaves those free has no more tier blocks than the smaller one (the CPU's "auto" is 0), so
    the plan stays down and says so; the losses are still those of a run that never failed."""
    _oom_once(monkeypatch, step=2, layer=1, error=RuntimeError(TRITON_OOM), times=2)
    held = iter([0, 2 * GIB])  # as the first step begins, after step 2
    monkeypatch.setattr(oom, "held_outside_allocator", lambda device: next(held))
    trainer = _trainer(tmp_path / "recovered", 3)
    assert _losses(trainer) == planned
    assert trainer.builder.engine_plan().gpu_state_blocks == 0
    run = tmp_path / "recovered"
    assert not _events(run, "plan_step_up")
    (kept,) = _events(run, "plan_kept")
    assert kept["step"] == 2 and kept["outside_allocator_gib"] == 2.0
    assert [e["step"] for e in _events(run, "train")] == list(range(1, STEPS + 1))


@needs_c
def test_the_plan_goes_back_up_once_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches failing again after the plan went back up: the step-down is for good."""
    real = StreamingEngine._backward_layer
    seen = {"backwards": 0, "raised": 0}

    def backward_layer(self, i, *args, **kwargs):  # type: ignore[no-untyped-def]
        if i == 0:
            seen["backwards"] += 1
        if i == 1 and seen["backwards"] in (1, 2) and self.tier and seen["raised"] < 4:
            seen["raised"] += 1  # steps 2 and 3, twice each while a tier is on the "GPU"
            raise RuntimeError(TRITON_OOM)
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(StreamingEngine, "_backward_layer", backward_layer)
    trainer = _trainer(tmp_path, 3)
    _losses(trainer)
    assert trainer.builder.engine_plan().gpu_state_blocks == 0
    assert [e["step"] for e in _events(tmp_path, "plan_step_up")] == [2]
    assert [e["step"] for e in _events(tmp_path, "plan_step_down")] == [2, 3]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError(OOM), True),
        (RuntimeError("Triton Error [CUDA]: out of memory"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_what_counts_as_out_of_memory(error: Exception, expected: bool) -> None:
    assert is_out_of_memory(error) is expected
