"""One live run per output folder: a second run (here `--checkpoint.resume_from auto`, which the
folder's rules allow) is refused while another process holds the folder, naming its pid and host;
it is let in once the holder has ended, or has been killed (the OS drops the lock of a dead
process: no stale lock)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.recipes.sft import Trainer
from run_helpers import DEMO, tiny_run_args

SRC = Path(__file__).resolve().parents[2] / "src"
HOLD = (
    "import sys, time\n"
    "from megatrain.config import load_config\n"
    "from megatrain.checkpoint.output_dir import OutputFolder\n"
    "folder = OutputFolder(load_config(sys.argv[1], sys.argv[2:]))\n"
    "print('holding', flush=True)\n"
    "time.sleep(300)\n"
)


def _resume_args(out: Path, steps: int) -> list[str]:
    return tiny_run_args(
        out, "--training.max_steps", str(steps), "--checkpoint.resume_from", "auto"
    )


def _command(out: Path, steps: int) -> list[str]:
    return ["train", "--config", str(DEMO), *_resume_args(out, steps)]


def _in_use(err: str, pid: int, out: Path) -> bool:
    return (
        len(err.splitlines()) == 1
        and f"training.output_dir='{out}' is in use: process {pid} on host {socket.gethostname()}"
        in err
    )


def test_a_live_run_holds_its_folder(tmp_path: Path) -> None:
    first = Trainer(load_config(DEMO, _resume_args(tmp_path, 2)))
    try:
        env = dict(os.environ, PYTHONPATH=str(SRC))
        second = subprocess.run(
            [sys.executable, "-m", "megatrain", *_command(tmp_path, 3)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and _in_use(second.stderr, os.getpid(), tmp_path)
        first.train()
    finally:
        first.close()
    assert main(_command(tmp_path, 3)) == 0  # the first run has ended: its lock is gone
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # each step once


def test_a_killed_holder_does_not_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(DEMO), *_resume_args(tmp_path, 1)],
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        assert main(_command(tmp_path, 1)) == 2
        assert _in_use(capsys.readouterr().err, holder.pid, tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no exit handler runs
        holder.wait()
    assert main(_command(tmp_path, 1)) == 0
