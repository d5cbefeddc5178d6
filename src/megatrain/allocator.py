"""PyTorch's CUDA caching allocator as every megatrain process starts it: expandable segments.

The memory plan packs the GPU to within `memory.gpu_margin_gib` of its capacity. With the
allocator's default fixed-size segments, memory freed by one phase of a step is held in segments
too small or too split for the next phase's tensors: runs planned at 76 of 79 GiB died of out of
memory in step 2 or 3 with 3.9-5.3 GiB "reserved by PyTorch but unallocated" (Llama-3.1-8B shape
at 64k tokens per step; one 512k-token row), and a GRPO step found 4.4 GiB unusable after its
rollout. Expandable segments map memory into one growing range per stream, so what is freed is
usable at any size; what stays reserved beyond the allocated bytes at the peak (about one block
of the peak phase's largest tensor) the plan counts as its own item (planning/allocator_slack.py).

Invariant: the user's own setting wins (`PYTORCH_CUDA_ALLOC_CONF` or `PYTORCH_ALLOC_CONF` in the
environment is never changed). Called once per process by the CLI before anything touches CUDA
(every command, every torchrun rank), and by harnesses that build runs without the CLI. This
module imports no torch, so the CLI stays quick to start.
"""

from __future__ import annotations

import os
import sys

ALLOC_CONF = "expandable_segments:True"
USER_KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def configure_allocator() -> bool:
    """Expandable segments unless the user configured the allocator; True if this set them.

    The environment is read when CUDA starts, so before that the variable is set (and child
    processes inherit it); if this process already started CUDA, the running allocator is
    reconfigured instead.
    """
    if any(key in os.environ for key in USER_KEYS):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(ALLOC_CONF)
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return True
