"""How many CPU threads a run uses: every default thread count is decided here.

Compute threads (torch's intra-op pool), `compute_threads`: a CPU run's losses may depend on
them. torch's CPU kernels split a long sum among the threads (`x.sum()` over 2^20 floats
differs in its last bit between 1 and 2 threads with AVX2 or AVX-512 kernels) and a BLAS may
split a matmul: the DPO demo's losses on 1 and 2 threads differed by 1.2e-7 from the first
steps on one x86 host (on the 2-core AMD EPYC development machine the demo's 294 steps came out
identical). So the count is a setting of the run, never sampled from the machine's load. In
order: training.threads; else OMP_NUM_THREADS (torchrun sets 1 per rank with several ranks on a
node); else, on the CPU, the count the resumed checkpoint was computed with (its
trainer_state.json "threads"), else the cores this process may run on (its CPU affinity:
taskset, a container's cpuset); a CUDA run computes on the GPU and keeps torch's default. So the
same config and seed on the same machine give the same losses whatever else runs there, and a
resume continues the uninterrupted run's losses on another core count or load. On a machine
other processes keep busy every core oversubscribes (the demo on 2 cores with another process
busy on one: 1.34 s a step with 2 threads, 0.85 s with 1): training.threads: 1 runs faster
there, the same count every time. A process-wide setting: a recipe sets it for its run
(recipes/base.py) and puts the previous count back when it closes; `megatrain verify` sets it.

Host AdamW threads (`optimizer_threads`; optimizer.threads wins): the C kernels update each
element on its own (and the int8 kernel's block maximum is exact), so their results do not
depend on the thread count (tests/optim/test_adamw.py, test_optim_states_parity.py) and this
count may follow the load: alone on the node, the usable cores (`usable_cores`: the affinity
cores less those other processes keep busy, sampled over `LOAD_WINDOW_S` once per process, this
process's own CPU time excluded) less two for the threads that drive the GPU and the copies;
with several ranks on the node, each rank's share of the affinity cores less one (the other
ranks' load is the job's own, so it is not subtracted, and none is sampled).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import psutil
import torch

from megatrain.device import resolve_device

LOAD_WINDOW_S = 0.2
"""How long the other processes' load is sampled (once per process)."""


@dataclass(frozen=True)
class ComputeThreads:
    """torch's intra-op threads a run computes with, and where the count came from."""

    count: int
    source: str  # why this count, in words

    def describe(self) -> str:
        """The run's threads line, printed with its plan."""
        return f"threads: torch computes on {self.count} CPU thread(s) ({self.source})"


def affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):  # Linux; elsewhere every core
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as a count (its first level when it lists several), None when unset."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None:
        return None
    first = value.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(
            f"OMP_NUM_THREADS={value!r} is not a thread count: set it to an integer >= 1 or "
            "unset it (training.threads sets torch's threads of a run too)"
        )
    return int(first)


def compute_threads(
    device: str, configured: int | None = None, saved: int | None = None
) -> ComputeThreads:
    """The compute threads of a run on `device` (training.device) with training.threads
    `configured`, resuming a checkpoint computed with `saved` threads (module docstring)."""
    cpu = resolve_device(device) == "cpu"
    given = [(configured, "training.threads"), (_omp_num_threads(), "OMP_NUM_THREADS")]
    for count, source in given:
        if count is None:
            continue
        if cpu and saved is not None and saved != count:
            source += (
                f"; the checkpoint was computed with {saved}: the losses may differ from the "
                "uninterrupted run's"
            )
        return ComputeThreads(count, source)
    if not cpu:
        return ComputeThreads(torch.get_num_threads(), "torch's default: the run is on the GPU")
    if saved is not None:
        return ComputeThreads(saved, "the resumed checkpoint's")
    return ComputeThreads(
        len(affinity()), "the cores this process may run on; training.threads sets them"
    )


def use_compute_threads(threads: ComputeThreads) -> int:
    """torch computes on `threads.count` threads from now on; returns the count before."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads.count)
    return before


def busy_elsewhere(cpus: list[int], window_s: float = LOAD_WINDOW_S) -> float:
    """Cores' worth of CPU time other processes used on `cpus` over the next `window_s`."""
    me = psutil.Process()
    before = me.cpu_times()
    percent = psutil.cpu_percent(interval=window_s, percpu=True)  # blocks for window_s
    after = me.cpu_times()
    mine = (after.user + after.system - before.user - before.system) / window_s
    busy = sum(percent[c] for c in cpus if c < len(percent)) / 100
    return max(0.0, busy - mine)


@functools.cache
def usable_cores() -> int:
    """The affinity cores less those other processes keep busy (rounded), at least 1."""
    cpus = affinity()
    return max(1, len(cpus) - int(busy_elsewhere(cpus) + 0.5))


def optimizer_threads(local_world_size: int) -> int:
    """Host AdamW threads when optimizer.threads is not set (see the module docstring)."""
    if local_world_size == 1:
        return max(1, usable_cores() - 2)
    return max(1, len(affinity()) // local_world_size - 1)
