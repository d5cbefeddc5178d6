"""megatrain/threads.py: a run's compute threads are its setting (training.threads,
OMP_NUM_THREADS, the resumed checkpoint's, the affinity cores), never the machine's load; the
host AdamW threads are the cores less other processes' load; a CPU command's torch follows."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from megatrain import threads
from megatrain.cli import main


@pytest.fixture(autouse=True)
def _fresh_rule() -> Iterator[None]:
    """Each test measures (or fakes) the load anew; torch's thread count is put back after."""
    before = torch.get_num_threads()
    threads.usable_cores.cache_clear()
    yield
    threads.usable_cores.cache_clear()
    torch.set_num_threads(before)


def _machine(monkeypatch: pytest.MonkeyPatch, cores: int, busy: float) -> None:
    monkeypatch.setattr(threads, "affinity", lambda: list(range(cores)))
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cpus: busy)


@pytest.mark.parametrize(
    "cores,busy,usable,alone,of_two_ranks",
    [
        (16, 0.0, 16, 14, 7),  # an idle GPU host: as before (cores less 2; share less 1)
        (16, 3.6, 12, 10, 7),  # 3.6 cores busy elsewhere count as 4; ranks: their share
        (2, 0.7, 1, 1, 1),  # the shared 2-core machine: one core left, at least one thread
        (2, 0.4, 2, 1, 1),
        (4, 9.0, 1, 1, 1),  # more load than cores: still one
    ],
)
def test_cores_less_other_load(
    monkeypatch: pytest.MonkeyPatch,
    cores: int,
    busy: float,
    usable: int,
    alone: int,
    of_two_ranks: int,
) -> None:
    _machine(monkeypatch, cores, busy)
    assert threads.usable_cores() == usable
    assert threads.optimizer_threads(1) == alone
    assert threads.optimizer_threads(2) == of_two_ranks


@pytest.mark.parametrize(
    "configured,omp,saved,count,source",
    [
        (None, None, None, 4, "the cores this process may run on; training.threads sets them"),
        (None, None, 3, 3, "the resumed checkpoint's"),  # on any core count, under any load
        (None, "2", None, 2, "OMP_NUM_THREADS"),
        (None, "2,1", 2, 2, "OMP_NUM_THREADS"),  # nested levels: the first; the saved count
        (3, "2", 3, 3, "training.threads"),  # the config wins; the checkpoint's count: no note
        (
            None,
            "2",
            3,
            2,
            "OMP_NUM_THREADS; the checkpoint was computed with 3: the losses may differ from "
            "the uninterrupted run's",
        ),
    ],
)
def test_compute_threads_are_the_runs_not_the_loads(
    monkeypatch: pytest.MonkeyPatch,
    configured: int | None,
    omp: str | None,
    saved: int | None,
    count: int,
    source: str,
) -> None:
    monkeypatch.setattr(threads, "affinity", lambda: list(range(4)))
    monkeypatch.setattr(threads, "busy_elsewhere", _never_sampled)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert threads.compute_threads("cpu", configured, saved) == threads.ComputeThreads(
        count, source
    )


def _never_sampled(cpus: list[int]) -> float:
    raise AssertionError("a run's compute threads must not depend on the load")


def test_a_gpu_run_keeps_torchs_default_and_a_bad_omp_value_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "resolve_device", lambda device: "cuda")
    torch.set_num_threads(3)
    gpu = threads.compute_threads("cuda", None, saved=2)  # a CPU checkpoint's count: not used
    assert gpu == threads.ComputeThreads(3, "torch's default: the run is on the GPU")
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many' is not a thread count"):
        threads.compute_threads("cpu")


def test_verify_computes_on_the_affinity_cores_whatever_the_load(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, 4, 1.2)  # 3 usable for the AdamW; the compute takes all 4
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    verify = ["verify", "--model-type", "llama", "--tiny", "--steps", "1", "--device", "cpu"]
    assert main(verify) == 0, capsys.readouterr().out
    assert torch.get_num_threads() == 4
    assert main([*verify, "--training.threads", "2"]) == 0, capsys.readouterr().out
    assert torch.get_num_threads() == 2


def test_another_busy_process_is_measured() -> None:
    """A process spinning on one core: measured as (about) one core busy elsewhere, so this
    process gets one core less (at least one). Its CPU counters tick in 10 ms jiffies: over the
    0.5 s window one core reads within 2 x 10 ms / 0.5 s = 0.04 of 1.0 per CPU it ran on; the
    0.1 bound allows that for two CPUs and a little more; other load only adds to it."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        cpus = threads.affinity()
        assert threads.busy_elsewhere(cpus, window_s=0.5) >= 0.9
        assert threads.usable_cores() <= max(1, len(cpus) - 1)
    finally:
        spinner.kill()
        spinner.wait()
