"""The ranks of a multi-process run: read from torchrun's environment, one process group.

`torchrun --nproc-per-node N -m megatrain train ...` starts N processes and sets RANK,
WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (and the rendezvous MASTER_ADDR / MASTER_PORT) in
each. A process without them, or with WORLD_SIZE 1, is a single-process run and nothing here
touches torch.distributed. The process group is NCCL on CUDA, gloo on the CPU, with a timeout
on every collective (MEGATRAIN_COLLECTIVE_TIMEOUT_S, default 600 s), so a rank that died
stops the others instead of leaving them waiting forever.

NCCL settings in the environment (NCCL_NVLS_ENABLE=0 and friends) are left as they are.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from megatrain.device import resolve_device

# all_gather_into_tensor under the name newer torch gives it (the engine's gathers, the export's)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

DEFAULT_TIMEOUT_S = 600.0
T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job: its device, and its rank among `world_size`."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # this rank's place among them
    local_world_size: int = 1  # ranks on this node (they share its cores and host memory)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def rank_env() -> RankEnv | None:
    """This process's place in a torchrun job, or None for a single-process run."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    try:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except KeyError as e:
        raise ValueError(
            f"WORLD_SIZE={world} is set but {e.args[0]} is not: start multi-process runs with "
            "torchrun (torchrun --nproc-per-node N -m megatrain train --config F), which sets "
            "RANK, LOCAL_RANK and WORLD_SIZE, or unset WORLD_SIZE for a single-process run"
        ) from None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return RankEnv(rank, world, local_rank, local_world)


def timeout_s() -> float:
    raw = os.environ.get("MEGATRAIN_COLLECTIVE_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"MEGATRAIN_COLLECTIVE_TIMEOUT_S={raw!r}: give the collective timeout in seconds, "
            "a number > 0 (default 600)"
        )
    return value


_JOB_STORE: list[dist.Store] = []  # the rendezvous store of the first process group


def _join(env: RankEnv, device: torch.device, store: dist.Store | None = None) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s()),
        store=store,
        **kwargs,  # type: ignore[arg-type]
    )


def init_process_group(env: RankEnv, device: torch.device) -> None:
    """Join the job's process group (once per process); non-zero ranks print nothing."""
    if dist.is_initialized():
        return
    _join(env, device)
    _JOB_STORE[:] = [dist.distributed_c10d._get_default_store()]
    if env.rank != 0:
        # Progress and messages come from rank 0; errors (stderr) from whichever rank has one.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process


def job_store() -> dist.Store:
    """The job's key-value store (torchrun's rendezvous): it outlives an aborted process group,
    so ranks can still tell each other what happened."""
    if not _JOB_STORE:  # a process group made elsewhere (tests): its store
        _JOB_STORE.append(dist.distributed_c10d._get_default_store())
    return _JOB_STORE[0]


def abort() -> None:
    """Abort this rank's process group: its collectives in flight, and any this rank is blocked
    in, end with an error instead of waiting for a rank that will not come (NCCL's
    ncclCommAbort; gloo closes its connections). Another thread may call it."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


def rejoin(placement: Placement, generation: int) -> None:
    """After `abort()` on every rank: a new process group of the same ranks, its keys under
    `generation` in the job's store (the old group's keys stay where they were)."""
    store = dist.PrefixStore(f"megatrain/group{generation}/", job_store())
    env = RankEnv(
        placement.rank, placement.world_size, placement.local_rank, placement.local_world_size
    )
    _join(env, placement.device, store)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def on_rank0(fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 only (output folder checks, config writes), then let every rank go on.

    If it fails on rank 0 its error is raised there and reaches the user once; the other ranks
    learn of it from a flag and exit quietly, rather than waiting at the next collective.
    """
    if not dist.is_initialized():
        fn()
        return
    _together(fn if dist.get_rank() == 0 else None)


def on_every_rank(fn: Callable[[], None]) -> None:
    """Run `fn` on every rank, then go on only if it succeeded everywhere (a barrier): a rank
    whose `fn` failed raises its error, the others exit quietly."""
    if not dist.is_initialized():
        fn()
        return
    _together(fn)


def _failure_of(fn: Callable[[], None] | None) -> BaseException | None:
    """What `fn()` raised (None: nothing, or no `fn`): re-raised by the caller once the other
    ranks know."""
    if fn is not None:
        try:
            fn()
        except BaseException as e:
            return e
    return None


def _together(fn: Callable[[], None] | None) -> None:
    failed = _failure_of(fn)
    flag = torch.tensor([1 if failed is not None else 0], dtype=torch.int64, device=_device())
    dist.all_reduce(flag)
    if failed is not None:
        raise failed
    if int(flag.item()):  # sync point
        raise SystemExit(1)


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (every rank gets the same answer)."""
    return bool(rank_max(int(flag)))


def rank_max(value: int) -> int:
    """The largest of every rank's `value` (every rank gets the same answer)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())  # sync point


def rank_sums(values: list[float]) -> list[float]:
    """Each of `values` summed over the ranks, in float64 (every rank gets the sums)."""
    if not dist.is_initialized() or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.tolist()  # sync point


def rank_mins(values: list[float]) -> list[float]:
    """Each of `values`, the least over the ranks, in float64 (every rank gets them)."""
    if not dist.is_initialized() or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()  # sync point


_TURN_POLL_S = 0.5
_turn_rounds = [0]  # node_turns calls so far: the same on every rank, so the store keys match


def _waiting_together(fn: Callable[[], None] | None, key: str) -> None:
    """`_together` without a collective: the ranks meet in the job's store, so ranks that wait
    for a long `fn` elsewhere (a turn of loading a large model) wait without the collective
    timeout. A rank that died ends the job through torchrun, which stops the others."""
    store = job_store()
    failed = _failure_of(fn)
    if failed is not None:
        store.set(f"{key}/failed", str(dist.get_rank()))
    store.add(f"{key}/done", 1)
    while store.add(f"{key}/done", 0) < dist.get_world_size():
        time.sleep(_TURN_POLL_S)
    if failed is not None:
        raise failed
    if store.check([f"{key}/failed"]):
        raise SystemExit(1)


def node_turns(build: Callable[[], T], placement: Placement, *, at_once: int) -> T:
    """`build()` on every rank, `at_once` of each node's ranks at a time (local ranks 0 to
    at_once - 1 first, and so on), each of them with its share of the node's cores: one at a
    time with all of them, or all at once. A failure on any rank stops every rank at the end
    of that turn (its error raised where it happened). The ranks meet between turns in the
    job's store, not in a collective: a turn may take longer than the collective timeout."""
    result: list[T] = []
    cores, before = os.cpu_count() or 1, torch.get_num_threads()
    local = placement.local_world_size
    at_once = min(max(at_once, 1), local)

    def run() -> None:
        result.append(build())

    _turn_rounds[0] += 1
    try:
        # torchrun sets OMP_NUM_THREADS=1: init is CPU work
        torch.set_num_threads(max(1, cores // at_once))
        for turn in range(-(-local // at_once)):
            key = f"megatrain/turns/{_turn_rounds[0]}/{turn}"
            _waiting_together(run if placement.local_rank // at_once == turn else None, key)
    finally:
        torch.set_num_threads(before)
    return result[0]


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def placement_here(device_setting: str) -> Placement:
    """This process's placement: alone on `training.device`, or its rank under torchrun."""
    device = torch.device(resolve_device(device_setting))
    env = rank_env()
    if env is None:
        return Placement(device)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank)  # one GPU per rank
        torch.cuda.set_device(device)
    init_process_group(env, device)
    return Placement(device, env.rank, env.world_size, env.local_rank, env.local_world_size)


def least_on_ranks(value: int) -> int:
    """The smallest of every rank's `value` (every rank gets it): a count the ranks must agree
    on, such as the GPU tier's blocks, each planned from its own GPU."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())  # sync point


def rows_per_rank(global_batch_size: int, world: int) -> int:
    """Each rank's share of training.global_batch_size rows."""
    if global_batch_size % world:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} rows do not split over {world} "
            "ranks; make it a multiple of the number of processes"
        )
    return global_batch_size // world
