"""torchrun entry of tests/distributed/test_distributed_ranks.py: `python -m megatrain ARGS`
with one error planted on rank 1, in step 2's backward of decoder layer 1 (the last layers'
gradients already reduce-scattered and shipped; rank 0 waits for rank 1 in layer 1's
reduce-scatter): out of GPU memory, with PLANT=triton a kernel launch's out-of-memory error
(outside PyTorch's allocator; PLANT=triton2: in the step's rerun too), or with PLANT=error
a ValueError of that rank's own."""

from __future__ import annotations

import os
import sys

import torch

from megatrain.cli import main
from megatrain.engine.engine import StreamingEngine

OOM = "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 1 has a total capacity of 79.19 GiB"


def plant(step: int, layer: int) -> None:
    real = StreamingEngine._backward_layer
    times = 2 if os.environ.get("PLANT") == "triton2" else 1  # the step and its rerun
    seen = {"backwards": 0, "raised": 0}

    def backward_layer(self, i, *args, **kwargs):  # type: ignore[no-untyped-def]
        if i == 0:
            seen["backwards"] += 1
        if seen["raised"] < times and i == layer and seen["backwards"] == step - 1:
            seen["raised"] += 1
            if os.environ.get("PLANT") == "error":
                raise ValueError("planted: a bad value on rank 1")
            if os.environ.get("PLANT", "").startswith("triton"):
                raise RuntimeError("Triton Error [CUDA]: out of memory")
            raise torch.OutOfMemoryError(OOM)
        return real(self, i, *args, **kwargs)

    StreamingEngine._backward_layer = backward_layer  # type: ignore[method-assign]


if os.environ.get("RANK") == "1":
    plant(step=2, layer=1)
sys.exit(main(sys.argv[1:]))
