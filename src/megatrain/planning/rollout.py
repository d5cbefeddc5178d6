"""GRPO's rollout phase: GPU memory and time of generating one batch of completions.

Symbols: N sequences (prompts x generations), Lp prompt tokens, Lc completion tokens,
P parameters (Pa active), c bytes of the compute dtype, V vocab, D hidden, I the widest MLP,
La layers with softmax attention, Hkv key/value heads and dh their width (a sliding-window
layer caches at most its window), Pl the largest layer, Pe + Ph embedding and head blocks.

GPU, what the rollout holds at its peak (recipes/grpo/rollout.py frees all of it before training):
- weights: resident, every parameter, P x c (one copy from the host's compute-dtype copy);
  resident compact (grpo.rollout_weights int8 / fp8, model/quant_linear.py), the decoder
  layers' linear weights Pq at 1 B each + a float32 scale per output channel, every other
  parameter at c; streamed, embedding + head + `num_slots` layer slots, (Pe + Ph + slots x Pl) x c;
- KV cache: 2 x La x Hkv x dh x c x N x (Lp + Lc) (transformers' dynamic cache at full length);
- linear-attention states: N x S, S one sequence's recurrent and convolution states over the
  layers that keep them (`state_bytes_per_sequence`), whatever the number of tokens;
- sampling: the last position's logits and the sampler's fp32 scores, N x V x (c + 2 x 4);
- prefill transient: one layer's MLP on the prompts, N x Lp x (2 I + D) x c;
- the allocator's slack on CUDA (planning/allocator_slack.py): the phase's largest transient
  tensor, one MLP intermediate N x Lp x I x c or the fp32 scores N x V x 4.

Time (seconds, one generation batch):
- weight copy: resident, once: the streamed blocks' P x c over the host link (under W ranks each
  rank copies its shards, P x c / W, and an all-gather completes them), the GPU tier's Pt x c
  read and written on the device (2 Pt x c / HBM bandwidth); compact: the same bytes,
  quantized on arrival;
- prefill: 2 x Pa x N x Lp / FLOP rate;
- decoding, per token: the weights read once (resident: their bytes above / HBM bandwidth, where
  compact weights that are dequantized per call (int8, fp8 without fp8 tensor cores) also
  write and read back their compute-dtype copy, 2 x Pq x c more; streamed: the layers over the
  host link, sum(Pl) x c / h2d), or 2 x Pa x N / FLOP rate if more, plus
  reading the KV cache at its mean length (Lp + Lc / 2) and reading and writing the
  linear-attention states (2 x N x S), plus issuing the forward's aten ops
  and the sampler's (`op_launch_s` each: eager decoding at small N is host-bound; compact
  linears add their own, quant_linear.EXTRA_OPS each);
- static decoding (recipes/grpo/decode.py, resident on CUDA): each step is one CUDA graph replay, so
  no op is issued from the host; the kernels still run one after another on the GPU, each
  op `DECODE_OP_S[decode]` ("graphs": eager kernels, one or more per op; "compiled": inductor's
  fused kernels, fewer than the ops), and attention reads the whole static cache (Lp + Lc)
  every step. The graph is captured per generation batch after one warm-up step: two eager
  steps more. The compile itself ("compiled") is paid once per run, in the first batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.model.quant_linear import (
    EXTRA_OPS,
    compact_linears,
    compact_weight_bytes,
    quantized_params,
)
from megatrain.planning.activations import layer_profile
from megatrain.planning.allocator_slack import SLACK_ITEM, allocator_slack
from megatrain.planning.hardware import Hardware
from megatrain.planning.ranks import ONE_PROCESS, Ranks
from megatrain.planning.spec import ModelSpec

SAMPLER_OPS = 40  # aten ops of one generate() step outside the model: logits warpers, sampling
# GPU time per aten op of a decoding step replayed as a CUDA graph (one token per sequence),
# beside the weight and KV reads, by decode mode: placeholders of a few microseconds (fused
# kernels cover several ops), fitted to H100 runs (docs/performance.md run 21: 2.0-2.2 us and
# 1.1 us); bench/cli_train.py's GRPO RESULT prints op_us_fit, the value that fits its run.
DECODE_OP_S = {"graphs": 2.0e-6, "compiled": 1.0e-6}
DECODE_MODES = ("generate", *DECODE_OP_S)  # generate: transformers' eager generate
# a linear-attention layer's state sizes, as transformers' and flash-linear-attention's
# gated-delta-rule modules name them (`state_bytes_per_sequence`)
STATE_SIZES = ("num_v_heads", "head_k_dim", "head_v_dim", "conv_dim", "conv_kernel_size")


@dataclass(frozen=True)
class RolloutEstimate:
    streamed: bool  # layers streamed per decoding step (else the whole model on the GPU)
    sequences: int  # N
    prompt_tokens: int  # Lp
    completion_tokens: int  # Lc
    gpu_items: dict[str, int]  # name -> bytes at the rollout's peak
    weight_copy_s: float
    prefill_s: float
    decode_token_s: float  # one decoding step, all N sequences
    rollout_s: float  # weight copy + prefill + capture + Lc decoding steps
    decode: str = "generate"  # one of DECODE_MODES (recipes/grpo/decode.py)
    decode_ops: int = 0  # aten ops of one decoding step (the model's and the sampler's)
    capture_s: float = 0.0  # static decoding: the warm-up step and the capture, per batch
    weights: str = "bf16"  # the resident weights' format (grpo.rollout_weights, resolved)

    @property
    def gpu_peak_bytes(self) -> int:
        return sum(self.gpu_items.values())

    @property
    def kv_cache_bytes(self) -> int:
        return self.gpu_items["KV cache"]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole rollout (every sequence at full length)."""
        return self.sequences * self.completion_tokens / self.rollout_s


def _copy_s(spec: ModelSpec, hw: Hardware, tier_params: int, ranks: Ranks) -> float:
    """Seconds of a resident rollout's weight copy (the module docstring)."""
    c = spec.compute_dtype.itemsize
    host = (spec.total_params - tier_params) * c
    link = host / ranks.world / (hw.h2d_gbps * 1e9) + ranks.collective_s(host)
    return link + 2 * tier_params * c / (hw.gpu_hbm_gbps * 1e9)


def kv_bytes_per_token(spec: ModelSpec, cached_tokens: int) -> int:
    """Key + value bytes of one sequence holding `cached_tokens` tokens, over every layer."""
    text = spec.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    c = spec.compute_dtype.itemsize
    total = 0
    for layer in spec.layers:
        if layer.attn_heads:
            kept = cached_tokens if layer.window is None else min(cached_tokens, layer.window)
            total += 2 * heads * head_dim * c * kept
    return total


def state_bytes_per_sequence(spec: ModelSpec) -> int:
    """One sequence's linear-attention states over every layer, as transformers' cache keeps
    them for a gated delta rule (Qwen3.5, Qwen3-Next; the layer module's `num_v_heads`,
    `head_k_dim`, `head_v_dim`, `conv_dim`, `conv_kernel_size`, flash-linear-attention's
    names): a float32 recurrent state of num_v_heads x head_k_dim x head_v_dim (the kernels'
    and the torch reference's final state) and the last conv_kernel_size inputs of the
    convolution, conv_dim wide, at the compute dtype. 0 for models without such layers."""
    key = ("linear-attention states",)  # the rollout is planned again every generation batch
    if key not in spec.cache:
        c = spec.compute_dtype.itemsize
        total = 0
        for layer in spec.structure.layers:
            for m in layer.modules():
                size = {k: int(getattr(m, k, 0) or 0) for k in STATE_SIZES}
                recurrent = size["num_v_heads"] * size["head_k_dim"] * size["head_v_dim"]
                if recurrent:
                    total += recurrent * 4 + size["conv_dim"] * size["conv_kernel_size"] * c
        spec.cache[key] = total
    return int(spec.cache[key])


def _resident_weights(
    spec: ModelSpec, weights_format: str, fp8_matmul: bool
) -> tuple[int, int, int]:
    """A resident rollout's weight bytes on the GPU, the bytes a decoding step writes and reads
    back dequantizing them (int8, or fp8 without fp8 tensor cores), and the kernels the compact
    linear layers add to a step (module docstring)."""
    c = spec.compute_dtype.itemsize
    if weights_format == "bf16":
        return spec.total_params * c, 0, 0
    layers = spec.structure.layers
    weights = (spec.embed_params + spec.head_params) * c + compact_weight_bytes(layers, c)
    dequantized = weights_format == "int8" or not fp8_matmul
    dequant_bytes = 2 * quantized_params(layers) * c if dequantized else 0
    kind = "dequantized" if dequantized else "scaled_mm"
    return weights, dequant_bytes, len(compact_linears(layers)) * EXTRA_OPS[kind]


def rollout_estimate(
    spec: ModelSpec,
    hw: Hardware,
    *,
    sequences: int,
    prompt_tokens: int,
    completion_tokens: int,
    streamed: bool = False,
    num_slots: int | None = None,
    decode: str = "generate",
    cuda: bool = True,
    weights_format: str = "bf16",
    fp8_matmul: bool = True,
    tier_params: int = 0,
    ranks: Ranks = ONE_PROCESS,
) -> RolloutEstimate:
    """Predict the rollout phase of one generation batch (see the module docstring);
    `decode`: one of DECODE_MODES, on CUDA (the CPU runs static decoding without graphs);
    `cuda`: the allocator's slack counts (planning/allocator_slack.py); `weights_format`: a
    resident rollout's weights, "bf16" (the compute dtype), "int8" or "fp8"; `fp8_matmul`:
    fp8 weights multiply on fp8 tensor cores (else they are dequantized per call, as int8);
    `tier_params`: parameters the engine's GPU tier holds on the device (copied from there);
    `ranks`: the run's (a streamed block's weights are all-gathered from its shards)."""
    c = spec.compute_dtype.itemsize
    n, lp, lc = sequences, prompt_tokens, completion_tokens
    layer_bytes = sum(la.params for la in spec.layers) * c
    if streamed:
        assert num_slots is not None, "a streamed rollout needs memory.num_slots"
        assert weights_format == "bf16", "compact weights are for the resident rollout"
        slots = min(num_slots, spec.num_layers)
        weights = (spec.embed_params + spec.head_params + slots * spec.layer_params_max) * c
        dequant_bytes, extra_ops = 0, 0
    else:
        weights, dequant_bytes, extra_ops = _resident_weights(spec, weights_format, fp8_matmul)
    text = spec.config.get_text_config()
    width = max(getattr(text, k, 0) or 0 for k in ("intermediate_size", "moe_intermediate_size"))
    items = {
        "weights": weights,
        "KV cache": n * kv_bytes_per_token(spec, lp + lc),
        "logits + sampler scores": n * spec.vocab_size * (c + 8),
        "prefill transient (one MLP)": n * lp * (2 * width + spec.hidden_size) * c,
    }
    states = n * state_bytes_per_sequence(spec)
    if states:
        items["linear-attention states"] = states
    # the phase's largest transient tensor: one prefill MLP intermediate, or the fp32 scores
    items[SLACK_ITEM] = allocator_slack(max(n * lp * width * c, n * spec.vocab_size * 4), cuda=cuda)
    rate = hw.flops_per_s(spec.compute_dtype, spec.hidden_size)
    hbm = hw.gpu_hbm_gbps * 1e9
    read_s = (weights + dequant_bytes) / hbm  # streamed: the resident embedding and head
    if streamed:
        read_s += layer_bytes / (hw.h2d_gbps * 1e9)  # every layer over the host link
    ops = sum(f for f, _ in layer_profile(spec, 1, 16, "padded").ops) + SAMPLER_OPS + extra_ops
    assert decode in DECODE_MODES and not (streamed and decode != "generate"), decode
    weights_s = max(read_s, 2.0 * spec.active_params * n / rate)
    state_s = 2 * states / hbm  # read and written back each step
    kv_read_s = n * kv_bytes_per_token(spec, lp + lc // 2) / hbm
    eager = weights_s + kv_read_s + state_s + ops * hw.op_launch_s
    step_s, capture_s = eager, 0.0
    if decode in DECODE_OP_S:
        kv_read_s = n * kv_bytes_per_token(spec, lp + lc) / hbm  # the whole static cache
        step_s = weights_s + kv_read_s + state_s + ops * DECODE_OP_S[decode]
        capture_s = 2 * eager
    copy_s = 0.0 if streamed else _copy_s(spec, hw, tier_params, ranks)
    prefill_s = 2.0 * spec.active_params * n * lp / rate
    return RolloutEstimate(
        streamed=streamed,
        sequences=n,
        prompt_tokens=lp,
        completion_tokens=lc,
        gpu_items=items,
        weight_copy_s=copy_s,
        prefill_s=prefill_s,
        decode_token_s=step_s,
        rollout_s=copy_s + prefill_s + capture_s + lc * step_s,
        decode=decode,
        capture_s=capture_s,
        decode_ops=ops,
        weights=weights_format,
    )
