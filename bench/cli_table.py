"""A short table of bench/cli_train.py's RESULT lines, the last of each name in
$OUT/results.jsonl, and ratios of their tokens/s per GPU: a scenario's last command.

    python bench/cli_table.py --names dpo_sft,dpo --ratio dpo/dpo_sft
    python bench/cli_table.py --names vlm_text,vlm_images --step-ratio vlm_images/vlm_text

Other arguments are ignored: bench/run.py gives the arguments after its `--` to every command
of a scenario (the runs' one-off variations).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

COLUMNS = (  # (header, key)
    ("run", "name"),
    ("command", "command"),
    ("GPUs", "nproc"),
    ("rc", "rc"),
    ("steps", "steps"),
    ("step s", "step_s"),
    ("tokens/step", "step_tokens"),
    ("tokens/s", "tokens_per_s"),
    ("per GPU", "tokens_per_s_per_gpu"),
    ("MFU", "mfu"),
    ("TFLOPS/GPU", "tflops_per_gpu"),
    ("images/step", "images_per_step"),
    ("images/s", "images_per_s"),
    ("reference s", "ref_s"),
    ("reference tokens/s", "ref_tokens_per_s"),
    ("GPU peak GiB", "gpu_peak_gib"),
    ("predicted GiB", "pred_gpu_peak_gib"),
    ("host GiB", "host_rss_gib"),
    ("predicted host GiB", "pred_host_gib"),
    ("predicted step s", "pred_step_s"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 1000 else f"{value:g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--names", required=True, help="the runs' --name, comma-separated, in order")
    ap.add_argument("--ratio", action="append", default=[], help="A/B: tokens/s per GPU")
    ap.add_argument("--step-ratio", action="append", default=[], help="A/B: step seconds")
    a, _ = ap.parse_known_args()
    names = a.names.split(",")
    path = Path(os.environ.get("OUT", "/tmp/out")) / "results.jsonl"
    last: dict[str, dict[str, Any]] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        record = json.loads(line) if line.strip() else {}
        if record.get("name") in names:
            last[record["name"]] = record
    print("| " + " | ".join(h for h, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for name in names:
        record = last.get(name, {"name": name, "rc": "no result"})
        print("| " + " | ".join(_cell(record.get(k)) for _, k in COLUMNS) + " |")
    for ratio in a.ratio:
        top, bottom = (last.get(n, {}).get("tokens_per_s_per_gpu") for n in ratio.split("/"))
        shown = f"{top / bottom:.3f}x" if top and bottom else "n/a"
        print(f"| tokens/s per GPU, {ratio}: {shown} |")
    for ratio in a.step_ratio:
        top, bottom = (last.get(n, {}).get("step_s") for n in ratio.split("/"))
        shown = f"{top / bottom:.3f}x" if top and bottom else "n/a"
        print(f"| step seconds, {ratio}: {shown} |")


if __name__ == "__main__":
    main()
