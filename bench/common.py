"""Helpers shared by the benchmark scripts (run on the GPU machine, not in CI).

Model presets match ../shared/bench/peers.py so numbers compare with the peers' runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
}


def preset_config(name: str) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **PRESETS[name], max_position_embeddings=32768, use_cache=False, attn_implementation="sdpa"
    )


def host_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return round(int(line.split()[1]) / 2**20, 2)
    return float("nan")


def host_peak_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return round(int(line.split()[1]) / 2**20, 2)
    return float("nan")


def result(**kv: Any) -> None:
    """One machine-readable line per measurement (also appended to $OUT/results.jsonl)."""
    line = json.dumps(kv)
    print("RESULT " + line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            f.write(line + "\n")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
