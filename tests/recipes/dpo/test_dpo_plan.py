"""What the DPO reference costs before a run: the planner's forward-only pass (compute-bound:
the forward's FLOPs and the head's forward; copy-bound: every block up once), the passes of the
one-off precomputed pass over N pairs and its 8-byte-per-pair table, the weights' host copy and
its pass per step, and the host check that counts the copy."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from megatrain.cli import split_overrides
from megatrain.commands.estimate import add_arguments, run
from megatrain.model.tiny import tiny_config
from megatrain.planning import Hardware, model_spec
from megatrain.planning.hardware import GIB
from megatrain.planning.layer_time import attention_flops_per_token
from megatrain.planning.ranks import NVLINK_GBPS, ONE_PROCESS, Ranks
from megatrain.planning.timing import reference_swap_s
from predict import predict

SEQ, ROWS, ACCUM = 64, 8, 3


def _estimate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    overrides, rest = split_overrides(argv)
    args = parser.parse_args(rest)
    args.overrides = overrides
    status = run(args)
    return status, json.loads(capsys.readouterr().out)


def _dpo(*extra: str) -> list[str]:
    return [
        "--model-type", "llama", "--tiny", "--seq-len", str(SEQ),
        "--micro-batch-size", str(ROWS), "--grad-accum", str(ACCUM),
        "--memory.gpu_state_blocks", "0", "--data.stage", "dpo", "--json", *extra,
    ]  # fmt: skip


def test_forward_pass_is_the_forward_flops_when_compute_bound() -> None:
    spec = model_spec(tiny_config("llama"), "bf16")
    # copies, launches and memory traffic ~free
    hw = Hardware(op_launch_s=0.0, h2d_gbps=1e9, d2h_gbps=1e9, gpu_hbm_gbps=1e12)
    est = predict(spec, seq_len=SEQ, micro_batch_size=ROWS, grad_accum=ACCUM, hardware=hw)
    tokens = SEQ * ROWS * ACCUM
    layers = sum(2.0 * la.active_params + attention_flops_per_token(la, SEQ) for la in spec.layers)
    flops = tokens * (layers + 2.0 * spec.lm_head_params)
    expected = flops / hw.flops_per_s(torch.bfloat16, spec.hidden_size)
    assert est.time.forward_s == pytest.approx(expected, rel=1e-3)
    # the step adds recompute + backward (3x the forward's matmuls) and the head's backward
    assert est.time.step_s > 3.5 * est.time.forward_s


def test_forward_pass_copies_every_block_once_when_copy_bound() -> None:
    spec = model_spec(tiny_config("llama"), "bf16")
    hw = Hardware(op_launch_s=0.0, h2d_gbps=1e-3, gpu_tflops_bf16=1e9)  # compute ~free
    est = predict(spec, seq_len=SEQ, micro_batch_size=ROWS, grad_accum=ACCUM, hardware=hw)
    blocks = sum(la.params for la in spec.layers) + spec.head_params
    blocks += spec.embed_params if spec.tied else 0
    assert est.time.forward_s == pytest.approx(blocks * 2 / (hw.h2d_gbps * 1e9), rel=1e-3)


def test_precomputed_reference_counts_its_passes_and_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, report = _estimate(_dpo("--pairs", "100"), capsys)
    assert status == 0
    ref, forward_s = report["reference"], report["time"]["forward_s"]
    # 4 pairs per micro-batch: 25 micro-batches, 3 per pass
    assert ref["mode"] == "precomputed" and ref["passes"] == math.ceil(25 / 3) == 9
    assert ref["reference_s"] == pytest.approx(9 * forward_s) and forward_s > 0
    assert ref["host_bytes"] == ref["checkpoint_bytes"] == 800 and ref["step_extra_s"] == 0


def test_weights_reference_counts_the_copy_and_a_pass_per_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, report = _estimate(_dpo("--dpo.reference", "weights"), capsys)
    assert status == 0
    ref = report["reference"]
    assert ref["host_bytes"] == 2 * report["total_params"]  # bf16 copies of every block
    assert ref["step_extra_s"] == report["time"]["forward_s"] and ref["reference_s"] == 0
    # two ranks: the node holds both ranks' copies of their shards, each block padded to a
    # multiple of 2 x 2048 values (store/shard.py), and the checkpoint both ranks' files
    _, two = _estimate(_dpo("--dpo.reference", "weights", "--nproc-per-node", "2"), capsys)
    spec = model_spec(tiny_config("llama"), "bf16")
    blocks = [spec.embed_params, *(la.params for la in spec.layers), spec.head_params]
    padded = sum(-(-n // 4096) * 4096 for n in blocks)
    assert two["reference"]["host_bytes"] == two["reference"]["checkpoint_bytes"] == 2 * padded
    status, report = _estimate(_dpo("--dpo.loss_type", "orpo"), capsys)
    assert report["reference"]["mode"] == "none" and report["reference"]["host_bytes"] == 0
    # a host with room for training but not for the copy: refused, naming the setting
    margin = 4.0
    host = report["host"]  # room between the load's peak and training + the copy
    room = (host["load_peak_bytes"] + host["total_bytes"] + ref["host_bytes"]) / 2
    assert host["load_peak_bytes"] < room < host["total_bytes"] + ref["host_bytes"]
    host_gib = room / GIB + margin
    args = ("--dpo.reference", "weights", "--host-gib", str(host_gib))
    status, report = _estimate(_dpo(*args, "--host-margin-gib", str(margin)), capsys)
    assert status == 1 and "dpo.reference: weights" in report["problem"]
    status, report = _estimate(_dpo("--host-gib", str(host_gib), "--host-margin-gib", "4"), capsys)
    assert status == 0, report["problem"]  # the table (8 bytes per pair) fits


def test_pairs_on_a_run_without_preference_data_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-type", "llama", "--tiny", "--seq-len", "64"])
    args.overrides, args.pairs = [], 10
    with pytest.raises(ValueError, match="--pairs 10"):
        run(args)


@pytest.mark.parametrize(("dtype", "copies"), [("bf16", 1), ("fp32", 3)])
def test_weights_reference_adds_the_gpu_tier_swap(
    capsys: pytest.CaptureFixture[str], dtype: str, copies: int
) -> None:
    """A GPU tier of two layers: its reference weights go up for the pass (bf16: the tier's own
    are rebuilt from the device's fp32 master after); in fp32 the tier's own weights, its
    master, also go to the host and back: 3 copies of the tier's bytes at the link's rate."""
    args = ("--dpo.reference", "weights", "--memory.gpu_state_blocks", "2", "--dtype", dtype)
    status, report = _estimate(_dpo(*args), capsys)
    assert status == 0
    ref, hw = report["reference"], report["hardware"]
    spec = model_spec(tiny_config("llama"), dtype)
    tier_bytes = sum(la.params for la in spec.layers[:2]) * (2 if dtype == "bf16" else 4)
    assert hw["h2d_gbps"] == hw["d2h_gbps"]  # the defaults: one rate for both ways
    assert ref["swap_s"] == pytest.approx(copies * tier_bytes / (hw["h2d_gbps"] * 1e9), rel=1e-12)
    assert ref["step_extra_s"] == pytest.approx(report["time"]["forward_s"] + ref["swap_s"])


@pytest.mark.parametrize(("dtype", "copies"), [("bf16", 1), ("fp32", 3)])
def test_a_sharded_tier_swaps_its_shard_and_gathers(dtype: str, copies: int) -> None:
    """Under W ranks each rank copies its shard of the tier's weights (1/W of the bytes) and
    the whole weights are all-gathered twice: the reference in, the policy back."""
    spec = model_spec(tiny_config("llama"), dtype)
    hw, ranks = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB), Ranks(nproc_per_node=2)
    tier_bytes = sum(la.params for la in spec.layers[:2]) * (2 if dtype == "bf16" else 4)
    alone = reference_swap_s(spec, hw, 2, True, ONE_PROCESS)
    assert alone == pytest.approx(copies * tier_bytes / (hw.h2d_gbps * 1e9), rel=1e-12)
    gathers = 2 * tier_bytes / 2 / (NVLINK_GBPS * 1e9)
    assert reference_swap_s(spec, hw, 2, True, ranks) == pytest.approx(alone / 2 + gathers)
    assert reference_swap_s(spec, hw, 2, False, ranks) == 0.0  # the CPU: the device is the host
