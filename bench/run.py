"""The GPU machine's benchmark runner: named scenarios, each a few commands, logs under $OUT.

    python bench/run.py --list
    python bench/run.py verify_cuda compare adamw       # in this order, one log per scenario
    python bench/run.py long_context_auto -- --memory.mlp_tiles 4
    OUT=$OUT/g1 python bench/run.py --gpu 1 --cpus 16-31 user_512k &   # two at once, one a GPU
    OUT=$OUT/g0 python bench/run.py --gpu 0 --cpus 0-15 gpt_oss_sinks
    python bench/run.py --parallel 0:0-15:gpt_oss_sinks 1:16-31:user_512k --deadline 560
    python bench/run.py --pack user_dense          # logs packed into $OUT/logs.tgz

Every scenario names what it measures; arguments after `--` go to each command of the
scenarios run (for one-off variations). Each command runs with a timeout, its output goes to
$OUT/<scenario>.log (default /tmp/out), the `RESULT {...}` lines the scripts print are collected
into $OUT/results.jsonl, and a short summary is printed last. Each command's log ends with a
`NODE` line: the node's memory in use before it and at its peak (sampled every second).
Record what you run in docs/performance.md (date, card, command, numbers); results of past
runs live there, not here.

The environment of the GPU machine is kept as it is (NCCL_NVLS_ENABLE=0 and friends stay set);
this runner only adds PYTHONPATH (src/ and bench/), PYTHONUNBUFFERED, TRANSFORMERS_VERBOSITY and
BENCH_COLLECTS (the scripts then leave results.jsonl to the runner: one line per result).
Multi-GPU scenarios launch with torchrun on $NGPU GPUs (the env var NGPU, else every GPU torch
sees), OMP_NUM_THREADS set to each rank's share of the cores (torchrun would set 1, which
starves DeepSpeed's CPU Adam and the model's random init).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from node_memory import NodeMemory
from parallel import pack_logs, run_parallel
from scenarios import ROOT, SCENARIOS, SITE


def _gpus() -> int:
    if os.environ.get("NGPU"):
        return int(os.environ["NGPU"])
    import torch

    return max(1, torch.cuda.device_count())


def _expand(argv: list[str]) -> list[str]:
    """$WHEELS: every wheel in .wheels/; $DEEPSPEED: the DeepSpeed source archive there;
    $NGPU: the GPUs of a torchrun launch; $THREADS: each of their ranks' share of the cores."""
    wheels = ROOT / ".wheels"
    out: list[str] = []
    if any("$NGPU" in a or "$THREADS" in a for a in argv):
        ngpu = _gpus()
        threads = max(1, (os.cpu_count() or 1) // ngpu)
        argv = [a.replace("$NGPU", str(ngpu)).replace("$THREADS", str(threads)) for a in argv]
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
            start = f.tell()
            node = NodeMemory()
            # the output goes to the log as it comes: a long run's log can be read while it runs
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a timeout stops torchrun's ranks too
            )
            try:
                status = str(proc.wait(timeout=scenario.timeout_s))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = f"timeout {scenario.timeout_s}s"
            memory = node.stop()
            f.write(f"NODE {memory}\n")
            f.flush()
            text = log.read_bytes()[start:].decode(errors="replace")
            with (out / "results.jsonl").open("a") as results:
                for line in text.splitlines():
                    if line.startswith("RESULT "):
                        results.write(line[len("RESULT ") :] + "\n")
            interesting = [
                ln
                for ln in text.splitlines()
                if ln.startswith(("RESULT", "PASS", "FAIL", "|")) or "passed" in ln
            ]
            scripts = [a for a in argv if a.endswith(".py")] or argv[1:2] or argv[:1]
            took = f"{time.time() - t0:.0f} s"
            summary.append(f"[{name}] {scripts[0]} -> {status} ({took}; {memory})")
            summary += [f"    {ln[:200]}" for ln in interesting[-8:]]
    return summary


def _cpu_list(spec: str) -> set[int]:
    """ "0-15,32" -> {0, ..., 15, 32} (taskset's list format)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def main() -> int:
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help="names from --list, run in the order given")
    ap.add_argument("--list", action="store_true", help="list the scenarios")
    ap.add_argument(
        "--gpu", help="the GPUs the scenarios see (CUDA_VISIBLE_DEVICES), e.g. 1: one of several"
    )
    ap.add_argument(
        "--cpus",
        help="the vCPUs they run on, e.g. 16-31 (megatrain train takes its AdamW threads from "
        "this affinity): two runners, one per GPU, each on its half of the host",
    )
    ap.add_argument(
        "--parallel",
        nargs="+",
        metavar="GPU:CPUS:SCENARIO[,SCENARIO]",
        help="one runner per GPU at once, waited for, killed at --deadline, logs packed "
        "(bench/parallel.py)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=560,
        help="--parallel: seconds before the runners still going are killed (leave the device "
        "command time to pack the logs)",
    )
    ap.add_argument(
        "--pack",
        action="store_true",
        help="after the scenarios, their folders' logs into $OUT/logs.tgz and the folders "
        "removed (the device tool brings back at most 8 files)",
    )
    args = ap.parse_args(argv)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    if args.parallel:
        if args.scenarios:
            ap.error("--parallel names each GPU's scenarios itself")
        out.mkdir(parents=True, exist_ok=True)
        print("\n".join(run_parallel(args.parallel, out, args.deadline)))
        return 0
    if args.list or not args.scenarios:
        for name, s in SCENARIOS.items():
            print(f"{name:15} {s.what}")
        return 0
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; --list shows them")
    if args.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu  # before torch counts the GPUs (_gpus)
    if args.cpus:
        os.sched_setaffinity(0, _cpu_list(args.cpus))  # the commands inherit it
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "bench"), env.get("PYTHONPATH", ""), SITE]
    ).strip(os.pathsep)
    nvcc = shutil.which("nvcc")
    if nvcc and "CUDA_HOME" not in env:  # DeepSpeed's op builder looks for it
        env["CUDA_HOME"] = str(Path(nvcc).resolve().parents[1])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["BENCH_COLLECTS"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    summary = []
    for name in args.scenarios:
        summary += run_scenario(name, out, extra, env)
    if args.pack:
        pack_logs(out, sorted(p for p in out.iterdir() if p.is_dir()))
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
