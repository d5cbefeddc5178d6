"""Transient GPU memory of one layer's recompute + backward, and of one loss chunk, measured
on the meta device.

Why measure instead of a formula: what a layer keeps for its backward depends on the
architecture (gated MLPs keep three [tokens x intermediate] tensors, MoE layers keep routed
copies of the tokens per expert, linear-attention layers keep chunked states, RMSNorm keeps an
fp32 copy of its input, eager attention keeps [heads x seq x seq] scores). Running the real HF
layer on meta tensors (shapes and dtypes, no data, no FLOPs) under a dispatch mode that tracks
the bytes of every live storage gives the peak for any architecture, with the engine's own call
path (`LayerCall.run` + `torch.autograd.grad` over the input and the parameters), but not the
layer's (the head's) parameters, whose views reach its ops: the weight slots (the head's
weights) hold them (docs/performance.md run 44 compares the plans with the measured peaks).

The layer's call arguments (masks, rotary cos/sin) come from the engine's `LayerCallCapture`
run for real on the CPU (the HF mask code is data-dependent, it cannot run on meta) at a small
batch (`_CAPTURE_ROWS` rows, at most `_CAPTURE_SEQ` positions), then every dimension equal to
the captured sequence length becomes the real one, and a leading dimension equal to the
captured rows becomes the real micro-batch size. The same tensors give the per-micro-batch
bytes of the captured arguments, which the engine keeps for the whole step.

Both measurements also report the largest single storage created (`largest_bytes`): the size
the CUDA caching allocator's slack at the peak follows (planning/allocator_slack.py).

What the GPU runs differently from meta tensors, and is substituted here:
- `F.scaled_dot_product_attention` picks a fused kernel on CUDA (flash without a mask, memory
  efficient with one); on meta it would fall back to the math path, which materializes the
  [B, H, S, S] scores. It is routed to the flash / efficient aten ops, which keep O(tokens),
  except where CUDA itself runs the math path (meta_kernels.py).
- optional kernel packages a layer calls (flash-linear-attention, causal-conv1d) cannot run on
  meta: the layer runs their torch reference code in their place (model/kernels.py). Where the
  run calls the package (`FusedCalls.wrap`, planning/fused.py), the call counts for time as
  the package's fused kernels, a few launches moving its inputs and outputs (the reference's
  ops and traffic, forward and its autograd nodes in the backward, are left out), and for
  memory as the package's own buffers where planning/kernel_memory.py models the call (fla's
  `chunk_gated_delta_rule`: what its autograd Function makes, keeps and frees), else as the
  reference's, an upper bound. The Qwen3.5-27B shape at 4 x 2048 tokens: a Gated DeltaNet
  layer's recompute + backward 3.99 GiB with fla's buffers, 6.70 as the reference; with it the
  plan of docs/performance.md run 43's 64-layer row peaks at 61.72 GiB allocated (its loss)
  against 61.17 measured less the head gradient that run's engine held over
  (tests/planning/test_fla_memory_rows.py). A refused package's reference, which the run does
  run, counts in full, time and memory.
- grouped_mm (MoE experts) has a bf16-only meta kernel; fp32 runs transformers' loop fallback
  on the GPU, whose backward reads the expert offsets on the host in some transformers releases
  (5.17), impossible on meta: `MetaGroupedMM` (meta_kernels.py) stands in with the
  fallback's memory (the output; for backward, the saved input and weight and gradients like
  both).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from megatrain.engine.attention_heads import head_calls
from megatrain.engine.head import LogitsFn
from megatrain.engine.tiling import TilePolicy, tiled_per_token
from megatrain.layouts import LAYOUTS
from megatrain.model.capture import CapturedCalls, LayerCall, LayerCallCapture
from megatrain.model.kernels import reference_kernels
from megatrain.planning.fused import FusedCalls
from megatrain.planning.meta_kernels import ATTENTION_BACKWARD, GROUPED_MM, GpuKernels, is_float
from megatrain.planning.spec import FLEX_SINKS, ModelSpec
from megatrain.planning.traffic import on_scores, op_traffic

_CAPTURE_ROWS = 2
_CAPTURE_SEQ = 8192


class _LiveBytes(TorchDispatchMode):
    """Peak of the bytes held by storages created inside the mode (meta tensors included), the
    largest of those storages, and the most held right after a fused attention backward (its
    inputs and gradients live): the kernel's workspace comes on top of that moment, not of the
    layer's peak. Also the time counts: kernels launched and bytes they move, a kernel
    package's call (`fused.wrap`) counted as its fused kernels (its memory, tracked here, the
    package's where planning/kernel_memory.py models it)."""

    def __init__(self, seq: int = 0) -> None:
        super().__init__()
        self.seq = seq  # the row length whose [S, S] attention scores are told apart (0: none)
        self.live = 0
        self.peak = 0
        self.largest = 0  # bytes of the largest storage created inside the mode
        self.attention_backward = 0
        self.fused = FusedCalls()  # package calls counted as their fused kernels (fused.py)
        self._dispatched = 0  # aten ops counted for time
        self._moved = 0  # bytes those ops read and write (planning/traffic.py)
        self.scores = 0  # of which ops on [S, S] attention scores (traffic.on_scores)
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @property
    def ops(self) -> int:
        """Kernels the GPU would launch: the aten ops dispatched, a fused package call's own."""
        return self._dispatched + self.fused.launches

    @property
    def traffic(self) -> int:
        """Bytes those kernels read and write."""
        return self._moved + self.fused.traffic

    def exclude(self, *tensors: torch.Tensor) -> None:
        """Storages made outside the mode that its views must not count (held elsewhere): a
        view returns its base's storage, and a layer's weights reach its ops as views (`t()`
        in a linear, an expert's slice), which would count them once more."""
        for t in tensors:
            self._seen[t.untyped_storage()] = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        timed = self.fused.counts()
        self._dispatched += int(timed)
        if func.overloadpacket is GROUPED_MM and args[0].dtype != torch.bfloat16:
            # fp32 experts on meta: the meta kernel takes bf16 only; shapes are the same. Here,
            # at the dispatch level, also where a backward re-runs a layer's tiles.
            dtype = args[0].dtype
            args = tree_map(lambda t: t.bfloat16() if is_float(t) else t, args)
            out = tree_map(
                lambda t: t.to(dtype) if is_float(t) else t, func(*args, **(kwargs or {}))
            )
        else:
            out = func(*args, **(kwargs or {}))
        tree_map(self._track, out)
        if timed:
            moved = op_traffic(func, args, kwargs, out)
            self._moved += moved
            if moved and self.seq and on_scores(args, kwargs, out, self.seq):
                self.scores += moved
        if func.overloadpacket in ATTENTION_BACKWARD:
            self.attention_backward = max(self.attention_backward, self.live)
        return out

    def _track(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage not in self._seen:
                nbytes = storage.nbytes()
                self._seen[storage] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, nbytes)
                weakref.finalize(storage, self._free, nbytes)
        return t

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


@dataclass(frozen=True)
class LayerProfile:
    """One micro-batch of `rows` x `seq` tokens through the decoder layers."""

    peak_bytes: int  # transient of one layer's recompute + backward, max over layer groups
    captured_bytes: int  # the micro-batch's captured call arguments (masks, rotary tables)
    ops: list[tuple[int, int]]  # per layer: aten ops of its forward, of recompute + backward
    workspace_bytes: int = 0  # the fused attention backward's block (attention_workspace)
    # the transient while that block exists: what the layer holds right after its attention
    # backward, plus the block (max over layer groups); 0: no fused attention
    attention_peak_bytes: int = 0
    # per layer: bytes its ops move through GPU memory, forward and recompute + backward
    traffic: tuple[tuple[int, int], ...] = ()
    # the largest single tensor of one layer's recompute + backward, max over layer groups
    largest_bytes: int = 0
    # per layer: whether a kernel package's call in it was counted as its fused kernels
    fused: tuple[bool, ...] = ()
    # per layer: of `traffic`, the bytes of ops on eager attention's [S, S] scores (forward,
    # recompute + backward; traffic.on_scores)
    score_traffic: tuple[tuple[int, int], ...] = ()
    causal_only: tuple[bool, ...] = ()  # per layer: attention called causal, no mask (flash's)

    @property
    def workspace_extra_bytes(self) -> int:
        """What the attention backward's block adds beyond the layer's peak: nothing when the
        layer peaks elsewhere (before its attention backward, in the MLP's, say)."""
        return max(0, self.attention_peak_bytes - self.peak_bytes)


def layer_profile(
    spec: ModelSpec,
    rows: int,
    seq: int,
    layout: str,
    mlp_tiles: int = 1,
    split_heads: bool = True,
    untiled: frozenset[int] = frozenset(),
) -> LayerProfile:
    """Measure (once per shape, layout and tiling) every layer group's recompute + backward
    on meta; with `mlp_tiles` > 1 the MLPs run tiled as the engine runs them (engine/tiling.py),
    except in the `untiled` layers, with `split_heads` the attention in head groups
    (engine/attention_heads.py)."""
    key = ("layer", rows, seq, layout, mlp_tiles, split_heads, untiled)
    if key not in spec.cache:
        captured, seq0, rows0 = _capture(spec, seq, layout)
        shapes = _Rescale(seq0, seq, rows0, rows)
        calls = [
            LayerCall(
                tree_map(shapes.meta, c.args), tree_map(shapes.meta, c.kwargs), c.hidden_as_kwarg
            )
            for c in captured.calls
        ]
        workspace = attention_workspace(spec, rows, seq, split_heads)
        peak, attention_peak, largest, ops = 0, 0, 0, [(0, 0)] * spec.num_layers
        traffic, fused = [(0, 0)] * spec.num_layers, [False] * spec.num_layers
        scores, causal = [(0, 0)] * spec.num_layers, [False] * spec.num_layers
        for group in spec.structure.groups:
            first = group.layer_indices[0]
            layer = spec.structure.layers[first]
            skip = {0} if first in untiled else None
            with tiled_per_token([layer], TilePolicy(mlp_tiles), split_heads, skip):
                m = _measure(spec, calls[first], layer, rows, seq)
            peak, largest = max(peak, m.peak), max(largest, m.largest)
            if m.attention:
                attention_peak = max(attention_peak, m.attention + workspace)
            for i in group.layer_indices:
                ops[i], traffic[i], fused[i], scores[i] = m.ops, m.traffic, m.fused, m.scores
                causal[i] = m.causal_only
        spec.cache[key] = LayerProfile(
            peak,
            shapes.bytes_of(captured.calls),
            ops,
            workspace,
            attention_peak,
            tuple(traffic),
            largest,
            tuple(fused),
            tuple(scores),
            tuple(causal),
        )
    profile: LayerProfile = spec.cache[key]
    return profile


def attention_workspace(spec: ModelSpec, rows: int, seq: int, split_heads: bool) -> int:
    """Bytes the fused attention backward (cuDNN / flash) allocates beyond its outputs, which
    the meta measurement (`layer_profile`) does not see, for one micro-batch of `rows` x `seq`:
    per query head of one call (`split_heads`: the head groups of engine/attention_heads.py,
    else all heads) and token, an fp32 query-gradient accumulator, one fp32 softmax statistic
    and, with grouped-query attention, bf16 key and value gradients expanded to that head.
    Calibrated on one observation: on the H100 the Llama-3.1-8B shape's backward at 524,288
    tokens (32 query / 8 key-value heads of 128, one call) asked for one 16.06 GiB block:
    32 x (128 x 4 + 4 + 2 x 128 x 2) = 32,896 bytes a token. Attention sinks hand the kernel
    keys already expanded to the query heads (model/sink_attention.py), whose gradients the
    profile sees."""
    peak = 0
    for la in spec.layers:
        if not la.attn_heads:
            continue
        heads = la.attn_heads
        if split_heads:
            heads //= head_calls(la.attn_heads, la.attn_kv_heads, seq)
        sinks = la.attn_implementation in ("sinks", FLEX_SINKS)  # planned on the sdpa path
        grouped = la.attn_kv_heads != la.attn_heads and not sinks
        per_head = la.attn_qk_dim * 4 + 4 + (2 * (la.attn_qk_dim + la.attn_v_dim) if grouped else 0)
        peak = max(peak, rows * seq * heads * per_head)
    return peak


class LossChunk(NamedTuple):
    """One fused loss chunk (engine/head.py), forward and backward, parameter gradients
    included."""

    peak_bytes: int  # transient
    ops: int  # aten ops
    largest_bytes: int  # its largest single tensor


def loss_chunk(spec: ModelSpec, chunk_tokens: int) -> LossChunk:
    """One loss chunk of `chunk_tokens` measured on meta (cached on the spec)."""
    key = ("loss", chunk_tokens)
    if key not in spec.cache:
        st, dtype = spec.structure, spec.compute_dtype
        params = [p for m in (st.final_norm, st.lm_head) for p in m.parameters()]
        logits = LogitsFn(st, st.lm_head)
        tracker = _LiveBytes()
        tracker.exclude(*params)  # held by the head's weights
        with torch.enable_grad(), tracker:
            h = torch.empty(chunk_tokens, spec.hidden_size, dtype=dtype, device="meta")
            h.requires_grad_(True)
            targets = torch.zeros(chunk_tokens, dtype=torch.long, device="meta")
            loss = F.cross_entropy(logits(st.final_norm(h)).float(), targets, reduction="sum")
            grads = torch.autograd.grad(loss, [h, *params], allow_unused=True)
            del loss, grads
        spec.cache[key] = LossChunk(tracker.peak, tracker.ops, tracker.largest)
    result: LossChunk = spec.cache[key]
    return result


@dataclass(frozen=True)
class _Measured:
    peak: int
    attention: int  # held right after the attention backward
    ops: tuple[int, int]  # forward ops, all ops
    traffic: tuple[int, int]  # forward traffic, all traffic
    largest: int  # the largest single storage
    fused: bool  # a kernel package's call counted as its fused kernels
    scores: tuple[int, int]  # of the traffic, on [S, S] attention scores: forward, all
    causal_only: bool  # attention called causal with no mask only (GpuKernels.causal_only)


def _measure(
    spec: ModelSpec, call: LayerCall, layer: torch.nn.Module, rows: int, seq: int
) -> _Measured:
    """One layer's recompute + backward on meta (the tracker's figures)."""
    params = list(layer.parameters())
    x = torch.empty(
        rows, seq, spec.hidden_size, dtype=spec.compute_dtype, device="meta", requires_grad=True
    )
    grad_out = torch.empty_like(x)
    tracker = _LiveBytes(seq)
    # the layer input and mb.grad: counted by the caller; the weights: held by the weight slots
    tracker.exclude(x, grad_out, *params, *layer.buffers())
    kernels = GpuKernels()
    with torch.enable_grad(), reference_kernels(layer, tracker.fused.wrap), kernels, tracker:
        out = call.run(layer, x)
        forward_ops, forward_traffic, forward_scores = tracker.ops, tracker.traffic, tracker.scores
        grads = torch.autograd.grad([out], [x, *params], [grad_out], allow_unused=True)
        del out, grads
    return _Measured(
        tracker.peak,
        tracker.attention_backward,
        (forward_ops, tracker.ops),
        (forward_traffic, tracker.traffic),
        tracker.largest,
        tracker.fused.launches > 0,
        (forward_scores, tracker.scores),
        kernels.causal_only,
    )


def _capture(spec: ModelSpec, seq: int, layout: str) -> tuple[CapturedCalls, int, int]:
    """The layers' call arguments for a small real batch with `layout`, on the CPU."""
    key = ("capture", min(seq, _CAPTURE_SEQ), layout)
    if key not in spec.cache:
        spec.cache[key] = _run_capture(spec, seq, layout)
    result: tuple[CapturedCalls, int, int] = spec.cache[key]
    return result


def _run_capture(spec: ModelSpec, seq: int, layout: str) -> tuple[CapturedCalls, int, int]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    seq0 = min(seq, _CAPTURE_SEQ)
    rows0 = _CAPTURE_ROWS if seq0 != _CAPTURE_ROWS else _CAPTURE_ROWS + 1
    embeds = torch.zeros(1, 1, spec.hidden_size, dtype=spec.compute_dtype)
    mask = positions = None
    if layout == "padded":  # the last row is shorter: HF builds a 4-D padding mask
        mask = torch.ones(rows0, seq0, dtype=torch.long)
        mask[-1, seq0 - max(1, seq0 // 4) :] = 0
    elif layout == "packed":  # two samples per row: position ids restart mid-row
        half = seq0 // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq0 - half)]).expand(rows0, -1)
    ids = torch.zeros(rows0, seq0, dtype=torch.long)  # a VLM's: text rows (images: front)
    captured = LayerCallCapture(spec.structure).capture(
        embeds.expand(rows0, seq0, -1), mask, positions, input_ids=ids
    )
    return captured, seq0, rows0


class _Rescale:
    """Captured tensor shapes at (rows0, seq0) -> the same tensors at (rows, seq)."""

    def __init__(self, seq0: int, seq: int, rows0: int, rows: int) -> None:
        self.seq0, self.seq, self.rows0, self.rows = seq0, seq, rows0, rows

    def shape(self, t: torch.Tensor) -> list[int]:
        dims = list(t.shape)
        has_seq = self.seq0 in dims[1:]
        for i, d in enumerate(dims):
            if d == self.seq0:
                dims[i] = self.seq
            elif i == 0 and d == self.rows0 and has_seq:
                dims[i] = self.rows
        return dims

    def meta(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.empty(self.shape(x), dtype=x.dtype, device="meta")

    def bytes_of(self, calls: list[LayerCall]) -> int:
        """Bytes of the distinct storages behind the calls' tensors, at the new shape."""
        sizes: dict[int, int] = {}

        def visit(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                scaled = 1
                for d in self.shape(t):
                    scaled *= d
                nbytes = t.untyped_storage().nbytes() * scaled // t.numel()
                ptr = t.untyped_storage().data_ptr()
                sizes[ptr] = max(sizes.get(ptr, 0), nbytes)
            return t

        for call in calls:
            tree_map(visit, (call.args, call.kwargs))
        return sum(sizes.values())
