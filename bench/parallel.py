"""Several runners at once, one per GPU, and the logs packed to come back in a few files.

    python bench/run.py --parallel 0:0-15:arch_gpt_oss_20b 1:16-31:user_grpo,user_dense \
        --deadline 560

Each `GPU:CPUS:SCENARIO[,SCENARIO...]` starts `bench/run.py --gpu GPU --cpus CPUS SCENARIO...`
in its own session, with OUT=$OUT/g<GPU> and its printed summary in $OUT/g<GPU>.txt. The
runners are waited for by their process, never by a name (`pgrep -f NAME` also matches the
shell command that runs the wait, and then waits forever). At `--deadline` seconds the runners
still going are killed with their children, so the device command still has time to pack what
they wrote. Then every runner's results.jsonl lines go into $OUT/results.jsonl (each with its
`gpu`), the logs into $OUT/logs.tgz (no corpus, model or weights files), and the runners'
folders are removed: the device tool brings back at most 8 files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil

SKIP = ("corpus.txt", ".safetensors", ".bin", ".pt")  # data and weights: rebuilt, not logs
SKIP_DIRS = ("model", "checkpoints", "export")


def parse(spec: str) -> tuple[str, str, list[str]]:
    """`0:0-15:a,b` -> ("0", "0-15", ["a", "b"])."""
    gpu, cpus, scenarios = [*spec.split(":", 2), "", ""][:3]
    if not (gpu and cpus and scenarios):
        raise SystemExit(f"--parallel {spec!r}: expected GPU:CPUS:SCENARIO[,SCENARIO...]")
    return gpu, cpus, scenarios.split(",")


def run_parallel(specs: list[str], out: Path, deadline_s: float) -> list[str]:
    runner = Path(__file__).with_name("run.py")
    procs: dict[str, subprocess.Popen] = {}
    for gpu, cpus, scenarios in map(parse, specs):
        if gpu in procs:
            raise SystemExit(f"--parallel: GPU {gpu} named twice")
        (out / f"g{gpu}").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OUT": str(out / f"g{gpu}")}
        argv = [sys.executable, str(runner), "--gpu", gpu, "--cpus", cpus, *scenarios]
        with open(out / f"g{gpu}.txt", "w") as f:
            procs[gpu] = subprocess.Popen(
                argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
    end = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < end:
        time.sleep(2)
    status = {}
    for gpu, p in procs.items():
        if p.poll() is None:
            _kill_tree(p.pid)  # the runner, its scenario's command (own session), the ranks
            p.wait()
            status[gpu] = f"killed at the {deadline_s:.0f} s deadline"
        else:
            status[gpu] = f"exit {p.returncode}"
    _merge_results(out, list(procs))
    pack_logs(out, [out / f"g{gpu}" for gpu in procs])
    summary = []
    for gpu in procs:
        summary.append(f"== GPU {gpu}: {status[gpu]}")
        summary += (out / f"g{gpu}.txt").read_text(errors="replace").splitlines()[-12:]
    return summary


def _kill_tree(pid: int) -> None:
    """SIGKILL to a process and every descendant: the runner starts each command in a session
    of its own (bench/run.py), so killing the runner's group would leave the command running."""
    root = psutil.Process(pid)
    for proc in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


def _merge_results(out: Path, gpus: list[str]) -> None:
    with open(out / "results.jsonl", "a") as merged:
        for gpu in gpus:
            path = out / f"g{gpu}" / "results.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.strip():
                        merged.write(json.dumps({"gpu": gpu, **json.loads(line)}) + "\n")


def pack_logs(out: Path, folders: list[Path]) -> Path:
    """Every log under `folders` into a new out/logs.tgz (data and weights left out: SKIP,
    SKIP_DIRS), then the folders removed."""
    archive = out / "logs.tgz"

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        name = Path(info.name)
        if name.name.endswith(SKIP) or (info.isdir() and name.name in SKIP_DIRS):
            return None
        return info

    with tarfile.open(archive, "w:gz") as tar:
        for folder in folders:
            if folder.exists():
                tar.add(folder, arcname=folder.name, filter=keep)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return archive
