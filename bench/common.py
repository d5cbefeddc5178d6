"""Helpers shared by the benchmark scripts (run on the GPU machine, not in CI).

Model presets are bench/peers.py's, so numbers compare with the peers' runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import peers as _peers
import torch
from presets import ENGINE_PRESETS

# The peers' presets (bench/peers.py, a copy of the team's shared baseline script) are ours too,
# plus larger shapes the engine alone runs (bench/presets.py).
PRESETS: dict[str, dict[str, Any]] = {**_peers.PRESETS, **ENGINE_PRESETS}
host_rss_gib = _peers.host_rss_gib


def preset_values(name: str, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """(model_type, config values) of a preset; `overrides` replace values (e.g. layers)."""
    values = {"max_position_embeddings": 32768, **PRESETS[name], **overrides}
    return values.pop("model_type", "qwen2"), values


def preset_config(name: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    model_type, values = preset_values(name, **overrides)
    return AutoConfig.for_model(model_type, **values, use_cache=False, attn_implementation="sdpa")


def host_peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return round(int(line.split()[1]) / 2**20, 2)
    return float("nan")


def result(**kv: Any) -> None:
    """One machine-readable line per measurement, also appended to $OUT/results.jsonl when run
    alone (under bench/run.py the runner collects the printed lines)."""
    line = json.dumps(kv)
    print("RESULT " + line, flush=True)
    out = os.environ.get("OUT")
    if out and not os.environ.get("BENCH_COLLECTS"):
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(line + "\n")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_s(fn: Any, device: str = "cuda", iters: int = 10, warmup: int = 2) -> float:
    """Seconds per call of `fn` after `warmup` calls: CUDA events on a GPU, the host clock
    elsewhere."""
    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters
