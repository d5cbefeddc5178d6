"""Wall time of `megatrain` answering before any command runs: --help, --version, a bad argument.

    python bench/cli_startup.py [--runs 10]

Each case is `python -m megatrain ...` in a fresh process, `--runs` times, with this source
tree's src/ first on PYTHONPATH; prints the median and the fastest wall time of each, and of a
bare `python -c pass` (the interpreter's own start, the floor). None of these cases imports
torch or transformers (tests/test_cli_startup.py checks that); the command that runs does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CASES = {
    "python -c pass": ["-c", "pass"],
    "megatrain --help": ["-m", "megatrain", "--help"],
    "megatrain train --help": ["-m", "megatrain", "train", "--help"],
    "megatrain --version": ["-m", "megatrain", "--version"],
    "megatrain estimate --bad": ["-m", "megatrain", "estimate", "--bad"],
}


def wall_s(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each case (default 10)")
    runs = parser.parse_args().runs
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    print(f"{'case':<28}{'median s':>10}{'fastest s':>11}   ({runs} runs, {os.cpu_count()} cores)")
    for name, argv in CASES.items():
        times = [wall_s(argv, env) for _ in range(runs)]
        print(f"{name:<28}{statistics.median(times):>10.3f}{min(times):>11.3f}")


if __name__ == "__main__":
    main()
