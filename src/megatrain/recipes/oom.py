"""A training step that ran out of GPU memory: undone, the plan stepped down, run again.

The plan packs the GPU to within `memory.gpu_margin_gib`; a prediction a little short (an
architecture's kernels, the allocator's own slack) must not end a run hours in. When a step
raises torch's OutOfMemoryError before any of its optimizer updates began (with clipping, the
default, updates start only after the whole backward), nothing of it is applied: the engine
waits for its copies, puts back the bf16 weights that the shipped gradients overwrote in the
host shadows (from the untouched fp32 master) and closes; `recovering_step` (what every
recipe runs its steps through: recipes/base.py `optimizer_step`) restores the RNG state and
runs the same micro-batches again on an engine built from the next smaller plan
(`PlanBuilder.step_down`: at least one GPU-tier block fewer while there are any, planned with
the missing bytes added to the margin, so "auto" layer-input and tile choices follow). Tier
blocks leaving the GPU move their master and AdamW states back to the host unchanged.

Not recoverable, stopped with one paragraph (`GpuOutOfMemory`) naming what to change: a step
whose updates had begun (optimizer.max_grad_norm 0 updates each layer as its gradient lands),
several ranks (the others wait inside a collective for the failed one: they cannot step down
together without aborting the process group), and a plan that cannot get smaller.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatrain.checkpoint.rng import rng_state, set_rng_state
from megatrain.engine.engine import StepResult, StreamingEngine
from megatrain.engine.plan import tier_order
from megatrain.errors import GpuOutOfMemory
from megatrain.planning.builder import PlanBuilder, StepDown
from megatrain.planning.hardware import GIB
from megatrain.store.host import HostStore

if TYPE_CHECKING:  # the base recipe imports this module
    from megatrain.recipes.base import Recipe

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TRIED = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_FIX = (
    "lower training.micro_batch_size (raise gradient_accumulation_steps to keep the tokens "
    "per step) or data.cutoff_len, or give the plan more room: memory.gpu_margin_gib, "
    "memory.gpu_state_blocks 0, memory.activation_offload on, memory.mlp_tiles (more tiles)"
)


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
) -> StepDown:
    """Undo the failed `step` on `engine` (None: building the engine ran out of memory; give
    the `store` then) and step `builder`'s plan down, the store's blocks beyond the smaller
    tier back on the host; the caller builds a new engine from `builder` and reruns the step
    (from outside its `except` block, so that the failed step's tensors are freed). Raises
    GpuOutOfMemory when it cannot."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
    where = f"step {step} ran out of GPU memory ({first_line})"
    if builder.placement.world_size > 1:
        raise GpuOutOfMemory(
            f"{where} on rank {builder.placement.rank}. Several ranks cannot step the plan down "
            f"together yet; resume from the last checkpoint after you {_FIX}"
        ) from error
    if engine is not None and engine.updates_begun:
        raise GpuOutOfMemory(
            f"{where} after its first optimizer updates were applied (optimizer.max_grad_norm "
            f"0 updates each layer as its gradient lands), so it cannot be undone. Resume from "
            f"the last checkpoint after you {_FIX}"
        ) from error
    store = engine.store if engine is not None else store
    assert store is not None, "step_down needs the engine or the store"
    change = builder.step_down(shortfall_bytes(error, builder.device))
    if change is None:
        raise GpuOutOfMemory(
            f"{where} and the plan has nothing left to give up "
            f"({builder.engine_plan().describe()}). To fit, {_FIX}"
        ) from error
    if engine is not None:
        engine.abandon_step()
    for block in tier_order(store.layers, store.embed, store.head)[change.after.gpu_state_blocks :]:
        if block.master.device.type != "cpu":  # a tier block leaving the GPU
            block.to_host(pin=builder.pin_memory)
    return change


def recovering_step(
    recipe: Recipe, step: int, run: Callable[[StreamingEngine], StepResult], metrics: Any
) -> StepResult:
    """`run(recipe.engine)`, optimizer step `step`; out of GPU memory, undone, the plan stepped
    down, the engine rebuilt from `recipe.builder` (recipes/base.py; its `structure` and
    `store`) and the step run again; the recipe's `engine` and `cfg` are replaced. Each
    change is reported once: a paragraph on the console and a `plan_step_down` record in
    `metrics` (MetricsLogger)."""

    def report(change: StepDown) -> None:
        message = f"step {step} ran out of GPU memory and is run again: {change.describe()}"
        metrics.log_event(step, "plan_step_down", change.record(), message)

    while True:
        rng = rng_state()
        try:
            return run(recipe.engine)
        except torch.OutOfMemoryError as e:
            change = step_down(e, step=step, builder=recipe.builder, engine=recipe.engine)
        # outside the except block: the failed step's frames, and the GPU memory they
        # hold, are gone
        report(change)
        _rebuild_engine(recipe, step, report)
        set_rng_state(rng)


def _rebuild_engine(recipe: Recipe, step: int, report: Callable[[StepDown], None]) -> None:
    """A new engine from the builder's (smaller) plan; stepped down again while even
    building it runs out of GPU memory. The recipe's config becomes the plan's (what its
    checkpoints save)."""
    recipe.engine = None  # type: ignore[assignment]  # its GPU memory goes first
    recipe.cfg = recipe.builder.cfg
    while True:
        gc.collect()
        torch.cuda.empty_cache()
        try:
            recipe.engine = recipe.builder.engine(recipe.structure, recipe.store)
            return
        except torch.OutOfMemoryError as e:
            change = step_down(e, step=step, builder=recipe.builder, store=recipe.store)
        report(change)
        recipe.cfg = recipe.builder.cfg
