"""torchrun entry of tests/distributed/test_distributed_ranks.py: `python -m megatrain ARGS`
with errors planted on rank 1, in decoder layer 1's backward (the last layers' gradients
already reduce-scattered and shipped; rank 0 waits for rank 1 in layer 1's reduce-scatter).
PLANT picks them: unset, out of GPU memory in step 2; `triton`, a kernel launch's out-of-memory
error (outside PyTorch's allocator) in step 2; `triton2`, in step 2 and in its rerun;
`triton2+oom3`, those two, then out of GPU memory in step 3; `error`, a ValueError of that
rank's own in step 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from megatrain.cli import main
from megatrain.engine.engine import StreamingEngine

OOM = "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 1 has a total capacity of 79.19 GiB"


def _oom() -> Exception:
    return torch.OutOfMemoryError(OOM)


def _triton() -> Exception:
    return RuntimeError("Triton Error [CUDA]: out of memory")


def _error() -> Exception:
    return ValueError("planted: a bad value on rank 1")


PLANTS: dict[str, list[tuple[int, Callable[[], Exception]]]] = {
    "": [(2, _oom)],
    "triton": [(2, _triton)],
    "triton2": [(2, _triton), (2, _triton)],
    "triton2+oom3": [(2, _triton), (2, _triton), (3, _oom)],
    "error": [(2, _error)],
}  # (step, error) raised in this order, each once


def plant(layer: int) -> None:
    real = StreamingEngine._backward_layer
    errors = list(PLANTS[os.environ.get("PLANT", "")])
    seen = {"backwards": 0}  # steps whose backward reached layer 0

    def backward_layer(self, i, *args, **kwargs):  # type: ignore[no-untyped-def]
        if i == 0:
            seen["backwards"] += 1
        if errors and i == layer and seen["backwards"] == errors[0][0] - 1:
            raise errors.pop(0)[1]()
        return real(self, i, *args, **kwargs)

    StreamingEngine._backward_layer = backward_layer  # type: ignore[method-assign]


if os.environ.get("RANK") == "1":
    plant(layer=1)
sys.exit(main(sys.argv[1:]))
