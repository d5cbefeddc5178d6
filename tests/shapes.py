"""Published model shapes the resource tests estimate (config values only: nothing is built).
The hybrid and MoE shapes are the bench's own presets (bench/presets.py), cut as its runs cut
them, so a test reconstructs exactly the shape a run in docs/performance.md trained."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def _bench_presets() -> dict[str, dict[str, Any]]:
    path = Path(__file__).resolve().parents[1] / "bench" / "presets.py"
    spec = importlib.util.spec_from_file_location("bench_presets", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    presets: dict[str, dict[str, Any]] = module.ENGINE_PRESETS
    return presets


_BENCH = _bench_presets()


def _engine(name: str, layers: int | None = None) -> dict[str, Any]:
    """bench/presets.py's `name` (model_type included), cut to `layers` as bench/cli_train.py
    --layers cuts it."""
    shape = dict(_BENCH[name])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return shape


QWEN25_3B = dict(  # 36 equal layers, tied embeddings
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
QWEN25_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
QWEN25_32B = QWEN25_7B | dict(
    hidden_size=5120,
    intermediate_size=27648,
    num_hidden_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
)
# the bench's Llama-3.1-8B without model_type and its rope and position keys
# (LlamaConfig(**LLAMA31_8B); the tests that rebuild a run add what it ran with)
LLAMA31_8B = {
    k: v
    for k, v in _engine("llama3.1-8b").items()
    if k not in ("model_type", "rope_theta", "rope_scaling", "max_position_embeddings")
}
QWEN35_27B_16 = _engine("qwen3.5-27b", 16)  # 12 Gated DeltaNet + 4 full attention layers
QWEN35_27B = _engine("qwen3.5-27b")  # all 64 layers (48 linear + 16 full)
QWEN3_30B_A3B_12 = _engine("qwen3-30b-a3b", 12)
GPT_OSS_20B = _engine("gpt-oss-20b")  # attention sinks, 32 experts top 4
GPT_OSS_20B_17 = _engine("gpt-oss-20b", 17)  # the most that fit the 125 GiB host, int8 states
QWEN3_NEXT_80B_A3B_19 = _engine("qwen3-next-80b-a3b", 19)
QWEN3_NEXT_80B_A3B_8 = _engine("qwen3-next-80b-a3b", 8)  # the same on the 125 GiB host
QWEN25_VL_7B_TEXT = dict(  # bench/vlm_data.py "qwen2.5-vl-7b": the language model
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]),
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)
QWEN25_VL_7B_VISION = dict(  # its vision tower
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)
