"""Predicted vs measured: the estimate each `megatrain train` run printed against what it measured.

    python bench/estimate_check.py RESULTS.jsonl

For every bench/cli_train.py result of a results.jsonl (a run of `megatrain train` as a user
runs it, its prediction the `resources: ... (predicted)` line the run printed, with the
hardware numbers the command itself uses) it prints GPU peak (the allocator's reserved peak),
host RSS and step time, predicted vs measured, with the ratio. Issue 5's bar: memory within
15%, step time within 25%.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAIRS = (  # (predicted, measured)
    ("pred_gpu_peak_gib", "gpu_peak_gib"),
    ("pred_host_gib", "host_rss_gib"),
    ("pred_step_s", "step_s"),
)


def cell(pred: float | None, meas: float | None) -> str:
    if pred is None or not meas:
        return f"{pred} / {meas}"
    return f"{pred:.2f} / {meas:.2f} ({pred / meas:.2f}x)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    a, _ = ap.parse_known_args()  # bench/run.py gives every command the arguments after its --
    print(
        "| run | GPU peak GiB (pred / meas) | host RSS GiB (pred / meas) | step s (pred / meas) |"
    )
    print("|---|---|---|---|")
    for line in Path(a.results).read_text().splitlines():
        r = json.loads(line)
        if r.get("command") != "train" or "pred_step_s" not in r:
            continue
        name = f"{r['name']} {r.get('step_tokens', 0):,} tok"
        cells = " | ".join(cell(r.get(p), r.get(m)) for p, m in PAIRS)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
