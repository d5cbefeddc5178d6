"""A training step that ran out of GPU memory: undone, the plan stepped down, run again.

The plan packs the GPU to within `memory.gpu_margin_gib`; a prediction a little short (an
architecture's kernels, the allocator's own slack) must not end a run hours in. When a step
raises torch's OutOfMemoryError (or a kernel package's CUDA out-of-memory error: Triton's
autotuning loads kernels into memory the plan cannot see) before any of its optimizer updates
began (with clipping, the
default, updates start only after the whole backward), nothing of it is applied: the engine
waits for its copies, puts back the bf16 weights that the shipped gradients overwrote in the
host shadows (from the untouched fp32 master) and closes; `recovering_step` (what every
recipe runs its steps through: recipes/base.py `optimizer_step`) restores the RNG state and
runs the same micro-batches again on an engine built from the next smaller plan
(`PlanBuilder.step_down`: at least one GPU-tier block fewer while there are any, planned with
the missing bytes added to the margin, so "auto" layer-input and tile choices follow). Tier
blocks leaving the GPU move their master and AdamW states back to the host unchanged.

Several ranks step down together: recipes/rank_failures.py.

A kernel package's launch that the driver could not place (Triton loading a kernel's module
and local memory, first while flash-linear-attention autotunes) asks for memory outside
PyTorch's allocator, which may hold several GiB cached but unused at that moment: the first
such failure of a step is undone and the step run again on the same plan once the allocator's
cache is released (`SamePlan`); only a second one in the same step steps the plan down, for
that step: after it the plan goes back up (once a run), leaving free what the process then
holds outside the allocator beyond what it held as the run's first step began (the tuned
kernels' modules and the driver's local memory stay loaded: run 42 of docs/performance.md went
back to its full plan and ran out of memory in the next step), or stays down where that leaves
no larger plan (`plan_kept`).

Not recoverable, stopped with one paragraph (`GpuOutOfMemory`) naming what to change: a step
whose updates had begun on any rank (optimizer.max_grad_norm 0 updates each layer as its
gradient lands), and a plan that cannot get smaller.
"""

from __future__ import annotations

import dataclasses
import gc
import re
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatrain.checkpoint.rng import rng_state, set_rng_state
from megatrain.distributed import rank_max
from megatrain.engine.engine import StepResult, StreamingEngine
from megatrain.engine.plan import tier_order
from megatrain.errors import GpuOutOfMemory
from megatrain.planning.builder import PlanBuilder, StepDown
from megatrain.planning.hardware import GIB
from megatrain.store.host import HostStore

if TYPE_CHECKING:  # the base recipe imports this module
    from megatrain.recipes.base import Recipe
    from megatrain.recipes.rank_failures import RankFailures

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


def recovering_step(
    recipe: Recipe, step: int, run: Callable[[StreamingEngine], StepResult], metrics: Any
) -> StepResult:
    """`run(recipe.engine)`, optimizer step `step`; out of GPU memory (on any rank), undone,
    the plan stepped down, the engine rebuilt from `recipe.builder` (recipes/base.py; its
    `structure` and `store`) and the step run again; the recipe's `engine` and `cfg` are
    replaced. Each change is reported once: a paragraph on the console and a
    `plan_step_down` record in `metrics` (MetricsLogger); a launch that ran out of memory
    outside PyTorch's allocator first reruns the step on the same plan (`oom_retry`)."""

    def report(change: StepDown | SamePlan) -> None:
        message = f"step {step} ran out of GPU memory and is run again: {change.describe()}"
        metrics.log_event(step, change.event, change.record(), message)

    failures = recipe.rank_failures
    if recipe.outside_allocator_bytes is None:  # before the run's first step
        recipe.outside_allocator_bytes = held_outside_allocator(recipe.builder.device)
    same_plan_ok = True  # once a step
    planned = recipe.builder.cfg.memory  # the plan a transient step-down goes back to
    while True:
        rng = rng_state()
        try:
            if failures is not None:
                recipe.engine.before_updates = failures.check
            with _watching(failures):
                result = run(recipe.engine)
            break
        except Exception as e:
            change = _recover(
                e, step, recipe, failures, engine=recipe.engine, same_plan_ok=same_plan_ok
            )
        # outside the except block: the failed step's frames, and the GPU memory they
        # hold, are gone
        same_plan_ok = same_plan_ok and not isinstance(change, SamePlan)
        if isinstance(change, StepDown) and not change.transient:
            planned = recipe.builder.cfg.memory  # smaller for good
        report(change)
        _rebuild_engine(recipe, step, report)
        set_rng_state(rng)
    if planned != recipe.builder.cfg.memory and not recipe.plan_stepped_up:
        _step_up(recipe, planned, step, metrics)
    return result


def held_outside_allocator(device: torch.device) -> int:
    """GPU memory this process holds outside PyTorch's allocator: the CUDA context, loaded
    kernel modules, the driver's local memory for the kernels launched so far (a kernel
    package's autotuning launches many), NCCL's buffers. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def _step_up(recipe: Recipe, memory: Any, step: int, metrics: Any) -> None:
    """Back to the plan before this step's transient step-down (once a run: a launch outside
    the allocator that fails again later steps down for good), leaving free what the process
    now holds outside PyTorch's allocator beyond what it held when the run's first step began;
    the plan stays where that leaves it no larger."""
    recipe.plan_stepped_up = True
    began = recipe.outside_allocator_bytes or 0
    grown = max(0, held_outside_allocator(recipe.builder.device) - began)
    if recipe.rank_failures is not None:
        grown = rank_max(grown)  # every rank plans the same
    outside = {"outside_allocator_gib": round(grown / GIB, 2)}  # both records carry it
    held = f"{grown / GIB:.2f} GiB more outside PyTorch's allocator than when the run began"
    change = recipe.builder.step_up(memory, grown)
    if change is None:
        message = (
            f"after step {step} the plan stays at {recipe.builder.engine_plan().describe()}: "
            f"kernel launches hold {held} (a kernel package's loaded and autotuned kernels), "
            "and the plan before the step-down would not leave that free"
        )
        metrics.log_event(step, "plan_kept", outside, message)
        return
    recipe.engine.close()  # every update of the step applied before blocks move
    message = (
        f"after step {step} the plan goes back up: {change.changes()} (the step-down came from "
        "kernel launches outside PyTorch's allocator, which a kernel package's autotuning "
        f"makes in its first steps; they hold {held}); predicted step "
        f"{change.step_s[0]:.2f} s -> {change.step_s[1]:.2f} s"
    )
    metrics.log_event(step, "plan_step_up", {**change.record(), **outside}, message)
    _rebuild_engine(
        recipe,
        step,
        lambda down: metrics.log_event(
            step, down.event, down.record(), f"step {step}: {down.describe()}"
        ),
    )


def _watching(failures: RankFailures | None) -> Any:
    return failures.watching() if failures is not None else nullcontext()


def _recover(
    error: Exception,
    step: int,
    recipe: Recipe,
    failures: RankFailures | None,
    *,
    engine: StreamingEngine | None = None,
    same_plan_ok: bool = False,
) -> StepDown | SamePlan:
    """The step-down after `error` (re-raised when it is not part of an out-of-memory step)."""
    if failures is None and not is_out_of_memory(error):
        raise error
    if failures is None or failures.joins(error):
        down = step_down if failures is None else failures.step_down
        return down(
            error,
            step=step,
            builder=recipe.builder,
            engine=engine,
            store=recipe.store,
            same_plan_ok=same_plan_ok,
        )
    if failures.failed_elsewhere():
        raise SystemExit(1) from None  # the rank whose error it was says what happened
    failures.announce_failure()
    raise error


def _rebuild_engine(
    recipe: Recipe, step: int, report: Callable[[StepDown | SamePlan], None]
) -> None:
    """A new engine from the builder's (smaller) plan; stepped down again while even
    building it runs out of GPU memory. The recipe's config becomes the plan's (what its
    checkpoints save)."""
    recipe.engine = None  # type: ignore[assignment]  # its GPU memory goes first
    recipe.cfg = recipe.builder.cfg
    while True:
        gc.collect()
        torch.cuda.empty_cache()
        try:
            with _watching(recipe.rank_failures):
                recipe.engine = recipe.builder.engine(recipe.structure, recipe.store)
            return
        except Exception as e:
            change = _recover(e, step, recipe, recipe.rank_failures)
        report(change)
        recipe.cfg = recipe.builder.cfg
