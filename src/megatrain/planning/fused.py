"""An optional kernel package's call on meta (planning/activations.py), counted for time as
the package's fused kernels, and for memory as the package's own buffers where modelled.

The layer profile runs a package function's torch reference in its place (model/kernels.py
`reference_kernels`): wrong for time, where the GPU runs the package's few fused kernels
instead of the reference's many small ops (transformers' `torch_chunk_gated_delta_rule`:
thousands of them over 64-token chunks, 224 GB of traffic a forward + backward at 4 x 2048
tokens of the Qwen3.5-27B shape), and above the package for memory. `FusedCalls.wrap` wraps
the reference, and runs in its place the package's memory model where planning/kernel_memory.py
has one (fla's `chunk_gated_delta_rule`: the tensors fla's autograd Function makes, keeps and
frees), else the reference itself (an upper bound). The ops the call's forward dispatches, and
in the backward those of the autograd nodes it created, are not counted for time; the call
counts instead as FUSED_LAUNCHES kernels that move its tensor inputs and outputs once in the
forward, FUSED_BACKWARD_TRAFFIC times over in the backward: the same count, model or reference.

Invariant: memory is tracked for every op, counted for time or not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from megatrain.planning.kernel_memory import run_as_package

FUSED_LAUNCHES = (9, 14)
"""Kernels one fused package call launches, (forward, backward): flash-linear-attention's
`chunk_gated_delta_rule` (fla/ops/gated_delta_rule/chunk.py, read at fla-org's commit
bc3b101d; the query-key l2 norm in the kernel, as Qwen3.5 calls it). Forward: the two l2
norms, the gate's chunk cumsum, the zeroed A, the fused kkt + solve, recompute_w_u, the state
pass, the output, its cast: 9. Backward: recompute_w_u, the state pass again, dv_local, dhu,
dqkwg, the WY backward, two adds, the reverse cumsum, two l2 norm backwards, the gradients'
casts: about 14. Used for every package call (causal-conv1d's convolution launches fewer: a
few launches either way)."""
FUSED_BACKWARD_TRAFFIC = 2.0
"""A fused call's backward traffic against its forward's (the bytes of its tensor inputs and
outputs): the inputs read again, the output gradients read, the input gradients written."""
_MARK = "megatrain_fused"  # key of an autograd node's metadata: the fused call that made it


@dataclass
class _Backward:
    """One fused call's backward, counted when the first of its autograd nodes runs."""

    launches: int
    traffic: int
    counted: bool = False


class FusedCalls:
    """The fused package calls of one tracked run: their launches and traffic, and whether the
    op being dispatched belongs to one (then the tracker does not count it for time)."""

    def __init__(self) -> None:
        self.launches = 0
        self.traffic = 0
        self._depth = 0  # > 0: inside a fused call's forward

    def wrap(self, reference: Callable[..., Any]) -> Callable[..., Any]:
        """`reference`, counted as the package's fused call, its memory the package's where
        modelled (the module docstring)."""
        run = run_as_package(reference)

        @functools.wraps(reference)
        def call(*args: Any, **kwargs: Any) -> Any:
            first = torch._C._autograd._get_sequence_nr()
            self._depth += 1
            try:
                out = run(*args, **kwargs)
            finally:
                self._depth -= 1
            made = range(first, torch._C._autograd._get_sequence_nr())
            outputs = _tensors(out)
            moved = sum(_nbytes(t) for t in (*_tensors((args, kwargs)), *outputs))
            self.launches += FUSED_LAUNCHES[0]
            self.traffic += moved
            backward = _Backward(FUSED_LAUNCHES[1], int(FUSED_BACKWARD_TRAFFIC * moved))
            _mark((t.grad_fn for t in outputs), made, backward)
            return out

        return call

    def counts(self) -> bool:
        """Whether the op now dispatched is counted for time: not inside a fused call's forward,
        nor run by one of its autograd nodes (whose first op counts the call's backward)."""
        if self._depth:
            return False
        node: Any = torch._C._current_autograd_node()  # the stubs' Node: metadata a method
        backward = node.metadata.get(_MARK) if node is not None else None
        if backward is None:
            return True
        if not backward.counted:
            backward.counted = True
            self.launches += backward.launches
            self.traffic += backward.traffic
        return False


def _mark(roots: Iterable[Any], made: range, backward: _Backward) -> None:
    """Tag the autograd nodes reachable from `roots` that were created inside the call
    (sequence numbers in `made`: the graph before the call, leaves included, stays untagged)."""
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node is None or node._sequence_nr() not in made or _MARK in node.metadata:
            continue
        node.metadata[_MARK] = backward
        stack.extend(parent for parent, _ in node.next_functions)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
