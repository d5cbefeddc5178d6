"""GPU memory traffic of an aten op, counted on the meta device (planning/activations.py).

An op reads its tensor arguments and writes its results; a view (select, transpose, expand,
reshape) moves nothing. Matmuls and fused attention are left out: the planner times them by
their FLOPs. The sum over a layer's other ops is what its elementwise, copy and reduction kernels
move through HBM when none is fused (eager layers): the planner's bound on a memory-bound
layer's time (planning/layer_time.py, `HBM_FRACTION`).
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
