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
