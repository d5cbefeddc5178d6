"""MegaTrain against its peers on the same job, in one go on the GPU machine.

    python bench/compare.py --preset qwen2.5-3b --tokens 8192,32768 \
        --systems megatrain,gpu,fsdp2,deepspeed --peer-tokens 8192
    python bench/compare.py --tokens 8192 --systems gpu,deepspeed,megatrain,\
        megatrain:optimizer.state_dtype=int8+memory.gpu_state_blocks=auto

A system `megatrain:KEY=VALUE+...` is the engine with those config overrides.

Same model shape (random init), tokens, dtypes (bf16 compute, fp32 master weights and AdamW), seq
2048, no gradient clipping (as the peers' job in bench/peers.py). Each system runs in its own
process: `megatrain train` as a user runs it (bench/cli_train.py: a config file, 2 more steps to
warm up, optimizer.max_grad_norm 0), GPU-resident HF training with fused AdamW, torch FSDP2 with
CPU offload, DeepSpeed ZeRO-3 with parameter and optimizer offload (bench/peers.py). The
GPU-resident run reaches larger token counts by gradient accumulation of 8192-token micro-batches.
Prints a markdown table (tokens/s, model TFLOPS = 6 x params x tokens/s, GPU peak, host RSS,
ratios) and writes it to $OUT/compare.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MICRO_ROWS = 4  # 4 x 2048 = 8192 tokens per micro-batch, as in the peers' baseline job


def run(cmd: list[str], log: Path) -> dict | None:
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout)
    found = [
        json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    print(f"  {' '.join(cmd[1:])}: rc {proc.returncode}, {time.time() - t0:.0f}s", flush=True)
    if proc.returncode != 0 or not found:
        print("\n".join(proc.stdout.splitlines()[-15:]), flush=True)
        return None
    return found[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-3b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--peer-tokens", default="8192", help="token counts the offload peers run")
    ap.add_argument("--systems", default="megatrain,gpu,fsdp2,deepspeed")
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    rows = []
    for tokens in [int(t) for t in a.tokens.split(",")]:
        micro = tokens // (MICRO_ROWS * a.seq)
        for system in a.systems.split(","):
            log = out / f"{system}_{tokens}.log"
            if system.split(":")[0] == "megatrain":
                # `megatrain train` as a user runs it (bench/cli_train.py), no clipping as the
                # peers' job unless the system's overrides set it; the first two steps warm up
                name = re.sub(r"[^\w.]+", "_", system)
                cmd = [
                    py,
                    str(HERE / "cli_train.py"),
                    *("--name", f"{name}_{tokens}", "--preset", a.preset),
                    *("--seq", str(a.seq), "--rows", str(micro * MICRO_ROWS)),
                    *("--micro", str(MICRO_ROWS), "--steps", str(a.steps + 2)),
                    *("--", "--optimizer.max_grad_norm", "0", *variant_overrides(system)),
                ]
            elif system == "gpu":
                cmd = [
                    py,
                    str(HERE / "peers.py"),
                    "--mode",
                    "gpu",
                    "--preset",
                    a.preset,
                    "--batch",
                    str(MICRO_ROWS),
                    "--seq",
                    str(a.seq),
                    "--accum",
                    str(micro),
                    "--steps",
                    str(a.steps),
                ]
            elif str(tokens) in a.peer_tokens.split(","):
                cmd = [
                    py,
                    str(HERE / "peers.py"),
                    "--mode",
                    system,
                    "--preset",
                    a.preset,
                    "--batch",
                    str(micro * MICRO_ROWS),
                    "--seq",
                    str(a.seq),
                    "--steps",
                    str(a.steps),
                ]
            else:
                continue
            res = run(cmd, log)
            if res is not None and system.startswith("megatrain"):  # cli_train: metrics.jsonl's
                # 6 x params x tokens/s as the peers'; the allocated peak as theirs (not reserved)
                res["model_tflops"] = res.get("tflops_per_gpu", 0.0)
                res["gpu_peak_gib"] = res.get("gpu_alloc_peak_gib")
            if res is not None:
                rows.append(dict(res, system=system, tokens=tokens))
    table = render(rows)
    print(table)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def variant_overrides(system: str) -> list[str]:
    """`megatrain:KEY=VALUE+KEY=VALUE` -> config overrides of that engine run, e.g.
    megatrain:optimizer.state_dtype=int8+memory.gpu_state_blocks=auto."""
    _, _, spec = system.partition(":")
    out: list[str] = []
    for item in filter(None, spec.split("+")):
        key, _, value = item.partition("=")
        out += [f"--{key}", value]
    return out


def render(rows: list[dict]) -> str:
    lines = [
        "| system | tokens/step | step (s) | tokens/s | model TFLOPS | GPU peak (GiB) | "
        "host RSS (GiB) | step / GPU-resident | tokens/s vs DeepSpeed | vs FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["system"], r["tokens"]): r for r in rows}
    for r in rows:
        gpu = by.get(("gpu", r["tokens"]))
        ds = by.get(("deepspeed", r["tokens"]))
        fs = by.get(("fsdp2", r["tokens"]))

        def ratio(other: dict | None, key: str, row: dict = r) -> str:
            return "-" if other is None else f"{row[key] / other[key]:.2f}x"

        lines.append(
            f"| {r['system']} | {r['tokens']:,} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['model_tflops']:.0f} | {r.get('gpu_peak_gib')} | {r.get('host_rss_gib')} | "
            f"{ratio(gpu, 'step_s')} | {ratio(ds, 'tokens_per_s')} | "
            f"{ratio(fs, 'tokens_per_s')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
