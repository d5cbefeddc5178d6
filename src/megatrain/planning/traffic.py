"""GPU memory traffic of an aten op, counted on the meta device (planning/activations.py).

An op reads its tensor arguments and writes its results; a view (select, transpose, expand,
reshape) moves nothing. Matmuls and fused attention are left out: the planner times them by
their FLOPs. The sum over a layer's other ops is what its elementwise, copy and reduction kernels
move through HBM when none is fused (eager layers): the planner's bound on a memory-bound
layer's time (planning/layer_time.py, `HBM_FRACTION`).

Eager attention (and sdpa's math path) materializes the [B, H, S, S] scores: its scale, mask,
softmax, casts (GPT-OSS: the sinks' column, the max subtracted) are such ops, 11 passes over
the scores forward and 27 in the recompute + backward for a GPT-OSS-20B layer (23.7 and 58.0
GB at 4 x 2048 tokens, of 33.4 and 87.2 GB). `on_scores` tells those ops apart: the planner
does not time them with an MoE layer's routing (planning/layer_time.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_VIEWS = frozenset({"_unsafe_view", "lift_fresh", "alias"})  # views without alias annotations
_FLOPS = frozenset(  # timed by their FLOPs (planning/layer_time.py)
    {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
    | {
        f"_scaled_dot_product_{kernel}_attention{end}"
        for kernel in ("flash", "efficient", "cudnn")
        for end in ("", "_backward")
    }
)


def op_traffic(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """Bytes `func` reads and writes: its tensor arguments and results; 0 for a view or an op
    timed by its FLOPs."""
    returns = func._schema.returns
    alias = returns[0].alias_info if returns else None
    name = func.overloadpacket.__name__
    if (alias is not None and not alias.is_write) or name in _VIEWS or name in _FLOPS:
        return 0
    tensors = tree_flatten((args, kwargs, out))[0]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def on_scores(args: Any, kwargs: Any, out: Any, seq: int) -> bool:
    """Whether an op reads or writes an attention score matrix of a `seq`-token row: a tensor
    of 4 or more dimensions ending in [S, S] ([S, S + 1] with a sinks column). Hidden states
    ([B, S, D]) have 3; heads split off ([B, H, S, d]) end in a head dimension, never S at
    the sequence lengths a step time is asked for."""
    tensors = tree_flatten((args, kwargs, out))[0]
    return any(
        isinstance(t, torch.Tensor)
        and t.dim() >= 4
        and t.shape[-2] == seq
        and t.shape[-1] in (seq, seq + 1)
        for t in tensors
    )
