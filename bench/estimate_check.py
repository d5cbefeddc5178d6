"""Predicted vs measured: the resource estimate for each engine run of a results.jsonl.

    python bench/estimate_check.py RESULTS.jsonl [--hardware HW.json] [--probe-out HW.json]

For every `bench/train_shape.py` result (system "megatrain") it builds the estimate from the
preset's config alone, with the hardware numbers of the same machine (`--hardware`, written by
`--probe-out` there), and prints GPU peak, host RSS and step time, predicted vs measured, with
the ratio. Issue 5's bar: memory within 15%, step time within 25%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from common import preset_config

from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.plan import EnginePlan
from megatrain.planning import Hardware, estimate, model_spec, probe
from megatrain.planning.setup import Setup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="?")
    ap.add_argument("--hardware", help="JSON of a Hardware (from --probe-out)")
    ap.add_argument("--probe-out", help="probe this machine and write its Hardware JSON here")
    a = ap.parse_args()
    if a.probe_out:
        hw = probe()
        Path(a.probe_out).write_text(json.dumps(dataclasses.asdict(hw)))
        print(json.dumps(dataclasses.asdict(hw)))
    elif a.hardware:
        raw = json.loads(Path(a.hardware).read_text())
        hw = Hardware(**{**raw, "measured": tuple(raw["measured"])})
    else:
        hw = Hardware()
    if not a.results:
        return
    print(
        "| run | GPU peak GiB (pred / meas) | host RSS GiB (pred / meas) | step s (pred / meas) |"
    )
    print("|---|---|---|---|")
    for line in Path(a.results).read_text().splitlines():
        r = json.loads(line)
        if r.get("system") != "megatrain":
            continue
        spec = model_spec(preset_config(r["preset"]), "bf16")
        plan = EnginePlan(
            num_slots=r["num_slots"],
            clip_norm=r["max_grad_norm"] or None,
            loss_chunk_tokens=default_chunk_tokens(spec.vocab_size),
        )
        setup = Setup(
            plan,
            seq_len=r["seq"],
            micro_batch_size=r["batch"] // r["micro"],
            grad_accum=r["micro"],
            layout="full",
        )
        est = estimate(spec, setup, hw)
        gpu, rss = est.gpu.peak_bytes / 2**30, est.host.total_bytes / 2**30
        step = est.time.step_s

        def cell(pred: float, meas: float) -> str:
            return f"{pred:.2f} / {meas:.2f} ({pred / meas:.2f}x)"

        name = f"{r['preset']} {r['batch'] * r['seq']:,} tok" + (
            " compiled" if r.get("compiled") else ""
        )
        print(
            f"| {name} | {cell(gpu, r['gpu_peak_gib'])} | {cell(rss, r['host_rss_gib'])} | "
            f"{cell(step, r['step_s'])} |"
        )


if __name__ == "__main__":
    main()
