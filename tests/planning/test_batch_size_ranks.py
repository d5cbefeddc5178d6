"""The automatic micro-batch is chosen against the estimate the fit check judges, ranks included:
a rank holds a gathered layer and a reduce-scatter output that one process does not."""

from __future__ import annotations

from transformers import Qwen2Config

from megatrain.planning import Hardware, model_spec
from megatrain.planning.hardware import GIB
from megatrain.planning.ranks import Ranks
from predict import pick_batch, predict
from shapes import QWEN25_7B

QWEN_7B = Qwen2Config(**QWEN25_7B)


def test_auto_micro_batch_counts_the_ranks_gpu_buffers() -> None:
    spec = model_spec(QWEN_7B)
    common = dict(seq_len=2048, padded=False)
    roomy = Hardware(gpu_bytes=80 * GIB, host_bytes=1024 * GIB)
    peak = {
        (b, world): predict(
            spec, micro_batch_size=b, hardware=roomy, ranks=Ranks(world, 1), **common
        ).gpu.peak_bytes
        for b in (4, 8)
        for world in (1, 2)
    }
    assert peak[(8, 2)] > peak[(8, 1)]  # the ranks' extra buffers
    # A GPU on which 8 rows fit one process but not a rank (2 GiB margin)
    gpu = Hardware(gpu_bytes=(peak[(8, 1)] + peak[(8, 2)]) // 2 + 2 * GIB, host_bytes=1024 * GIB)
    target = dict(tokens_per_step=8 * 2048, hardware=gpu, **common)
    assert pick_batch(spec, **target)[0] == 8
    b, accum, _ = pick_batch(spec, ranks=Ranks(2, 1), **target)
    assert (b, accum) == (4, 2)
    chosen = predict(
        spec, micro_batch_size=b, grad_accum=accum, hardware=gpu, ranks=Ranks(2, 1), **common
    )
    assert chosen.gpu.peak_bytes <= gpu.gpu_bytes - 2 * GIB
