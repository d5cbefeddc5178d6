"""The host store's layouts side by side for one run: `megatrain estimate`'s "host store layouts".

One row per layout of `fit.store_choices` for the run's compute dtype and clipping (the optimizer
keys master_dtype, state_dtype, grad_dtype), least compressed first, each predicted by
`estimate` with the run's setup and only those keys changed, and no GPU tier for the layouts the
tier does not take (gpu_tier.py `tier_refusal`; the tier is not picked again for the others) (the
model's meta profile is cached on its spec, so a row costs the byte arithmetic and the step
replay, milliseconds):
- its store bytes per parameter (`StoreChoice.per_param`) and this model's predicted host RAM:
  the steady total and the peak while the model loads, and whether both fit the host less
  memory.host_margin_gib (`fit.host_problem`, the fit check's own verdict);
- the largest model the host holds with it, the smaller of two bounds on the host's bytes less
  the margin (`free`), from the row's HostMemory:
  steady: this model's parameters + (free - its total) / B/param: a GPU tier holds as many
  parameters of a larger model (its blocks are off the host from the load on), the host store
  the rest;
  loading: fixed = the process baseline, the data and the fp32 copy of the block being moved
  (a deeper model's largest block is the same); one process, the fewer of (free - fixed) / 4
  (the fp32 model before it moves) and this model's parameters + (free - fixed - the store the
  host keeps) / B/param; under ranks (free - fixed) / ((load peak - fixed) / this model's
  parameters): the rest (the loading rank's whole fp32 model and the shards) grows with them;
- its predicted step time: the CPU AdamW rate follows state_dtype (planning/optimizer_rate.py);
  master_dtype and grad_dtype change host bytes only (planning/timing.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatrain.planning.estimate import estimate
from megatrain.planning.fit import host_problem, store_choices, store_of
from megatrain.planning.gpu_tier import tier_refusal
from megatrain.planning.hardware import GIB, Hardware
from megatrain.planning.host_memory import HostMemory
from megatrain.planning.setup import Setup
from megatrain.planning.spec import ModelSpec

_KEYS_W = 52  # the optimizer keys' column


@dataclass(frozen=True)
class StoreRow:
    """One store layout's prediction for the run (`--json`: "host_store_layouts")."""

    master_dtype: str
    state_dtype: str
    grad_dtype: str  # a bf16 master's held gradients (store/grads.py); "bf16" otherwise
    bytes_per_param: float  # the store's host bytes per parameter (fit.store_choices)
    host_bytes: int  # this model's predicted host RAM from the first step on
    load_peak_bytes: int  # ... while the model loads
    fits: bool  # both within the host less memory.host_margin_gib
    largest_params: int  # the largest model the host holds with this layout
    largest_bound: str  # what sets it: "steady" (the total) or "loading" (the load peak)
    step_s: float  # predicted step time
    own: bool  # the run's own layout

    def keys(self) -> str:
        return (
            f"state_dtype {self.state_dtype}, master_dtype {self.master_dtype}, "
            f"grad_dtype {self.grad_dtype}"
        )


@dataclass(frozen=True)
class StoreTable:
    """Every layout's row, and the host they are judged against."""

    rows: list[StoreRow]
    host_bytes: int
    host_margin_gib: float

    def lines(self) -> list[str]:
        """The report's section: a header saying how the columns are derived, a line a row."""
        free = self.host_bytes / GIB - self.host_margin_gib
        return [
            f"{'host store layouts (optimizer keys; * the run)':<{_KEYS_W + 2}}"
            f"{'B/param':>8}{'host GiB':>10}{'load GiB':>10}{'fits':>6}{'largest':>16}"
            f"{'step s':>9}",
            "  host: this model's host RAM from the first step on; load: its peak while loading;",
            f"    fits: both within {free:.2f} GiB (host {self.host_bytes / GIB:.2f} - margin "
            f"{self.host_margin_gib:g})",
            f"  largest: the parameters whose host RAM fits {free:.2f} GiB: this model's + "
            f"({free:.2f} - its host GiB) / B/param (a GPU tier holds as many);",
            "    (load): set by the load peak: the fp32 model (4 B/param) or the store kept, "
            "beside the process and a moving block",
            "  step s: predicted with each state_dtype's CPU AdamW rate",
            *(_line(r) for r in self.rows),
        ]


def store_table(
    spec: ModelSpec, setup: Setup, hardware: Hardware, host_margin_gib: float
) -> StoreTable:
    """Every store layout of the run's compute dtype and clipping, predicted for `spec` as
    `setup` says with only its optimizer keys changed; the run's own marked."""
    clipping = setup.engine.clip_norm is not None
    choices = store_choices(spec.compute_dtype == torch.bfloat16, clipping=clipping)
    own = store_of(
        choices, setup.master_dtype, setup.state_dtype, setup.grad_dtype, clipping=clipping
    )
    free = hardware.host_bytes - host_margin_gib * GIB
    rows = []
    for c in choices:
        engine = setup.engine
        if tier_refusal(c.state, c.master):  # formats the tier does not hold
            engine = dataclasses.replace(engine, gpu_state_blocks=0)
        layout = dataclasses.replace(
            setup, engine=engine, master_dtype=c.master, state_dtype=c.state, grad_dtype=c.grad
        )
        est = estimate(spec, layout, hardware)
        largest, bound = _largest(est.host, spec.total_params, c.per_param, free)
        rows.append(
            StoreRow(
                master_dtype=c.master,
                state_dtype=c.state,
                grad_dtype=c.grad,
                bytes_per_param=c.per_param,
                host_bytes=est.host.total_bytes,
                load_peak_bytes=est.host.load_peak_bytes,
                fits=host_problem(est, hardware, host_margin_gib) is None,
                largest_params=largest,
                largest_bound=bound,
                step_s=est.time.step_s,
                own=c == own,
            )
        )
    return StoreTable(rows, hardware.host_bytes, host_margin_gib)


def _largest(h: HostMemory, params: int, per_param: float, free: float) -> tuple[int, str]:
    """(parameters, "steady" or "loading"): the largest model whose host RAM fits `free` bytes,
    from this model's HostMemory `h` (the module docstring says how)."""
    steady = params + (free - h.total_bytes) / per_param  # the tier keeps its parameters
    fixed = h.baseline_bytes + h.data_bytes + h.load_moved_bytes
    if h.load_extra_bytes:  # ranks: the loader's fp32 model and the shards grow together
        loading = params * (free - fixed) / (h.load_peak_bytes - fixed)
    else:  # the larger of the fp32 model (4 B/param) and the store the host keeps (B/param)
        kept = h.pageable_bytes + h.pinned_reserved_bytes
        loading = min((free - fixed) / 4, params + (free - fixed - kept) / per_param)
    return (
        (max(int(steady), 0), "steady") if steady < loading else (max(int(loading), 0), "loading")
    )


def _line(r: StoreRow) -> str:
    mark = "*" if r.own else " "
    billions = r.largest_params / 1e9
    largest = f"{billions:.2f}B" if billions >= 1 else f"{billions:.3g}B"
    largest += " (load)" if r.largest_bound == "loading" else ""
    return (
        f"{mark} {r.keys():<{_KEYS_W + 2}}{r.bytes_per_param:>8.2f}{r.host_bytes / GIB:>10.2f}"
        f"{r.load_peak_bytes / GIB:>10.2f}{'yes' if r.fits else 'no':>6}{largest:>16}"
        f"{r.step_s:>9.3f}"
    )
