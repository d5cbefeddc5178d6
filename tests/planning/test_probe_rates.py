"""memory.probe_rates: a GPU run measures the rates that decide its plan before it plans
(recipes/builder.py `RunBuilder._machine`, planning/hardware.py RATES), and plans with them.

No GPU here: the run's placement is a CUDA device the planner only reads, this machine's
detection is the H100 test host, and the probe is replaced by one that returns given rates
(tests/planning/test_resources.py runs the real probe on this CPU). Under two gloo ranks the
first rank of each node probes and every rank plans with the slowest node's rates."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatrain.distributed import Placement, rank_mins
from megatrain.planning import builder as plan_builder
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import RATES, Hardware
from megatrain.recipes import builder as run_builder
from megatrain.recipes.builder import RunBuilder
from predict import cli_row_config
from run_helpers import free_port, join_gloo
from shapes import GPT_OSS_20B_17

HOST = Hardware().with_overrides(gpu_gib=79.6, host_gib=125)
CUDA = Placement(torch.device("cuda"))
INT8_ROW = {"optimizer.state_dtype": "int8", "optimizer.gpu_update_blocks": "auto"}
FAST_INT8 = {"h2d_gbps": 55.0, "d2h_gbps": 54.0, "optimizer_gparams_s": 4.78}  # run 79's host


def _config(**settings: Any) -> Any:
    """bench/cli_train.py's GPT-OSS-20B row at 17 layers with int8 states (runs 79-81)."""
    return cli_row_config(GPT_OSS_20B_17, **{**INT8_ROW, **settings})


def _probe(rates: dict[str, float], calls: list[dict[str, Any]]) -> Any:
    def probe(**kwargs: Any) -> Hardware:
        calls.append(kwargs)
        return dataclasses.replace(HOST, **rates)

    return probe


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """This machine detected as the H100 test host; the probe returns FAST_INT8 (its calls)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(plan_builder, "detect", lambda: HOST)
    monkeypatch.setattr(run_builder, "probe", _probe(FAST_INT8, calls))
    return calls


def _picks(builder: PlanBuilder) -> tuple[int, int, int]:
    engine = builder.plan(layout="full").engine
    return engine.gpu_state_blocks, engine.gpu_update_blocks, engine.share_sets


def test_a_gpu_run_plans_with_the_rates_it_measured(
    machine: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunBuilder(_config(), placement=CUDA)
    hw = run.hardware
    assert {name: getattr(hw, name) for name in RATES} == FAST_INT8
    assert hw.optimizer_state_dtype == "int8" and set(RATES) <= set(hw.measured)
    # the run's own kernel on the run's threads; no matmul (the fitted fractions keep theirs)
    assert machine == [
        {
            "optimizer_threads": HOST.optimizer_threads,
            "state_dtype": "int8",
            "impl": "auto",
            "matmul": False,
        }
    ]
    line = capsys.readouterr().out
    assert "rates measured here: host-to-GPU 55.0 GB/s, GPU-to-host 54.0 GB/s" in line
    assert "CPU AdamW 4.78 Gparams/s (int8 states, 14 threads)" in line
    # the plan is the one of that hardware given, and on run 79's fast host it differs from
    # the test host's assumed int8 rate (3.12): the CPU takes more of the updates
    measured = PlanBuilder(_config(), placement=CUDA, hardware=hw)
    assumed = PlanBuilder(_config(), placement=CUDA, hardware=HOST)
    assert _picks(run) == _picks(measured)
    assert _picks(run)[1] < _picks(assumed)[1]
    assert run.plan(layout="full").estimate.hardware.optimizer_gparams_s == 4.78


def test_no_probe_when_off_or_without_a_gpu(machine: list[dict[str, Any]]) -> None:
    off = RunBuilder(_config(**{"memory.probe_rates": False}), placement=CUDA)
    cpu = RunBuilder(_config(), placement=Placement(torch.device("cpu")))
    assert off.hardware == HOST == cpu.hardware
    assert machine == []


def test_a_failed_probe_leaves_the_assumed_rates(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(**kwargs: Any) -> Hardware:
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(plan_builder, "detect", lambda: HOST)
    monkeypatch.setattr(run_builder, "probe", refused)
    assert RunBuilder(_config(), placement=CUDA).hardware == HOST
    out = capsys.readouterr().out
    assert "rates: not measured (CUDA error: out of memory (cudaHostAlloc))" in out


# two gloo ranks: (local_rank, local_world_size) of each, and the rates each node's probe gives
NODES = {
    "one node": ([(0, 2), (1, 2)], [FAST_INT8, None]),
    "two nodes": (
        [(0, 1), (0, 1)],
        [FAST_INT8, {"h2d_gbps": 48.0, "d2h_gbps": 56.0, "optimizer_gparams_s": 2.62}],
    ),
}


def _rank(rank: int, folder: str, port: int) -> None:
    join_gloo(rank, 2, port, 60)
    try:
        lines = [repr(rank_mins([float(rank), 5.0 - rank]))]
        plan_builder.detect = lambda: HOST  # type: ignore[assignment]  # this process only
        for name, (places, rates) in NODES.items():
            calls: list[dict[str, Any]] = []
            node_rates = rates[rank] or {}
            run_builder.probe = _probe(node_rates, calls)  # type: ignore[assignment]
            local, local_world = places[rank]
            placement = Placement(torch.device("cuda"), rank, 2, local, local_world)
            hw = RunBuilder(_config(), placement=placement).hardware
            lines.append(f"{name} {len(calls)} {[getattr(hw, r) for r in RATES]}")
        (Path(folder) / f"rank{rank}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def test_ranks_plan_with_the_slowest_nodes_rates(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path), free_port()), nprocs=2)
    out = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    assert out[0][0] == out[1][0] == "[0.0, 4.0]"  # rank_mins: each value's least
    fast = [55.0, 54.0, 4.78]
    # one node: its first rank probes, the other waits and takes its rates
    assert (out[0][1], out[1][1]) == (f"one node 1 {fast}", f"one node 0 {fast}")
    # two nodes: each node's first rank probes; both plan with the least of each rate
    least = [48.0, 54.0, 2.62]
    assert (out[0][2], out[1][2]) == (f"two nodes 1 {least}", f"two nodes 1 {least}")
