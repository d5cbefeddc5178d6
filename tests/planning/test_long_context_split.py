"""The 512k-token GPU peak of the Llama-3.1-8B shape on an H100 80GB, with attention's
backward over head groups (engine/attention_heads.py).

The calibration point: on the H100 (2026-11-26) 4 layers of that shape at 524,288 tokens, one
input kept every 4 layers (the plan of that run), attention in one call, ran out of memory
in the first layer backward asking for a 16.06 GiB block with 65.85 GiB allocated. The
estimate of that run must land within 5% of their sum: the meta measurement counts every
tensor the layer makes (not its input and output gradient, counted once as boundary
activations and last hidden), the workspace term that one block. With the split the block is
an eighth (one key-value group of 4 query heads per call), the norms' outputs are not kept
(engine/norm_fusion.py) and the full model fits with a 256 GiB host, and with 128 GiB by less
than half a GiB of the 2 GiB margin once the allocator's slack is counted (since run 44, when
the profile stopped counting the layer's weights a second time; before, it missed by a few
MiB). The 125 GiB host of the one-GPU machine is refused, as run 26 was.
"""

from __future__ import annotations

import pytest
from test_long_context_h100 import H100_TOTAL, _plan
from transformers import LlamaConfig

from megatrain.engine import norm_fusion, tiling
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.planning import Hardware, model_spec
from megatrain.planning.activations import attention_workspace
from megatrain.planning.hardware import GIB
from predict import predict
from shapes import LLAMA31_8B

SEQ = 524288
TILES = SEQ // 16384  # memory.mlp_tiles auto at 512k
# per token and query head: fp32 dQ (128 x 4), an fp32 statistic, bf16 dK and dV (2 x 128 x 2)
BLOCK_PER_HEAD_TOKEN = 128 * 4 + 4 + 2 * 128 * 2


def test_workspace_whole_and_split() -> None:
    spec = model_spec(LlamaConfig(**LLAMA31_8B))
    whole = attention_workspace(spec, 1, SEQ, split_heads=False)
    assert whole == SEQ * 32 * BLOCK_PER_HEAD_TOKEN
    assert round(whole / GIB, 2) == 16.06  # the block the H100 run asked for
    assert attention_workspace(spec, 1, SEQ, split_heads=True) == whole // 8


def test_the_oom_run_reconstructed(monkeypatch: pytest.MonkeyPatch) -> None:
    # that run's engine: attention in one call (as the estimate has it for compiled layers) and
    # the norms' outputs kept for their consumers (no fusion)
    monkeypatch.setattr(tiling, "fused_call", lambda *args: None)
    monkeypatch.setattr(norm_fusion, "fused_call", lambda *args: None)
    spec = model_spec(LlamaConfig(**{**LLAMA31_8B, "num_hidden_layers": 4}))
    est = predict(
        spec,
        seq_len=SEQ,
        micro_batch_size=1,
        padded=False,
        hardware=Hardware(gpu_bytes=H100_TOTAL, host_bytes=256 * GIB),
        mlp_tiles=TILES,
        boundary_plan=BoundaryPlan.make(4, every=4, on_host=1),
        compiled=True,
    )
    observed = (65.85 + 16.06) * GIB  # allocated + asked for
    # the layer peaks in its attention backward: the block comes on top of what it holds
    # there, a little less than on top of its peak elsewhere
    extra = est.gpu.items["attention backward workspace"]
    assert 0 < extra <= SEQ * 32 * BLOCK_PER_HEAD_TOKEN
    assert abs(est.gpu.allocated_bytes / observed - 1) <= 0.05  # an allocation, not reserved


def test_512k_fits_one_h100_with_256_gib() -> None:
    spec = model_spec(LlamaConfig(**LLAMA31_8B))
    hw = Hardware(gpu_bytes=H100_TOTAL, host_bytes=256 * GIB)
    plan = _plan(SEQ, 256)  # the long-row plan on this machine (test_long_context_h100.py)
    assert plan.fits, plan.problems
    b = plan.boundaries
    assert b is not None and b.every == 1 and b.count("none") == 0  # nothing recomputed
    gpu = plan.estimate.gpu
    assert gpu.peak_phase == "layer backward"
    # one head group's block (2 GiB) comes on top of what the layer holds in its attention
    # backward, which is less than the layer's peak elsewhere: it adds part of itself
    block = attention_workspace(spec, 1, SEQ, split_heads=True)
    assert block == SEQ * 4 * BLOCK_PER_HEAD_TOKEN
    assert 0 < gpu.items["attention backward workspace"] < block / 2
    # the plan keeps inputs on the GPU up to the 2 GiB margin; offloading all of them leaves
    # the layer's own peak with the 2 inputs the backward needs: over 20 GiB of the card free
    least = predict(
        spec,
        seq_len=SEQ,
        micro_batch_size=1,
        padded=False,
        hardware=hw,
        mlp_tiles=TILES,
        boundary_plan=BoundaryPlan.make(32, every=1, on_host=32),
    )
    assert least.gpu.items["boundary activations"] == 2 * SEQ * 4096 * 2
    assert least.gpu.peak_bytes <= H100_TOTAL - 20 * GIB


def test_512k_on_128_gib_fits_the_margin_by_less_than_half_a_gib() -> None:
    """The host holds 4 inputs: one kept every 4 layers, 3 recomputed, and the GPU the rest
    of the kept ones and a segment's recomputed inputs (7 x 4 GiB) beside the layer. With the
    allocator's slack (a 4 GiB layer input, planning/allocator_slack.py) that reserved peak
    leaves the 2 GiB margin and less than half a GiB more. On the one-GPU machine's 125 GiB
    host one input fewer fits the host and the GPU is short: refused (run 26)."""
    plan = _plan(SEQ, 128)
    b = plan.boundaries
    assert b is not None and (b.every, b.count("host"), b.count("none")) == (4, 4, 24)
    assert plan.fits, plan.problems
    gpu = plan.estimate.gpu
    assert gpu.items["allocator slack (reserved beyond allocated)"] == 4 * GIB
    assert H100_TOTAL - 2.5 * GIB < gpu.peak_bytes <= H100_TOTAL - 2 * GIB
    assert not _plan(SEQ, 125).fits
