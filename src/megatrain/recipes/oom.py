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

Several ranks step down together: recipes/rank_failures.py. Both undo the step and step the
plan down through recipes/step_down.py; this module drives the recovery of a recipe (the
`Recovering` protocol: what it uses of recipes/base.py `Recipe`, so that neither module
imports the other's back).

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

import gc
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from megatrain.checkpoint.rng import rng_state, set_rng_state
from megatrain.config import TrainConfig
from megatrain.distributed import rank_max
from megatrain.engine.engine import StepResult, StreamingEngine
from megatrain.model.structure import ModelStructure
from megatrain.planning.builder import StepDown
from megatrain.planning.hardware import GIB
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.rank_failures import RankFailures
from megatrain.recipes.step_down import SamePlan, is_out_of_memory, step_down
from megatrain.store.host import HostStore


class Recovering(Protocol):
    """What a recipe (recipes/base.py `Recipe`) lends its steps' recovery: its parts, of which
    the engine and the config are replaced when the plan changes, and the recovery's memory of
    the run (a step-up done; what the process held outside the allocator at the first step)."""

    builder: RunBuilder
    engine: StreamingEngine
    cfg: TrainConfig
    structure: ModelStructure
    store: HostStore
    rank_failures: RankFailures | None
    plan_stepped_up: bool
    outside_allocator_bytes: int | None


def recovering_step(
    recipe: Recovering, step: int, run: Callable[[StreamingEngine], StepResult], metrics: Any
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


def _step_up(recipe: Recovering, memory: Any, step: int, metrics: Any) -> None:
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
    recipe: Recovering,
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
    recipe: Recovering, step: int, report: Callable[[StepDown | SamePlan], None]
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
