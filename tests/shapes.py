"""Published model shapes the resource tests estimate (config values only: nothing is built)."""

from __future__ import annotations

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
LLAMA31_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
QWEN35_27B_16 = dict(  # bench/common.py "qwen3.5-27b", cut to 16 layers (12 linear + 4 full)
    model_type="qwen3_5_text",
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    vocab_size=248320,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
)
QWEN3_30B_A3B_12 = dict(  # bench/common.py "qwen3-30b-a3b", cut to 12 layers
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=12,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
)
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
