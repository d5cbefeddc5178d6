"""distributed.node_turns: a node's ranks build one after another with all its cores, or all at
once with a share each (at_once 1 or 2 of 2); a failure on one rank stops the others; a turn
may outlast the collective timeout (the ranks meet in the job's store). Two gloo processes,
spawned once (imports dominate), their process group's collective timeout TIMEOUT_S: every
case runs in them in turn, each logging to its own file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatrain.distributed import Placement, any_rank, node_turns
from run_helpers import free_port, join_gloo

CASES = [(1, -1), (2, -1), (1, 0), (2, 0), (1, -1)]  # (ranks at once, rank whose build fails)
TIMEOUT_S = 3.0
SLOW_CASE, SLOW_S = 4, 2 * TIMEOUT_S  # a turn twice the collective timeout


def _case(rank: int, log: Path, at_once: int, fail_rank: int, build_s: float = 0.3) -> None:
    placement = Placement(torch.device("cpu"), rank, 2, rank, 2)

    def build() -> int:
        with open(log, "a") as f:
            f.write(f"start {rank} {torch.get_num_threads()}\n")
        time.sleep(build_s)  # long enough for the other rank to start, were it not waiting
        if rank == fail_rank:
            raise ValueError(f"rank {rank} cannot build")
        with open(log, "a") as f:
            f.write(f"end {rank}\n")
        return rank * 10

    try:
        assert node_turns(build, placement, at_once=at_once) == rank * 10
    except ValueError as e:
        with open(log, "a") as f:
            f.write(f"error {rank} {e}\n")
    except SystemExit:
        with open(log, "a") as f:
            f.write(f"stopped {rank}\n")


def _worker(rank: int, folder: str, port: int) -> None:
    join_gloo(rank, 2, port, TIMEOUT_S)
    try:
        with open(Path(folder) / f"any{rank}.txt", "w") as f:
            f.write(f"{any_rank(rank == 1)} {any_rank(False)}")
        for i, (at_once, fail_rank) in enumerate(CASES):
            build_s = SLOW_S if i == SLOW_CASE else 0.3
            _case(rank, Path(folder) / f"case{i}.txt", at_once, fail_rank, build_s)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_node_turns(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path), free_port()), nprocs=2)
    cases = [(tmp_path / f"case{i}.txt").read_text().splitlines() for i in range(len(CASES))]
    cores = os.cpu_count() or 1
    share = max(1, cores // 2)
    assert [(tmp_path / f"any{r}.txt").read_text() for r in range(2)] == ["True False"] * 2
    # in turns: one rank at a time, each with every core
    assert cases[0] == [f"start 0 {cores}", "end 0", f"start 1 {cores}", "end 1"]
    # at once: both start before either ends, each with its share
    assert sorted(cases[1][:2]) == [f"start 0 {share}", f"start 1 {share}"]
    # a failure: raised on its rank, the other stops; in turns rank 1 never started
    for lines, in_turns in ((cases[2], True), (cases[3], False)):  # at_once 1, 2
        assert "error 0 rank 0 cannot build" in lines and "stopped 1" in lines
        assert any(ln.startswith("start 1") for ln in lines) is not in_turns
    # a turn twice the collective timeout: the waiting rank waits in the store, not a collective
    assert cases[SLOW_CASE] == [f"start 0 {cores}", "end 0", f"start 1 {cores}", "end 1"]
