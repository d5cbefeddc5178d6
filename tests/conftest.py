"""Shared test setup: quiet transformers' fallback-kernel notices, CUDA-only marker, and each
pytest-xdist worker on its own cores (pyproject.toml runs the suite with `-n auto`)."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from megatrain import threads

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _own_cores() -> None:
    """Under pytest-xdist, worker i of n keeps every n-th core of this process's affinity from
    the i-th: the workers do not oversubscribe the cores (OpenMP's threads spin while they
    wait), and what a test reads of the machine (megatrain/threads.py: the affinity) is its
    own share. Subprocesses a test starts inherit it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = threads.affinity()
    mine = cores[int(worker[2:]) :: count] or cores
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


_own_cores()

GIB_PER_WORKER = 4
"""Host memory a test worker may take at its peak (the engine's RAM tests grow ~1.8 GiB)."""


@pytest.hookimpl(optionalhook=True)  # xdist's hook: none without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core this process may run on, as many as the host memory holds
    at GIB_PER_WORKER each; none (one process) where CUDA is: the GPU tests measure memory and
    would share the device."""
    if torch.cuda.is_available():
        return 0
    memory = psutil.virtual_memory().total // (GIB_PER_WORKER * 2**30)
    return max(1, min(len(threads.affinity()), memory))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
