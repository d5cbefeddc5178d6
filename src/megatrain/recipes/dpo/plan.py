"""What the reference of a preference run costs, from its plan (pure: before loading).

The training step is the builder's plan (what `train` checks: `training.micro_batch_size` rows,
half as many pairs, per micro-batch). The reference adds, per `dpo.reference`:
- "precomputed": one forward-only streamed pass of the initial weights over every pair before
  step 1 (recipes/dpo/reference.py): each table (train, eval) in passes of one step's
  micro-batches (grad_accum x world), each pass the planner's forward-only pass over a step's
  tokens (StepTime.forward_s: planning/timing.py, the engine's forward replayed without
  backward or optimizer). Rows are counted at training.seq_len tokens (the loader pads a
  micro-batch to its longest row: an upper bound). The table: 8 bytes (2 fp32) per pair, on the
  host and in each checkpoint.
- "weights": a copy of what the engine streams (compute dtype: 2 bytes per parameter in bf16,
  4 in fp32; under ranks each rank's shards, store/reference.py `copy_bytes`) in host RAM and in
  each checkpoint (one file per rank), and one forward-only pass per optimizer step
  (forward_s), on that step's micro-batches, plus the GPU tier's swap around it
  (planning/timing.py reference_swap_s, `swap_s`). Not counted: the overlap the step loses as the
  pass first waits for the previous step's updates (recipes/dpo/reference.py).
- reference-free losses (orpo, simpo): nothing.

The weights' copy is swapped in for its pass (StreamingEngine.serving: the host store's
blocks, and a GPU tier's device weights, kept on the host meanwhile and put back after).

Invariant: the host bytes a reference adds are judged with the training plan's host RAM (the
same margin), so a run that fits its training but not its reference is refused before loading.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatrain.planning.hardware import GIB, Hardware, gib
from megatrain.planning.plan import ResourcePlan
from megatrain.planning.spec import ModelSpec
from megatrain.recipes.dpo.loss import REFERENCE_FREE
from megatrain.store.reference import copy_bytes

PAIR_TABLE_BYTES = 8  # (chosen, rejected) fp32 per pair


@dataclass(frozen=True)
class ReferencePlan:
    mode: str  # "precomputed", "weights" or "none" (a reference-free loss)
    pairs: int  # train + eval pairs the table holds (precomputed; KTO: rows, each with its KL row)
    passes: int  # forward-only passes of the one-off reference pass (precomputed)
    pass_s: float  # one forward-only pass over a step's micro-batches (planning/timing.py)
    reference_s: float  # the one-off pass before step 1 (precomputed; else 0)
    step_extra_s: float  # added to every optimizer step (weights; else 0)
    host_bytes: int  # the table, or the copy of the weights
    checkpoint_bytes: int  # what each checkpoint holds of it (the same bytes)
    swap_s: float = 0.0  # of step_extra_s: the GPU tier's weights swapped (weights)


def reference_plan(
    plan: ResourcePlan,
    spec: ModelSpec,
    *,
    loss_type: str,
    reference: str,
    pairs: tuple[int, ...],
    world_size: int = 1,
    swap_s: float = 0.0,
) -> ReferencePlan:
    """The reference's cost for `pairs` (per table: train, eval) on `plan`'s batch; `swap_s`:
    the GPU tier's swap around a pass of "weights" (planning/timing.py reference_swap_s)."""
    pass_s = plan.estimate.time.forward_s
    if loss_type in REFERENCE_FREE:
        return ReferencePlan("none", 0, 0, pass_s, 0.0, 0.0, 0, 0)
    if reference == "weights":  # under ranks every rank's padded shards (the node's RAM)
        copy = copy_bytes(spec.block_params, spec.compute_dtype.itemsize, world_size)
        step_s = pass_s + swap_s
        return ReferencePlan("weights", 0, 0, pass_s, 0.0, step_s, copy, copy, swap_s)
    per_micro = max(1, plan.micro_batch_size // 2)
    per_pass = plan.grad_accum * world_size
    passes = sum(math.ceil(math.ceil(n / per_micro) / per_pass) for n in pairs)
    table = PAIR_TABLE_BYTES * sum(pairs)
    return ReferencePlan(
        "precomputed", sum(pairs), passes, pass_s, passes * pass_s, 0.0, table, table
    )


def with_reference(
    plan: ResourcePlan, ref: ReferencePlan, hw: Hardware, host_margin_gib: float
) -> ResourcePlan:
    """`plan` with a problem added when its host RAM and the reference's exceed the host."""
    need = plan.estimate.host.total_bytes + ref.host_bytes
    free = hw.host_bytes - host_margin_gib * GIB
    if not ref.host_bytes or need <= free:
        return plan
    problem = (
        f"host RAM with the reference: {gib(plan.estimate.host.total_bytes)} for training + "
        f"{gib(ref.host_bytes)} for dpo.reference: {ref.mode} > {gib(free)} available "
        f"({gib(hw.host_bytes)} total - margin {host_margin_gib:g} GiB)"
        + ("; set dpo.reference: precomputed (8 bytes per pair)" if ref.mode == "weights" else "")
    )
    return dataclasses.replace(plan, problems=(*plan.problems, problem))


def format_reference(ref: ReferencePlan, *, timed: bool = True) -> str:
    """One line for the plan report and `megatrain estimate`; `timed` False (a CPU run, whose
    step time the planner does not model): bytes and passes only."""
    if ref.mode == "none":
        return "reference: none (a reference-free loss)"
    if ref.mode == "weights":
        per_step = f": +{ref.step_extra_s:.2f} s per step" if timed else ""
        return (
            f"reference: initial weights in host RAM ({gib(ref.host_bytes)}, also in each "
            f"checkpoint), one forward-only pass per step{per_step}"
        )
    took = f" x {ref.pass_s:.3f} s = {ref.reference_s:.1f} s" if timed else ""
    return (
        f"reference: precomputed before step 1 for {ref.pairs} pairs: {ref.passes} forward-only "
        f"passes{took}; table {ref.host_bytes:,} bytes on the host and in each checkpoint"
    )
