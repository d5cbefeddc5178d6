"""How many CPU threads a run uses: every default thread count is decided here.

`usable_cores()`: the cores this process may run on (its CPU affinity: taskset, a container's
cpuset) less the cores other processes keep busy on them, sampled over `LOAD_WINDOW_S` once per
process (this process's own CPU time excluded), at least 1. From it:

- compute threads of a CPU run (torch's intra-op pool, `use_compute_threads`): the usable
  cores. On a shared machine torch's default (every core) oversubscribes, and OpenMP threads
  then wait on each other: the demo on 2 cores with another process busy on one took 1.34 s a
  step with 2 threads, 0.85 s with 1. OMP_NUM_THREADS, when set, wins (torchrun sets 1 per rank
  with several ranks on a node). A CUDA run keeps torch's default: its compute is on the GPU.
  A process-wide setting, so the commands that compute (train, grpo, verify) make it, not the
  library parts they call.
- host AdamW threads (`optimizer_threads`; optimizer.threads wins): alone on the node, the
  usable cores less two for the threads that drive the GPU and the copies; with several ranks
  on the node, each rank's share of the affinity cores less one (the other ranks' load is the
  job's own, so it is not subtracted, and none is sampled).
"""

from __future__ import annotations

import functools
import os

import psutil
import torch

from megatrain.device import resolve_device

LOAD_WINDOW_S = 0.2
"""How long the other processes' load is sampled (once per process)."""


def _affinity() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):  # Linux; elsewhere every core
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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
    cpus = _affinity()
    return max(1, len(cpus) - int(busy_elsewhere(cpus) + 0.5))


def optimizer_threads(local_world_size: int) -> int:
    """Host AdamW threads when optimizer.threads is not set (see the module docstring)."""
    if local_world_size == 1:
        return max(1, usable_cores() - 2)
    return max(1, len(_affinity()) // local_world_size - 1)


def use_compute_threads(device: str) -> None:
    """A run on `device` (training.device): on the CPU torch computes on the usable cores,
    unless OMP_NUM_THREADS says otherwise."""
    if resolve_device(device) == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(usable_cores())
