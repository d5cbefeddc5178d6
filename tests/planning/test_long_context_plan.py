"""What the plan and the estimate say about long rows: layer inputs on the GPU, on the host or
recomputed (one kept every K layers), and the per-token parts over sequence tiles.

One layer input is T x D x c bytes (Llama-3.1-8B at 512k tokens in bf16: 4 GiB). At the
backward's peak the device holds the GPU-kept inputs plus K - 1 recomputed ones, or, for an
offloaded segment, max(K, 2) (planning/long_context.py); the host holds one pinned buffer per
offloaded input.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
from transformers import LlamaConfig

from megatrain.cli import split_overrides
from megatrain.commands.estimate import add_arguments, run
from megatrain.config.memory import MemoryConfig
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.planning import Hardware, model_spec
from megatrain.planning.activations import layer_profile
from megatrain.planning.hardware import GIB
from megatrain.planning.long_context import choose_boundaries, device_inputs, longest_fitting
from predict import predict
from shapes import LLAMA31_8B as LLAMA_8B

INPUT = 4 * GIB  # one 8B layer input at 524,288 tokens, bf16


def _choose(
    gpu_gib: float, host_gib: float, offload: str = "auto", every: int | str = "auto"
) -> tuple[BoundaryPlan, str]:
    return choose_boundaries(
        32,
        input_bytes=INPUT,
        micro_batches=1,
        gpu_free_bytes=gpu_gib * GIB,
        host_free_bytes=host_gib * GIB,
        offload=offload,
        every=every,
    )


def test_gpu_first_then_host() -> None:
    # 40 GiB of GPU room = 10 inputs: the backward consumes the 10 GPU-kept inputs before any
    # offloaded one comes back (then 2 at a time), so 10 stay and 22 go to the host
    plan, reason = _choose(40, 200)
    assert (plan.every, plan.count("gpu"), plan.count("host")) == (1, 10, 22)
    assert plan.places[-10:] == ("gpu",) * 10  # the backward's first
    assert device_inputs(plan) * INPUT <= 40 * GIB
    assert "10 kept on the GPU, 22 offloaded" in reason


def test_host_too_small_recomputes() -> None:
    # GPU room 10 inputs, host 4. K = 1: 32 kept > 10 + 4. K = 2: 16 kept, the GPU holds at
    # most 9 (+ 1 recomputed), 7 > 4 on the host. K = 3: 11 kept, 8 on the GPU (+ 2
    # recomputed = 10), 3 on the host: the first that fits
    plan, reason = _choose(40, 18)
    assert (plan.every, plan.count("gpu"), plan.count("host"), plan.count("none")) == (3, 8, 3, 21)
    assert device_inputs(plan) == 10
    assert "one kept every 3 layers" in reason
    for k in (1, 2):
        assert _choose(40, 18, every=k)[1].startswith("does not fit"), k


def test_offload_off_and_on() -> None:
    off, _ = _choose(1000, 0, offload="off")
    assert (off.every, off.count("gpu"), device_inputs(off)) == (1, 32, 32)
    on, _ = _choose(1000, 1000, offload="on", every=2)
    assert (on.count("gpu"), on.count("host"), on.count("none")) == (0, 16, 16)
    assert device_inputs(on) == 2  # a segment of 2, or a start and the next one's prefetch
    assert _choose(3, 0)[1].startswith("does not fit")  # not one input fits the GPU


def test_backward_peak_counts() -> None:
    assert device_inputs(BoundaryPlan.make(32)) == 32
    assert device_inputs(BoundaryPlan.make(32, every=4)) == 8 + 3
    assert device_inputs(BoundaryPlan.make(32, every=4, on_host=5)) == max(3 + 3, 4)
    assert device_inputs(BoundaryPlan.make(32, on_host=32)) == 2


def test_tiles_shrink_the_layer_transient() -> None:
    """With T tiles, the gated MLP's three saved [S x I] tensors (gate, up, act) exist for one
    tile at a time: the layer's measured peak drops by at least 3 x S x I x c x (1 - 1/T)."""
    spec = model_spec(
        LlamaConfig(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    )
    seq, c = 65536, 2
    whole = layer_profile(spec, 1, seq, "full", 1).peak_bytes
    for tiles in (2, 8):
        tiled = layer_profile(spec, 1, seq, "full", tiles).peak_bytes
        assert whole - tiled >= 3 * seq * 1024 * c * (1 - 1 / tiles)


def test_estimate_counts_offloaded_inputs() -> None:
    spec = model_spec(LlamaConfig(**LLAMA_8B))
    hw = Hardware(gpu_bytes=80 * GIB, host_bytes=256 * GIB)
    kw = dict(seq_len=524288, micro_batch_size=1, padded=False, hardware=hw, mlp_tiles=32)
    on_gpu = predict(spec, **kw)  # type: ignore[arg-type]
    plan = BoundaryPlan.make(32, on_host=32)
    offloaded = predict(spec, boundary_plan=plan, **kw)  # type: ignore[arg-type]
    assert on_gpu.gpu.items["boundary activations"] == 32 * INPUT
    assert offloaded.gpu.items["boundary activations"] == 2 * INPUT
    assert offloaded.host.offload_bytes == 32 * INPUT  # 4 GiB buffers: 2 MiB multiples
    assert offloaded.host.total_bytes - on_gpu.host.total_bytes == 32 * INPUT
    assert offloaded.gpu.peak_bytes == on_gpu.gpu.peak_bytes - 30 * INPUT


def test_longest_fitting() -> None:
    assert longest_fitting(lambda n: n <= 5000, 1024, 1 << 20, 1024) == 4096
    assert longest_fitting(lambda n: False, 1024, 1 << 20, 1024) is None
    assert longest_fitting(lambda n: True, 1024, 8192, 1024) == 8192
    # every threshold in range: the brute-force answer, and no probe past twice it
    for limit in [*range(1024, 40 * 1024, 333), 8 << 20, (8 << 20) - 1]:
        probes: list[int] = []

        def fits(n: int, limit: int = limit, probes: list[int] = probes) -> bool:
            probes.append(n)
            return n <= limit

        answer = longest_fitting(fits, 1024, 8 << 20, 1024)
        assert answer == min(limit, 8 << 20) // 1024 * 1024
        assert max(probes) <= 2 * answer + 1024 and len(probes) <= 2 * 14


def test_unknown_offload_value() -> None:
    with pytest.raises(ValueError, match="activation_offload"):
        _choose(1, 1, offload="yes")


def _estimate_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    overrides, rest = split_overrides([*argv, "--json"])
    args = parser.parse_args(rest)
    args.overrides = overrides
    run(args)
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_estimate_command_longest_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The longest row fits and 1,024 tokens more does not (GPU-bound: 2 GiB at the margin)."""
    base = ["--model-type", "llama", "--tiny", "--gpu-gib", "4", "--host-gib", "64"]
    found = _estimate_json([*base, "--seq-len", "1024", "--longest"], capsys)
    longest = found["longest_row"]
    assert longest is not None and longest % 1024 == 0 and longest >= 1024
    at = _estimate_json([*base, "--seq-len", str(longest), "--micro-batch-size", "1"], capsys)
    above = [*base, "--seq-len", str(longest + 1024), "--micro-batch-size", "1"]
    assert at["fits"] and not _estimate_json(above, capsys)["fits"]
    assert "layer inputs" in at["settings"]["activations"]


@pytest.mark.parametrize("value", [0, "many"])
def test_bad_checkpoint_every_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"memory\.checkpoint_every"):
        MemoryConfig(checkpoint_every=value).validate()  # type: ignore[arg-type]  # on purpose
