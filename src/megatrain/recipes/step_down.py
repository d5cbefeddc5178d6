"""One step that ran out of GPU memory, undone and its plan stepped down: the parts the
one-process recovery (recipes/oom.py) and several ranks' (recipes/rank_failures.py) share. Is an
error the GPU out of memory (`is_out_of_memory`, `outside_allocator`), what was missing
(`shortfall_bytes`), the step undone and the next smaller plan (`step_down`), or the same plan
once the allocator's cache is released (`SamePlan`); the messages of what cannot be undone.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from megatrain.engine.engine import StreamingEngine
from megatrain.engine.plan import tier_order
from megatrain.errors import GpuOutOfMemory
from megatrain.planning.builder import PlanBuilder, StepDown
from megatrain.planning.hardware import GIB
from megatrain.store.host import HostStore

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TRIED = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
FIX = (
    "lower training.micro_batch_size (raise gradient_accumulation_steps to keep the tokens "
    "per step) or data.cutoff_len, or give the plan more room: memory.gpu_margin_gib, "
    "memory.gpu_state_blocks 0, memory.activation_offload on, memory.mlp_tiles (more tiles)"
)


_DRIVER_OOM = ("out of memory", "ALLOC_FAILED")  # CUDA's, Triton's launch, cuBLAS / cuDNN


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is the GPU running out of memory: torch's OutOfMemoryError, or a kernel
    package's CUDA error saying so (Triton's launch of a kernel whose module or local memory
    the driver could not place: "Triton Error [CUDA]: out of memory"; cuBLAS / cuDNN
    *_ALLOC_FAILED), which torch does not turn into its own."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return (
        isinstance(error, RuntimeError)
        and ("CUDA" in text or "CUBLAS" in text or "CUDNN" in text)
        and any(marker in text for marker in _DRIVER_OOM)
    )


def outside_allocator(error: BaseException) -> bool:
    """Whether `error` is an out-of-memory error of the driver, not of PyTorch's allocator (a
    kernel package's launch): releasing the allocator's cache may be all it needs."""
    return is_out_of_memory(error) and not isinstance(error, torch.OutOfMemoryError)


@dataclass(frozen=True)
class SamePlan:
    """A step undone after a launch ran out of memory outside PyTorch's allocator, to run
    again on the same plan once the allocator's cached blocks are released."""

    error: str  # the error's first line
    event = "oom_retry"  # the metrics.jsonl record's kind

    def describe(self) -> str:
        return (
            f"a kernel launch ran out of GPU memory outside PyTorch's allocator ({self.error}), "
            "which held memory cached but unused: the cache was released and the step runs on "
            "the same plan (a second such failure in the step steps the plan down)"
        )

    def record(self) -> dict[str, Any]:
        return {"error": self.error}


def shortfall_bytes(error: BaseException, device: torch.device) -> int:
    """What the failed allocation asked for (from torch's message; 1 GiB if it does not say),
    plus what the allocator held reserved but unused at the failure."""
    found = _TRIED.search(str(error))
    asked = int(float(found.group(1)) * _UNITS[found.group(2)]) if found else GIB
    slack = 0
    if device.type == "cuda":
        slack = max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return asked + slack


def step_down(
    error: BaseException,
    *,
    step: int,
    builder: PlanBuilder,
    engine: StreamingEngine | None = None,
    store: HostStore | None = None,
    same_plan_ok: bool = False,
) -> StepDown | SamePlan:
    """Undo the failed `step` on `engine` (None: building the engine ran out of memory; give
    the `store` then) and step `builder`'s plan down, the store's blocks beyond the smaller
    tier back on the host; the caller builds a new engine from `builder` and reruns the step
    (from outside its `except` block, so that the failed step's tensors are freed). With
    `same_plan_ok`, a launch that failed outside PyTorch's allocator keeps the plan
    (`SamePlan`). Raises GpuOutOfMemory when it cannot. One process; several ranks:
    `RankFailures.step_down`."""
    where = where_failed(error, step)
    if engine is not None and engine.updates_begun:
        raise GpuOutOfMemory(UPDATES_BEGUN.format(where=where, fix=FIX)) from error
    if same_plan_ok and outside_allocator(error):
        if engine is not None:
            engine.abandon_step()
        return SamePlan(first_line(error))
    change = smaller_plan(builder, shortfall_bytes(error, builder.device), where, error)
    change = dataclasses.replace(change, transient=outside_allocator(error))
    if engine is not None:
        engine.abandon_step()
    tier_to_host(builder, engine.store if engine is not None else store, change)
    return change


UPDATES_BEGUN = (
    "{where} after its first optimizer updates were applied (optimizer.max_grad_norm 0 "
    "updates each layer as its gradient lands), so it cannot be undone. Resume from the last "
    "checkpoint after you {fix}"
)


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"


def where_failed(error: BaseException, step: int) -> str:
    return f"step {step} ran out of GPU memory ({first_line(error)})"


def smaller_plan(
    builder: PlanBuilder, shortfall: int, where: str, error: BaseException | None
) -> StepDown:
    change = builder.step_down(shortfall)
    if change is None:
        raise GpuOutOfMemory(
            f"{where} and the plan has nothing left to give up "
            f"({builder.engine_plan().describe()}). To fit, {FIX}"
        ) from error
    return change


def tier_to_host(builder: PlanBuilder, store: HostStore | None, change: StepDown) -> None:
    assert store is not None, "step_down needs the engine or the store"
    for block in tier_order(store.layers, store.embed, store.head)[change.after.gpu_state_blocks :]:
        if block.master.device.type != "cpu":  # a tier block leaving the GPU
            block.to_host(pin=builder.pin_memory)
