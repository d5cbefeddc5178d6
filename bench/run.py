"""The GPU machine's benchmark runner: named scenarios, each a few commands, logs under $OUT.

    python bench/run.py --list
    python bench/run.py verify_cuda compare adamw       # in this order, one log per scenario
    python bench/run.py train_shape -- --preset qwen2.5-7b --batch 32 --micro 8 --compile

Every scenario names what it measures; arguments after `--` go to each command of the
scenarios run (for one-off variations). Each command runs with a timeout, its output goes to
$OUT/<scenario>.log (default /tmp/out), the `RESULT {...}` lines the scripts print are collected
into $OUT/results.jsonl, and a short summary is printed last. Record what you run in
docs/performance.md (date, card, command, numbers); results of past runs live there, not here.

The environment of the GPU machine is kept as it is (NCCL_NVLS_ENABLE=0 and friends stay set);
this runner only adds PYTHONPATH (src/ and bench/), PYTHONUNBUFFERED and TRANSFORMERS_VERBOSITY.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SITE = "/tmp/site"  # where peers_install puts DeepSpeed


@dataclass(frozen=True)
class Scenario:
    what: str  # what it measures
    commands: tuple[tuple[str, ...], ...]
    timeout_s: int = 300


def _verify(*flags: str) -> tuple[str, ...]:
    return (PY, "-m", "megatrain", "verify", "--device", "cuda", *flags)


def _train(*flags: str) -> tuple[str, ...]:
    return (PY, "bench/train_shape.py", "--opt-threads", "14", *flags)


def _grpo(*flags: str) -> tuple[str, ...]:
    return (PY, "bench/grpo_shape.py", "--preset", "qwen2.5-7b", *flags)


SCENARIOS: dict[str, Scenario] = {
    "env": Scenario(
        "the card, driver, CPU count, memory, torch and transformers versions",
        (
            ("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"),
            (
                PY,
                "-c",
                "import os,torch,transformers;print(os.cpu_count(),torch.__version__,"
                "transformers.__version__)",
            ),
        ),
        timeout_s=60,
    ),
    "verify_cuda": Scenario(
        "engine = PyTorch on the GPU: bf16 and fp32 tiny models (megatrain verify)",
        (
            _verify("--model-type", "llama", "--tiny", "--dtype", "bf16"),
            _verify("--model-type", "qwen3_moe", "--tiny", "--dtype", "bf16"),
            _verify("--model-type", "qwen3_5_text", "--tiny", "--dtype", "bf16"),
            _verify("--model-type", "llama", "--tiny"),
        ),
        timeout_s=200,
    ),
    "gpu_tests": Scenario(
        "the test suite's GPU-marked tests",
        ((PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"),),
        timeout_s=300,
    ),
    "peers_install": Scenario(
        "install DeepSpeed and its dependencies from .wheels/ (carried; no network) into "
        f"{SITE}, which every scenario's PYTHONPATH includes",
        (
            (
                PY,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--target",
                SITE,
                "$WHEELS",
            ),
            (
                PY,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                SITE,
                "$DEEPSPEED",
            ),
        ),
    ),
    "adamw": Scenario(
        "CPU AdamW: C kernel vs torch fused, Gparams/s and host copy bandwidth; compressed "
        "state layouts (optimizer.state_dtype bf16, int8) through the C kernel",
        (
            (
                PY,
                "bench/adamw.py",
                "--params",
                "1e9",
                "--block",
                "80e6",
                "--threads",
                "14",
                "--huge",
                "yes",
                "--state-dtypes",
                "fp32,bf16,int8",
            ),
        ),
    ),
    "layer_speed": Scenario(
        "one Qwen2.5-7B decoder layer: forward, recompute and backward times, eager and compiled",
        (
            (PY, "bench/layer_speed.py", "--preset", "qwen2.5-7b", "--tokens", "8192"),
            (PY, "bench/layer_speed.py", "--preset", "qwen2.5-7b", "--tokens", "8192", "--compile"),
        ),
    ),
    "train_shape": Scenario(
        "the engine on a preset shape (Qwen2.5-3B, 8k tokens/step): step time, timeline, memory",
        (_train("--preset", "qwen2.5-3b", "--batch", "4", "--micro", "1", "--steps", "5"),),
    ),
    "compare": Scenario(
        "MegaTrain vs GPU-resident, FSDP2 CPU offload and DeepSpeed ZeRO-3 offload, same job "
        "(Qwen2.5-3B shape, 8k and 32k tokens/step; DeepSpeed needs its wheels carried)",
        ((PY, "bench/compare.py", "--preset", "qwen2.5-3b", "--tokens", "8192,32768"),),
        timeout_s=580,
    ),
    "grpo_7b": Scenario(
        "GRPO steps on the Qwen2.5-7B shape (random weights, completions at full length): the "
        "seed's 8 prompts x 2 responses and TRL's 8 generations per prompt, 512 + 1024 tokens; "
        "generation vs training time, GPU peak, host RSS, the estimate beside",
        (
            _grpo("--generations", "2"),
            _grpo("--generations", "8", "--micro", "8", "--steps", "2"),
        ),
        timeout_s=300,
    ),
    "estimate_check": Scenario(
        "the estimate against measured runs of this machine (3B 8k/32k, 7B 16k)",
        (
            (PY, "bench/estimate_check.py", "--probe-out", "$OUT/hw.json"),
            _train("--preset", "qwen2.5-3b", "--batch", "4", "--micro", "1", "--steps", "5"),
            _train("--preset", "qwen2.5-3b", "--batch", "16", "--micro", "4", "--steps", "4"),
            _train("--preset", "qwen2.5-7b", "--batch", "8", "--micro", "2", "--steps", "6"),
            (PY, "bench/estimate_check.py", "$OUT/results.jsonl", "--hardware", "$OUT/hw.json"),
        ),
    ),
}


def _expand(argv: list[str]) -> list[str]:
    """$WHEELS: every wheel in .wheels/; $DEEPSPEED: the DeepSpeed source archive there."""
    wheels = ROOT / ".wheels"
    out: list[str] = []
    for arg in argv:
        if arg == "$WHEELS":
            out += sorted(str(p) for p in wheels.glob("*.whl"))
        elif arg == "$DEEPSPEED":
            out += sorted(str(p) for p in wheels.glob("deepspeed-*.tar.gz"))
        else:
            out.append(arg)
    return out


def run_scenario(name: str, out: Path, extra: list[str], env: dict[str, str]) -> list[str]:
    scenario = SCENARIOS[name]
    log = out / f"{name}.log"
    summary = []
    with log.open("a") as f:
        for command in scenario.commands:
            argv = _expand([c.replace("$OUT", str(out)) for c in command]) + extra
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            t0 = time.time()
            try:
                proc = subprocess.run(
                    argv,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=scenario.timeout_s,
                )
                text, status = proc.stdout, str(proc.returncode)
            except subprocess.TimeoutExpired as e:
                text = e.stdout if isinstance(e.stdout, str) else ""
                status = f"timeout {scenario.timeout_s}s"
            f.write(text)
            with (out / "results.jsonl").open("a") as results:
                for line in text.splitlines():
                    if line.startswith("RESULT "):
                        results.write(line[len("RESULT ") :] + "\n")
            interesting = [
                ln
                for ln in text.splitlines()
                if ln.startswith(("RESULT", "PASS", "FAIL", "|")) or "passed" in ln
            ]
            summary.append(
                f"[{name}] {argv[1] if len(argv) > 1 else argv[0]} -> {status} "
                f"({time.time() - t0:.0f} s)"
            )
            summary += [f"    {ln[:200]}" for ln in interesting[-8:]]
    return summary


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help="names from --list, run in the order given")
    ap.add_argument("--list", action="store_true", help="list the scenarios")
    args = ap.parse_args(argv)
    if args.list or not args.scenarios:
        for name, s in SCENARIOS.items():
            print(f"{name:15} {s.what}")
        return 0
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; --list shows them")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "bench"), env.get("PYTHONPATH", ""), SITE]
    ).strip(os.pathsep)
    nvcc = shutil.which("nvcc")
    if nvcc and "CUDA_HOME" not in env:  # DeepSpeed's op builder looks for it
        env["CUDA_HOME"] = str(Path(nvcc).resolve().parents[1])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    summary = []
    for name in args.scenarios:
        summary += run_scenario(name, out, extra, env)
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
