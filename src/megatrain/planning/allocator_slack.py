"""The CUDA caching allocator's slack: what it keeps reserved beyond what is allocated.

What the card must hold is `torch.cuda.max_memory_reserved`, not `max_memory_allocated`, which
the rest of the GPU estimate predicts (planning/estimate.py `gpu_memory`). Under expandable
segments (src/megatrain/allocator.py) a block freed between live ones stays mapped, and a
request larger than any such hole maps new pages at the segment's end: within a phase whose
tensors come and go, about one freed block of the phase's largest transient tensor is stranded
when the phase peaks. The rule: a phase's slack is the largest single tensor it allocates and
frees (`largest_transient_bytes`), 0 off CUDA (no caching allocator there). The layer
backward's is the largest tensor of one layer's recompute + backward measured on meta, or the
fused attention backward's block where larger (planning/activations.py `largest_bytes`,
`attention_workspace`); the loss's the largest of one loss chunk on meta; the embedding
backward's the larger of one micro-batch's hidden gradient and the bf16 table staging; the
vision backward's (the tower's own tensors not measured, tens of MiB at run 38's shape) the
layer backward's, which it follows.

Checked against the H100 rows of docs/performance.md runs 35 and 38 (GiB; the slack measured is
the reserved peak less the allocated peak), each at the phase its plan peaks in, with that
phase's largest tensor; the planned peak is then within 3.1% of every measured reserved peak:

| row (peak phase) | largest tensor: planned slack | measured | reserved planned (measured) |
|---|---|---|---|
| Llama-3.1-8B, 64k, compiled (loss) | 0.98 (a chunk's head gradient) | 0.84 | 77.17 (76.63) |
| Llama-3.1-8B, 128k, compiled (loss) | 0.98 (the same) | 0.83 | 75.89 (74.88) |
| Llama-3.1-8B, 2 layers, 524,288 tokens (layer) | 4.00 (a layer input) | 4.22 | 79.19 (77.84) |
| Qwen3.5-27B, 16 layers (layer) | 0.38 (attention backward's block) | 0.32 | 74.97 (73.02) |
| Qwen3-30B-A3B, 12 layers (layer) | 0.75 (the experts' weight gradient) | 0.83 | 72.29 (71.63) |
| GRPO, Qwen2.5-7B, vocabulary 512 (layer) | 0.58 (an MLP intermediate) | 0.29 | 74.31 (74.52) |
| Qwen2.5-VL-7B, tower trained, run 38 (vision) | 0.29 (the layer's MLP) | 0.35 | 75.82 (78.23) |

Since run 44 each loss chunk's parameter gradients are freed after the chunk: run 46 measured
the 64k row at 74.80 GiB allocated and 75.24 reserved, 0.44 GiB of slack where the rule gives
0.98 (the head's weight gradient; now allocated and freed at the same size in every chunk,
so likely reused rather than stranded: not checked); the planned reserved peak is 1.3% over.
One row; the rule is left as it is (it errs toward the card's side).

No constant is fitted: a flat slack cannot give 0.3 and 4.2 GiB, and the largest tensor does
(tests/planning/test_allocator_slack.py). No run has yet peaked in the embedding backward, nor
with an attention block of several GiB as the largest tensor (an untiled 128k row: 4 GiB; the
plan now tiles that row's MLPs in 2 rather than plan its reserved peak past the margin).
`memory.gpu_margin_gib` stays the user's margin on top of this reserved peak.

Rows with flash-linear-attention (its calls planned as fla's own buffers,
planning/kernel_memory.py) keep more than the rule says. fla's largest tensor, its chunk states
h and dh [B, T / 64, HV, K, V] (0.19 GiB at 4 x 2048 tokens of the Qwen3.5-27B shape), is
below the layer's MLP intermediate, so the rule's slack does not change; the Qwen3.5-27B rows
measured 3.1 GiB (64 layers, micro-batch 4: run 43) and 3.0 GiB (16 layers, micro-batch 8, 5
tier blocks) of reserved beyond allocated where the rule gives 2.37 (loss) and 0.75 (layer
backward): their reserved peaks are planned 0.19 and 0.62 GiB under the measured (66.46 against
66.65, 70.03 against 70.65), inside the default margin. Qwen3-Next (19 layers) measured 1.18 GiB,
under the rule's 2.00. Not explained yet; the torch reference's larger layer profile hid it.
"""

from __future__ import annotations

SLACK_ITEM = "allocator slack (reserved beyond allocated)"


def allocator_slack(largest_transient_bytes: int, *, cuda: bool) -> int:
    """Bytes reserved beyond allocated at the peak of a phase whose largest transient tensor
    has `largest_transient_bytes`; 0 when the device is not a CUDA GPU."""
    return largest_transient_bytes if cuda else 0
