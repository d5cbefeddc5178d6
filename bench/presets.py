"""Model shapes the engine alone runs (config.json values; "model_type" where not qwen2), beside
bench/peers.py's (bench/common.py PRESETS joins them). Plain data, no imports beyond typing: the
tests' shapes (tests/shapes.py) read the same values.
"""

from __future__ import annotations

from typing import Any

_QWEN_LARGE = dict(num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)
ENGINE_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
    ),
    "qwen2.5-14b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        **_QWEN_LARGE,
    ),
    "qwen2.5-32b": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        **_QWEN_LARGE,
    ),
    "qwen2.5-72b": dict(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        **_QWEN_LARGE,
    ),
    # Qwen3.5-27B's text model (hybrid: Gated DeltaNet x3, gated full attention x1, repeating)
    "qwen3.5-27b": dict(
        model_type="qwen3_5_text",
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
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
    ),
    # Qwen3-30B-A3B (128 experts, top 8)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    # GPT-OSS-20B (32 experts, top 4; sliding-window (128) and full attention layers alternating,
    # attention sinks): the public openai/gpt-oss-20b config.json (transformers' GptOssConfig
    # defaults are the 120B's: 36 layers, 128 experts); layer_types follow the layer count
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        attention_bias=True,
        swiglu_limit=7.0,
        router_aux_loss_coef=0.9,
        rms_norm_eps=1e-5,
        vocab_size=201088,
        tie_word_embeddings=False,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
        max_position_embeddings=131072,
    ),
    # Qwen3-Next-80B-A3B (hybrid: Gated DeltaNet x3, gated full attention x1, repeating; every
    # layer MoE, 512 experts top 10 + a shared expert): the public
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json; layer_types follow the layer count
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next",
        hidden_size=2048,
        intermediate_size=5120,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=512,
        num_experts_per_tok=10,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        rms_norm_eps=1e-6,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
    ),
}

# GPT-OSS-120B: the 20B's config with 36 layers and 128 experts (transformers' GptOssConfig
# defaults; the public openai/gpt-oss-120b config.json): 116.8B parameters, 5.1B active
ENGINE_PRESETS["gpt-oss-120b"] = {
    **ENGINE_PRESETS["gpt-oss-20b"],
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}
