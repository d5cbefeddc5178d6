"""The CUDA caching allocator's slack: what it keeps reserved beyond what is allocated.

What the card must hold is `torch.cuda.max_memory_reserved`, not `max_memory_allocated`, which
the rest of the GPU estimate predicts (planning/estimate.py `gpu_memory`). Under expandable
segments (src/megatrain/allocator.py) a block freed between live ones stays mapped, and a
request larger than any such hole maps new pages at the segment's end: within a phase whose
tensors come and go, about one freed block of the phase's largest transient tensor is stranded
when the phase peaks. The rule: a phase's slack is the largest single tensor it allocates and
frees (`largest_transient_bytes`: measured on meta with the layer and the loss chunk,
planning/activations.py `largest_bytes`), 0 off CUDA (no caching allocator there).

Checked against the H100 runs of docs/performance.md (reserved minus allocated peak, GiB),
each with the phase the plan predicts its peak at and that phase's largest tensor:

| run 35 row | peak phase | largest tensor (predicted slack) | measured slack |
|---|---|---|---|
| Llama-3.1-8B, 64k, compiled | loss | 0.98 (head weight gradient of a chunk) | 0.84 |
| Llama-3.1-8B, 128k, compiled | loss | 0.98 (the same) | 0.83 |
| Llama-3.1-8B, 2 layers, 524,288 tokens | layer backward | 4.00 (a layer input) | 4.22 |
| Qwen3.5-27B, 16 layers, eager | layer backward | 0.27 (an MLP intermediate) | 0.32 |
| Qwen3-30B-A3B, 12 layers | layer backward | 0.75 (the routed experts') | 0.83 |
| GRPO, Qwen2.5-7B, vocabulary 512 | layer backward | 0.32 (an MLP intermediate) | 0.29 |

No constant is fitted: a flat slack cannot give 0.3 and 4.2 GiB, and the largest tensor does
(tests/planning/test_allocator_slack.py). The phases whose largest tensor no run has checked
yet (embedding backward, vision backward) take the same rule. `memory.gpu_margin_gib` stays the
user's margin on top of this reserved peak.
"""

from __future__ import annotations

SLACK_ITEM = "allocator slack (reserved beyond allocated)"


def allocator_slack(largest_transient_bytes: int, *, cuda: bool) -> int:
    """Bytes reserved beyond allocated at the peak of a phase whose largest transient tensor
    has `largest_transient_bytes`; 0 when the device is not a CUDA GPU."""
    return largest_transient_bytes if cuda else 0
