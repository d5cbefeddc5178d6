"""What the estimate says about ranks (planning/ranks.py): per-node host, per-rank GPU, step.

Qwen2.5-7B shape (untied, 28 equal layers), bf16 compute, fp32 states: 14 host bytes per
parameter in one process. With W ranks each keeps 1/W of every block, padded to whole int8
quantization blocks (W x 2048 elements), so the expected numbers are the block sizes' shards
summed exactly, not a tolerance.
"""

from __future__ import annotations

import argparse
import json

import pytest
from transformers import Qwen2Config

from megatrain.cli import split_overrides
from megatrain.commands.estimate import add_arguments, run
from megatrain.planning import Estimate, Hardware, model_spec
from megatrain.planning.fit import host_problem
from megatrain.planning.hardware import GIB
from megatrain.planning.plan import plan_resources
from megatrain.planning.ranks import NCCL_HOST_GIB, NVLINK_GBPS, Ranks
from megatrain.planning.run_shape import RunShape
from megatrain.planning.spec import ModelSpec
from megatrain.store.states import QUANT_BLOCK
from predict import predict, ranks_estimate
from shapes import QWEN25_7B as QWEN7B
from shapes import QWEN25_32B

HW = Hardware(host_bytes=512 * GIB)


@pytest.fixture(scope="module")
def qwen7b() -> ModelSpec:
    return model_spec(Qwen2Config(**QWEN7B))


def _est(spec: ModelSpec, ranks: Ranks) -> Estimate:
    return ranks_estimate(spec, ranks, HW)


def _blocks(spec: ModelSpec) -> list[int]:
    return [spec.embed_params, *(la.params for la in spec.layers), spec.head_params]


def _shard(numel: int, world: int) -> int:
    per = world * QUANT_BLOCK
    return -(-numel // per) * per // world


@pytest.mark.parametrize(("n", "m"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_host_per_node_is_its_ranks_shards(qwen7b: ModelSpec, n: int, m: int) -> None:
    one, job = _est(qwen7b, Ranks()), _est(qwen7b, Ranks(n, m))
    world = n * m
    shards = sum(_shard(b, world) for b in _blocks(qwen7b))
    assert one.host.store_bytes == 14 * qwen7b.total_params
    assert job.host.store_bytes == n * 14 * shards  # per node: its n ranks' shards
    # each process its baseline, and under ranks NCCL's host share (ranks.py NCCL_HOST_GIB)
    assert job.host.baseline_bytes == n * (HW.process_baseline_bytes + int(NCCL_HOST_GIB * GIB))
    # the padding is at most one W x 2048 run per block
    pad = 14 * n * QUANT_BLOCK * len(_blocks(qwen7b))
    assert 0 <= job.host.store_bytes - one.host.store_bytes * n / world <= pad
    # loading one rank at a time: in the last turn the others hold their shards and the
    # loading rank its whole fp32 model (at first) or its shards (at the end), whichever is
    # more, plus the block being moved twice
    held = job.host.store_bytes // n
    loader = max(4 * sum(_blocks(qwen7b)), held) + 4 * max(_blocks(qwen7b))
    assert job.host.load_peak_bytes == job.host.total_bytes - held + loader
    assert job.host.load_peak_at_once(n) == job.host.load_peak_bytes + (n - 1) * (loader - held)


def test_two_nodes_halve_the_host_and_keep_it_on_one(qwen7b: ModelSpec) -> None:
    one, node, nodes = _est(qwen7b, Ranks()), _est(qwen7b, Ranks(2, 1)), _est(qwen7b, Ranks(1, 2))
    pad = 14 * 2 * QUANT_BLOCK * len(_blocks(qwen7b))
    assert 0 <= node.host.store_bytes - one.host.store_bytes <= pad
    assert 0 <= 2 * nodes.host.store_bytes - one.host.store_bytes <= pad


def test_gpu_per_rank_adds_the_gathered_table_and_a_gradient_shard(qwen7b: ModelSpec) -> None:
    one, two = _est(qwen7b, Ranks()), _est(qwen7b, Ranks(2, 1))
    largest = max(la.params for la in qwen7b.layers)
    table = 2 * _shard(qwen7b.embed_params, 2)  # the padded layout (store/shard.py)
    assert two.gpu.items["all-gathered embedding table (ranks)"] == 2 * table
    assert two.gpu.items["reduce-scatter output (ranks, fp32)"] == 4 * _shard(largest, 2)
    assert two.gpu.peak_phase == one.gpu.peak_phase
    extra = 2 * table + 4 * _shard(largest, 2)

    # every persistent buffer of two ranks is over the padded layout of its block: the two
    # weight slots (bf16), the two fp32 accumulators and their bf16 staging over the largest
    # layer; the head's bf16 weights and fp32 gradient; the embedding's fp32 gradient
    def pad(n: int) -> int:
        return 2 * _shard(n, 2) - n

    padding = pad(largest) * (2 * 2 + 2 * 4 + 2 * 2) + pad(qwen7b.head_params) * (2 + 4)
    padding += pad(qwen7b.embed_params) * 4
    assert two.gpu.persistent_bytes - one.gpu.persistent_bytes == 2 * table + padding
    assert two.gpu.peak_bytes == one.gpu.peak_bytes + extra + padding


def test_optimizer_splits_over_nodes_and_shares_a_node(qwen7b: ModelSpec) -> None:
    """AdamW is host-memory-bound: ranks of one node split the parameters and the node's rate
    (same seconds per step, for twice the tokens); ranks on two nodes halve the seconds."""
    rate = HW.optimizer_gparams_s * 1e9
    one, node, nodes = _est(qwen7b, Ranks()), _est(qwen7b, Ranks(2, 1)), _est(qwen7b, Ranks(1, 2))
    shards = sum(_shard(b, 2) for b in _blocks(qwen7b))
    assert one.time.optimizer_s == pytest.approx(qwen7b.total_params / rate, rel=1e-12)
    assert node.time.optimizer_s == pytest.approx(shards / (rate / 2), rel=1e-12)
    assert nodes.time.optimizer_s == pytest.approx(shards / rate, rel=1e-12)
    assert nodes.time.optimizer_s < 0.51 * one.time.optimizer_s


def test_collectives_and_job_tokens(qwen7b: ModelSpec) -> None:
    one, two = _est(qwen7b, Ranks()), _est(qwen7b, Ranks(2, 1))
    assert one.time.collective_s == 0.0
    layers = sum(la.params for la in qwen7b.layers)
    gathered = 2 * (2 * layers + qwen7b.head_params + qwen7b.embed_params)  # bf16 bytes
    scattered = 4 * (layers + qwen7b.head_params + qwen7b.embed_params)  # fp32 bytes
    expected = (gathered + scattered) * (2 - 1) / 2 / (NVLINK_GBPS * 1e9)
    assert two.time.collective_s == pytest.approx(expected, rel=1e-12)
    assert two.settings["tokens_per_step"] == one.settings["tokens_per_step"]  # per rank
    assert two.time.tokens_per_s == pytest.approx(2 * 8192 / two.time.step_s, rel=1e-12)
    # bound by the CPU optimizer at 8k tokens per rank: the step is no faster than that
    assert two.time.step_s >= two.time.optimizer_s


def test_fit_check_refuses_per_node(qwen7b: ModelSpec) -> None:
    """A 256 GiB node: 4 ranks of the 7B (~14 B/param + 4 baselines) fit; a node of a 32B
    shape (~14 x 32.8e9 B = 427 GiB) does not. Two such nodes hold half each (~214 GiB) for
    training, but not the loading: its rank loads a whole fp32 model (122 GiB) beside the
    others' shards; nodes of 320 GiB do."""
    hw = Hardware(host_bytes=256 * GIB)
    qwen32b = model_spec(Qwen2Config(**QWEN25_32B))

    def plan(spec: ModelSpec, ranks: Ranks) -> list[str]:
        shape = RunShape(2048, 2, "full", 1.0, None, False, True, "fp32", 0, ranks=ranks)
        return list(
            plan_resources(
                spec, shape, hardware=hw, micro_batch_size=1, gpu_margin_gib=2, host_margin_gib=4
            ).problems
        )

    assert plan(qwen7b, Ranks(4, 1)) == []
    (problem,) = plan(qwen32b, Ranks(4, 1))
    assert "host" in problem
    (problem,) = plan(qwen32b, Ranks(4, 2))
    assert problem.startswith("host RAM while the model loads")
    hw = Hardware(host_bytes=320 * GIB)
    assert plan(qwen32b, Ranks(4, 2)) == []


def _command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    overrides, rest = split_overrides(argv)
    args = parser.parse_args(rest)
    args.overrides = overrides
    return int(run(args))


def test_estimate_command_takes_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model-type", "llama", "--tiny", "--seq-len", "64", "--gpu-gib", "80", "--json"]
    assert _command([*base, "--nproc-per-node", "2", "--nnodes", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["settings"]["nproc_per_node"], report["settings"]["nnodes"]) == (2, 3)
    # auto: the tiny model's 3 layers, embedding and head all fit in each rank's GPU tier
    assert report["settings"]["gpu_state_blocks"] == 5
    assert report["time"]["collective_s"] > 0  # the tier's gradients and weights still travel
    assert _command([*base, "--nproc-per-node", "2", "--memory.gpu_state_blocks", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["gpu_state_blocks"] == 3
    with pytest.raises(ValueError, match="nnodes must be >= 1"):
        _command([*base, "--nnodes", "0"])


def test_ranks_load_as_many_at_once_as_the_host_holds() -> None:
    # Qwen2.5-32B shape, 4 ranks on a 503 GiB node: each rank holds 3.5 B/param of shards
    # (~107 GiB) and loads a 4 B/param fp32 model (~122 GiB): each more rank loading at once
    # adds the difference and the block moved twice (~18 GiB)
    spec = model_spec(Qwen2Config(**QWEN25_32B))
    est = predict(
        spec,
        seq_len=2048,
        micro_batch_size=2,
        padded=False,
        hardware=Hardware(host_bytes=503 * GIB),
        ranks=Ranks(4, 1),
    )
    h = est.host
    held = (h.pageable_bytes + h.pinned_reserved_bytes) // 4  # one rank's, pinned as reserved
    assert h.load_extra_bytes == 4 * sum(_blocks(spec)) - held + 4 * max(_blocks(spec))
    peaks = [h.load_peak_at_once(n) for n in range(1, 5)]
    assert peaks[0] == h.load_peak_bytes and 440 * GIB < peaks[0] < 460 * GIB
    room = [(peaks[n - 1] + peaks[n]) // 2 for n in range(1, 4)]  # between two peaks
    assert [h.loading_at_once(r, 4) for r in room] == [1, 2, 3]
    assert h.loading_at_once(peaks[3], 4) == 4
    assert h.loading_at_once(100 * GIB, 4) == 1  # one at a time: the fit check reports it


def test_the_fit_check_counts_the_loading_peak() -> None:
    # training fits the node, loading (one rank at a time) does not: refused before loading
    spec = model_spec(Qwen2Config(**QWEN25_32B))
    hw = Hardware(host_bytes=445 * GIB)
    est = predict(spec, seq_len=2048, micro_batch_size=2, hardware=hw, ranks=Ranks(4, 1))
    assert est.host.total_bytes < 441 * GIB < est.host.load_peak_bytes
    problem = host_problem(est, hw, 4.0)
    assert problem is not None and problem.startswith("host RAM while the model loads")
    assert host_problem(est, Hardware(host_bytes=470 * GIB), 4.0) is None
