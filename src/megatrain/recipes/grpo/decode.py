"""Static decoding for the resident rollout: a static KV cache and each token one CUDA graph.

Eager `generate` issues every aten op of a decoding step from Python: for a 7B model and 16
sequences some 1,500 kernel launches, about 42 ms per token on an H100 while reading the
weights takes 4.5 ms (host-bound). Here the decoding step touches only tensors at fixed
addresses, so on CUDA it is captured once per generation batch into a CUDA graph and each
token is one `replay()`:

- the KV cache is transformers' `StaticCache`, `cache_len` tokens per sequence (the plan's
  max_prompt_length + max_completion_length), written in place at the cache's own device-side
  position counter;
- the attention mask is ours, 4D boolean (transformers passes a 4D mask through unchanged):
  prompt keys that are padding stay masked, and each step unmasks its own slot, in place;
- attention is SDPA through `packed_attention` (decode_support.py), registered with
  transformers and set on the model's config for the call: it runs one query token on the
  key/value heads, never repeating the cache for grouped heads, compiled or not;
- the prompts are prefilled eagerly in one forward (left padded, positions as `generate`
  computes them), and the first token is picked from its last position;
- one step: unmask the slot, forward the newest token of every sequence, pick the next one
  (EOS suppressed before `min_new_tokens`, temperature, top-p, sampling by the exponential
  race `argmax(p / E)` that `torch.multinomial` uses for one sample, or argmax), pad where a
  sequence has finished, record it (and, when asked, its log-prob at the sampling temperature:
  Rollout.logps), advance positions. No `.item()`, no host branch on a
  device value: the same step runs eagerly on the CPU and before the capture.

Sync points: one per STOP_CHECK_STEPS tokens (have all sequences finished?) and the
completions to the host at the end; none per token. Forced full length (`min_new_tokens =
max_new_tokens`, the bench) never stops early.

The forward of a step is the model's eager code ("graphs") or that code compiled with
torch.compile (`compile_forward`: inductor fuses the norms, rotary and activations into fewer
kernels; no CUDA graphs of its own). What is paid when:

- the compile, once per run (per process): `compiled_forward` is one compiled function that
  takes the model as an argument, and its guards do not depend on the model object or its
  weights' addresses, so the next generation batch's fresh device copy reuses the compiled
  code (tests/recipes/grpo/test_grpo_decode_compile.py counts the graphs). It is paid in the first
  batch's warm-up step, where inductor also tunes its kernels;
- the warm-up and the capture, per generation batch: the rollout's weights come back at new
  addresses each batch (device_model frees them for the training phase) and a CUDA graph bakes
  addresses in, so each batch runs its second token eagerly on a side stream, then captures
  the step (about two steps' time; no compile).

Hybrid models (Qwen3.5: gated-delta-rule linear attention beside full attention) decode the
same way: their linear-attention layers keep a fixed-size convolution and recurrent state per
sequence in transformers' cache, updated in place (a CUDA graph replays it), and the forward
takes one mask per layer type, transformers' mapping for hybrid models: the 4D mask above for
the full-attention layers; for the linear-attention layers the prompts' 2D padding mask at the
prefill (the layer zeroes padded positions' inputs, so a left-padded prompt's state starts at
its first real token, as `generate` computes it) and None for a decoded token.

Supported: models whose every layer is full softmax attention or linear attention (dense, no
experts), `sdpa` or `eager` attention (`static_decode_problem` says why not; the recipe then
uses `generate`).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import StaticCache

from megatrain.recipes.grpo.decode_support import decode_attention
from megatrain.recipes.grpo.rollout import Rollout, left_pad, sampling_logps, to_rollout

STOP_CHECK_STEPS = 16  # tokens between the syncs that ask whether every sequence has finished
MIN_GRAPH_STEPS = 4  # fewer decoding steps than this run eagerly (a capture would not pay)


@functools.cache
def _cache_keyword(forward: Any) -> str:
    """The model forward's name for the KV cache: `cache` (transformers >= 5.2x) or
    `past_key_values` (earlier 5.x); an unknown keyword would be swallowed by **kwargs and the
    cache silently not used."""
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _forward(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict[str, torch.Tensor | None],
    position_ids: torch.Tensor,
    cache: StaticCache,
    cache_keyword: str,
) -> torch.Tensor:
    """One decoding forward: the logits of each sequence's newest token."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{cache_keyword: cache},
        use_cache=True,
    ).logits


@functools.cache
def compiled_forward() -> Callable[..., torch.Tensor]:
    """The process's one torch.compile of `_forward`: its compiled code serves every model
    object of the same shapes (static shapes: a new shape compiles once more)."""
    return torch.compile(_forward, dynamic=False)


def pick_tokens(
    logits_NV: torch.Tensor,
    *,
    eos_bias_V: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_p: float,
) -> torch.Tensor:
    """The next token of each row: `generate`'s processors and sampling, without host syncs.

    `eos_bias_V` is 0, or -inf at the end-of-sequence tokens while they are suppressed. Top-p
    keeps the smallest set of tokens whose probability reaches top_p (the most likely always),
    exactly as transformers' TopPLogitsWarper.
    """
    scores = logits_NV.float() + eos_bias_V
    if not do_sample:
        return scores.argmax(-1)
    scores = scores / temperature
    if top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1].fill_(False)  # a scalar fill: no tensor made from host data mid-graph
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    probs = scores.softmax(-1)
    race = torch.empty_like(probs).exponential_(1)  # argmax(p / E): one multinomial draw
    return (probs / race).argmax(-1)


class _Decoder:
    """The static buffers of one generation batch and the two passes that update them.

    Invariant between steps: `tokens` holds each sequence's newest token, at position
    `positions` and cache slot `slot`; `out[:, :col]` are the tokens picked so far.
    """

    def __init__(
        self,
        model: Any,
        prompts: list[list[int]],
        *,
        cache_len: int,
        max_new_tokens: int,
        pad_token_id: int,
        eos_token_ids: list[int],
        sampling: dict[str, Any],
        compile_forward: bool = False,
        logprobs: bool = False,
    ) -> None:
        self.model, self.sampling, self.pad = model, sampling, pad_token_id
        self.forward = compiled_forward() if compile_forward else _forward
        device = next(model.parameters()).device
        ids, valid = left_pad(prompts, pad_token_id)
        self.width = width = ids.shape[1]
        if width + max_new_tokens > cache_len:
            raise ValueError(
                f"prompts of {width} tokens + {max_new_tokens} completion tokens exceed the "
                f"static KV cache of {cache_len} tokens; raise grpo.max_prompt_length or lower "
                "grpo.max_completion_length"
            )
        n = len(prompts)
        self.ids, self.valid = ids.to(device), valid.to(device).bool()
        self.cache_len = cache_len
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        self.cache_keyword = _cache_keyword(type(model).forward)
        key_valid = torch.zeros(n, cache_len, dtype=torch.bool, device=device)
        key_valid[:, :width] = self.valid
        self.mask_N11L = key_valid[:, None, None, :].clone()  # True attends (SDPA's boolean mask)
        text = model.config.get_text_config(decoder=True)
        self.hybrid = "linear_attention" in (getattr(text, "layer_types", None) or ())
        vocab = text.vocab_size
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
        self.eos_bias_V = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.tokens = torch.full((n, 1), pad_token_id, dtype=torch.long, device=device)
        self.positions = valid.sum(-1, keepdim=True).to(device)  # each prompt's length
        self.slot = torch.tensor([width], dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.out = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.finished = torch.zeros(n, dtype=torch.bool, device=device)
        self.logps = (  # the picked tokens' log-probs (Rollout.logps), when asked for
            torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
            if logprobs
            else None
        )

    def suppress_eos(self, on: bool) -> None:
        self.eos_bias_V.zero_()
        if on:
            self.eos_bias_V.index_fill_(0, self.eos, -float("inf"))

    def prefill(self) -> None:
        """All prompts in one eager forward; picks each sequence's first token."""
        w = self.width
        causal = torch.ones(w, w, dtype=torch.bool, device=self.ids.device).tril()
        allowed = causal[None] & self.valid[:, None, :]
        allowed |= torch.eye(w, dtype=torch.bool, device=self.ids.device)  # padding sees itself
        full = torch.zeros(
            (len(allowed), 1, w, self.cache_len), dtype=torch.bool, device=allowed.device
        )
        full[:, 0, :, :w] = allowed
        positions = (self.valid.long().cumsum(-1) - 1).masked_fill(~self.valid, 1)
        logits = self.model(
            input_ids=self.ids,
            attention_mask=self._masks(full, self.valid),
            position_ids=positions,
            **{self.cache_keyword: self.cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits
        self._advance(logits[:, -1])

    def step(self) -> None:
        """One decoding step; touches only this object's buffers and the cache (capturable)."""
        self.mask_N11L.index_fill_(3, self.slot, True)
        logits = self.forward(
            self.model,
            self.tokens,
            self._masks(self.mask_N11L, None),
            self.positions,
            self.cache,
            self.cache_keyword,
        )
        self._advance(logits[:, -1])
        self.slot += 1
        self.positions += 1

    def _masks(
        self, full: torch.Tensor, padding: torch.Tensor | None
    ) -> torch.Tensor | dict[str, torch.Tensor | None]:
        """The forward's attention_mask: the 4D mask of the full-attention layers; a hybrid
        model takes one mask per layer type (transformers' per-type mapping), its linear-
        attention layers the prompts' 2D padding mask (they zero padded positions' inputs, so
        the recurrent state starts from the first real token) or None (a decoded token is
        never padding)."""
        if not self.hybrid:
            return full
        return {"full_attention": full, "linear_attention": padding}

    def _advance(self, logits_NV: torch.Tensor) -> None:
        picked = pick_tokens(logits_NV, eos_bias_V=self.eos_bias_V, **self.sampling)
        picked = torch.where(self.finished, self.pad, picked)
        self.out.index_copy_(1, self.col, picked[:, None])
        if self.logps is not None:
            logps_NV = sampling_logps(logits_NV, self.sampling["temperature"])
            picked_logp = logps_NV.gather(1, picked[:, None])
            self.logps.index_copy_(1, self.col, picked_logp)
        self.finished |= (picked[:, None] == self.eos[None, :]).any(-1)
        self.tokens.copy_(picked[:, None])
        self.col += 1

    def all_finished(self) -> bool:
        return bool(self.finished.all())  # sync point: every STOP_CHECK_STEPS tokens


def static_generate(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_ids: list[int],
    do_sample: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    min_new_tokens: int = 0,
    cache_len: int | None = None,
    cuda_graph: bool | None = None,
    compile_forward: bool = False,
    logprobs: bool = False,
) -> Rollout:
    """`rollout.generate`'s completions from the static-cache path (module docstring).

    `cache_len`: tokens per sequence in the KV cache (None: the longest prompt +
    max_new_tokens); `cuda_graph`: replay the step as a CUDA graph (None: on CUDA);
    `compile_forward`: the step's forward through `compiled_forward` (torch.compile);
    `logprobs`: the picked tokens' log-probs too (Rollout.logps), recorded inside the step.
    """
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    dec = _Decoder(
        model,
        prompts,
        cache_len=cache_len or width + max_new_tokens,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_ids=eos_token_ids,
        sampling={"do_sample": do_sample, "temperature": temperature, "top_p": top_p},
        compile_forward=compile_forward,
        logprobs=logprobs,
    )
    graphed = device.type == "cuda" if cuda_graph is None else cuda_graph
    graphed = graphed and max_new_tokens - 1 >= MIN_GRAPH_STEPS
    devices = [device] if device.type == "cuda" else []
    with decode_attention(model), torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        dec.suppress_eos(min_new_tokens > 0)
        dec.prefill()  # token 0
        graph, first = None, 1
        if graphed:
            if min_new_tokens == 1:
                dec.suppress_eos(False)
            graph, first = _warm_up_and_capture(dec), 2  # token 1 eagerly, then the capture
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # sync point: prefill and capture timed apart
        t1 = time.perf_counter()
        steps = 0
        for t in range(first, max_new_tokens):
            if t == min_new_tokens:
                dec.suppress_eos(False)
            if graph is not None:
                graph.replay()
            else:
                dec.step()
            steps += 1
            if t % STOP_CHECK_STEPS == 0 and dec.all_finished():
                break
        rows = dec.out.cpu().tolist()  # sync point: the completions to the host
        logps = dec.logps.cpu().tolist() if dec.logps is not None else None
        del graph
    if graphed:  # each batch's side stream got a cuBLAS workspace (32 MiB on Hopper), kept
        torch._C._cuda_clearCublasWorkspaces()  # by torch until cleared: one more per batch
    rollout = to_rollout(rows, eos_token_ids, max_new_tokens, logps)
    rollout.prefill_s, rollout.decode_s = t1 - t0, time.perf_counter() - t1
    rollout.decode_steps = steps
    return rollout


def _warm_up_and_capture(dec: _Decoder) -> torch.cuda.CUDAGraph:
    """Run one real step eagerly on a side stream (cuBLAS and the allocator warm up there),
    then capture the next step's kernels without running them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dec.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: the optimizer's worker thread (idle: every block waited for) cannot spoil it
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            dec.step()
    except RuntimeError as e:
        raise RuntimeError(
            f"capturing the decoding step as a CUDA graph failed ({e}); this model's forward "
            "does something a graph cannot hold (a host sync or a data-dependent shape): set "
            "grpo.compile_decode: false to decode with transformers' generate"
        ) from e
    return graph
