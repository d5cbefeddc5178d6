"""A run's losses follow its config and seed, not the machine's load (megatrain/threads.py):
the same tiny run through `megatrain train` under two loads computes on the same threads and
gives the same losses bit for bit; a run interrupted and resumed on another core count under
another load computes on its checkpoint's threads and continues the uninterrupted run's losses
bit for bit.

The machine is faked to 2 cores (its CPU affinity) whatever this one has, and the load is the
AdamW's sample (`busy_elsewhere`), which before a run's threads were its own also set the
compute threads: 1 core busy of 2 gave 1 thread. On this 2-core AMD EPYC the tiny model's
losses happen not to change with the thread count, so the threads each step ran on are asserted
too; on a CPU whose kernels split differently the losses would differ as well."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain import threads
from megatrain.cli import main
from megatrain.engine.engine import StreamingEngine
from run_helpers import DEMO, tiny_run_args


@pytest.fixture(autouse=True)
def _two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A 2-core machine, OMP_NUM_THREADS unset (the default count); torch's count put back."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "affinity", lambda: [0, 1])
    yield
    threads.usable_cores.cache_clear()
    torch.set_num_threads(before)


def _load(monkeypatch: pytest.MonkeyPatch, busy: float) -> None:
    """Other processes keep `busy` cores' worth busy (as the AdamW's sample reads it)."""
    monkeypatch.setattr(threads, "busy_elsewhere", lambda cpus: busy)
    threads.usable_cores.cache_clear()


def _train_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def _saved_threads(out: Path) -> int:
    (checkpoint,) = sorted((out / "checkpoints").iterdir())
    return json.loads((checkpoint / "trainer_state.json").read_text())["threads"]


def test_the_same_run_under_another_load_gives_the_same_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {}
    for busy in (0.0, 1.0):  # idle; another process busy on one of the two cores
        _load(monkeypatch, busy)
        torch.set_num_threads(1)
        out = tmp_path / f"busy{busy}"
        args = tiny_run_args(out, "--training.max_steps", "3")
        assert main(["train", "--config", str(DEMO), *args]) == 0
        printed = capsys.readouterr().out
        line = "threads: torch computes on 2 CPU thread(s) (the cores this process may run on;"
        assert line in printed, printed
        loaded = r"^loaded: model [\d.]+ s, host store [\d.]+ s, engine [\d.]+ s$"
        assert re.search(loaded, printed, re.MULTILINE), printed  # where start-up time went
        assert torch.get_num_threads() == 1  # the run put the process's count back
        runs[busy] = (_train_losses(out), _saved_threads(out))
    assert len(runs[0.0][0]) == 3
    assert runs[0.0] == runs[1.0]
    assert runs[0.0][1] == 2


_TRAIN_STEP = StreamingEngine.train_step


def _counted_steps(monkeypatch: pytest.MonkeyPatch, dies_in: int | None = None) -> list[int]:
    """From now on every optimizer step appends torch's thread count to the list returned;
    step `dies_in` (1-based) raises KeyboardInterrupt instead, as a kill would."""
    counts: list[int] = []

    def counted(self: StreamingEngine, *args: Any, **kwargs: Any) -> Any:
        if len(counts) + 1 == dies_in:
            raise KeyboardInterrupt
        counts.append(torch.get_num_threads())
        return _TRAIN_STEP(self, *args, **kwargs)

    monkeypatch.setattr(StreamingEngine, "train_step", counted)
    return counts


def test_a_resume_on_another_core_count_and_load_continues_the_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def train(out: Path, *more: str) -> int:
        args = tiny_run_args(out, "--training.max_steps", "4", "--checkpoint.save_every", "2")
        return main(["train", "--config", str(DEMO), *args, *more])

    _load(monkeypatch, 0.0)
    straight = _counted_steps(monkeypatch)
    assert train(tmp_path / "a") == 0
    crashed = _counted_steps(monkeypatch, dies_in=3)  # killed in step 3, after step 2's save
    assert train(tmp_path / "b") == 130
    # resumed where one core is this process's (taskset), another process busy beside it
    monkeypatch.setattr(threads, "affinity", lambda: [0])
    _load(monkeypatch, 0.6)
    resumed = _counted_steps(monkeypatch)
    capsys.readouterr()
    assert train(tmp_path / "b", "--checkpoint.resume_from", "auto") == 0
    line = "threads: torch computes on 2 CPU thread(s) (the resumed checkpoint's)"
    assert line in capsys.readouterr().out
    assert straight == [2] * 4 and crashed == [2, 2]
    assert resumed == [2, 2]  # the checkpoint's count, not the one core now
    assert _train_losses(tmp_path / "b") == _train_losses(tmp_path / "a")  # steps 1-4, once each
