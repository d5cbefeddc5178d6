"""GPU kernel time of a profiled step (bench/step_profile/sitecustomize.py) or of a layer
(bench/layer_speed.py --profile), by phase and by kind of kernel.

    python bench/step_profile/step_kernels.py kernels.json [more.json ...] [--top 25]

`kernel_totals(trace)`: from a torch.profiler Chrome trace, each kernel's phase (the `mt:<phase>`
annotation range that holds its start on the GPU timeline; "other" outside them), name, calls
and summed microseconds. The summary groups names by KINDS, first match wins.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

KINDS = (
    ("experts", re.compile(r"grouped|GroupProblem|ptr_array|Grouped", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attn|attention|efficient|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm80_|wgmma", re.I)),
    ("compiled", re.compile(r"^kernel:triton_", re.I)),
    ("adamw", re.compile(r"adamw", re.I)),
    ("copy", re.compile(r"^gpu_memcpy|^gpu_memset|copy|fill", re.I)),
    ("reduce", re.compile(r"reduce|sum|norm", re.I)),
    ("index", re.compile(r"index|scatter|gather|sort|topk|histc|cumsum|nonzero", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled", re.I)),
)


def kernel_totals(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU kernel's phase, name, calls and summed microseconds, longest first."""
    events = trace.get("traceEvents", [])
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][3:])
        for e in events
        if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("mt:")
    )
    totals: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts = e["ts"]
        phase = next((p for lo, hi, p in ranges if lo <= ts < hi), "other")
        slot = totals.setdefault((phase, f"{e['cat']}:{e['name']}"), [0, 0.0])
        slot[0] += 1
        slot[1] += e.get("dur", 0.0)
    return [
        {"phase": p, "name": n, "calls": c, "us": round(us, 1)}
        for (p, n), (c, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])
    ]


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def summary(rows: list[dict[str, Any]], top: int) -> str:
    phases = sorted({r["phase"] for r in rows})
    kinds = [k for k, _ in KINDS] + ["other"]
    ms: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["phase"], kind(r["name"]))
        ms[key] = ms.get(key, 0.0) + r["us"] / 1e3

    def row(label: str, cells: list[float]) -> str:
        return f"| {label} | " + " | ".join(f"{c:.1f}" for c in [*cells, sum(cells)]) + " |"

    lines = ["| kind | " + " | ".join(phases) + " | all |", "|---" * (len(phases) + 2) + "|"]
    for k in kinds:
        cells = [ms.get((p, k), 0.0) for p in phases]
        if sum(cells):
            lines.append(row(k, cells))
    lines.append(row("all (ms)", [sum(v for (p, _), v in ms.items() if p == ph) for ph in phases]))
    lines.append("")
    for r in rows[:top]:
        lines.append(
            f"{r['us'] / 1e3:9.2f} ms {r['calls']:6d}x {r['phase']:9s} {kind(r['name']):11s} "
            f"{r['name'][:110]}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for f in a.files:
        print(f"## {f}\n{summary(json.loads(Path(f).read_text()), a.top)}\n")


if __name__ == "__main__":
    main()
