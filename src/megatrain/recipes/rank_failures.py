"""Out-of-memory steps under several ranks (recipes/oom.py has the one-process path; both
undo a step through recipes/step_down.py).

Several ranks step down together (`RankFailures`). The rank that ran out of memory cannot
simply stop: the others would wait inside the step's next collective for it. It writes the
failed step and its shortfall into the job's key-value store (torchrun's rendezvous store,
which outlives a process group) and aborts its process group; on every other rank a watcher
thread, polling that store while a step runs, aborts the group too, so whatever collective the
rank is blocked in ends with an error. Every rank then undoes its part of the step, the ranks
join a new process group (its keys under a new prefix of the same store), agree on the
largest shortfall, and each steps down the same plan (the GPU-tier count is agreed as ever:
the least over ranks) before the step runs again everywhere.

A rank that stops with any other error during a step says so through the same store first:
the others abort their group and exit quietly, rather than wait in a collective until its
timeout (MEGATRAIN_COLLECTIVE_TIMEOUT_S) and print its traceback.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from megatrain.distributed import Placement, abort, job_store, rank_max, rejoin
from megatrain.engine.engine import StreamingEngine
from megatrain.errors import GpuOutOfMemory
from megatrain.planning.builder import PlanBuilder, StepDown
from megatrain.recipes.step_down import (
    FIX,
    UPDATES_BEGUN,
    SamePlan,
    first_line,
    is_out_of_memory,
    outside_allocator,
    shortfall_bytes,
    smaller_plan,
    tier_to_host,
    where_failed,
)
from megatrain.store.host import HostStore

_FAILED = "megatrain/failed"  # a rank's error that ends the job (the rank's number)


class RankFailures:
    """Out-of-memory steps under several ranks: one rank's failure reaches every rank, and all
    step down together (the module docstring has the protocol)."""

    POLL_S = 0.2  # how often the watcher looks at the store while a step runs (2 keys a look)

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.store = job_store()
        self.generation = 0  # process groups joined since the first; the store keys' prefix
        self._lock = threading.Lock()
        self._aborted = -1  # the generation whose group this rank has aborted
        self._armed = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rank-failures", daemon=True)
        self._thread.start()

    def _key(self, generation: int | None = None) -> str:
        return f"megatrain/oom/{self.generation if generation is None else generation}"

    @contextmanager
    def watching(self) -> Iterator[None]:
        """While the body runs (a step, an engine build), another rank's announcement aborts
        this rank's process group."""
        self._armed.set()
        try:
            yield
        finally:
            self._armed.clear()

    def _watch(self) -> None:
        while not self._closed.is_set():
            if not self._armed.wait(0.5):
                continue
            generation = self.generation
            try:
                announced = self.store.check([self._key(generation)]) or self.store.check([_FAILED])
            except Exception:  # the store is gone: the job is ending
                return
            if announced:
                self._abort(generation)
            time.sleep(self.POLL_S)

    def _abort(self, generation: int) -> None:
        with self._lock:
            if generation == self.generation and self._aborted != generation:
                self._aborted = generation
                abort()

    def check(self) -> None:
        """Raise if another rank announced an out-of-memory step or an error: the engine's
        `before_updates`, so no update of a step that another rank failed is applied (on
        CUDA this rank's collectives, aborted, end without an error)."""
        if self.store.check([self._key()]) or self.failed_elsewhere():
            raise RuntimeError("another rank's step failed")

    def joins(self, error: BaseException) -> bool:
        """Whether `error` is part of an out-of-memory step: this rank's own, or what another
        rank's announcement (and the aborted group) made of this rank's step. A rank announces
        before it aborts its group, so a consequence here always finds the announcement."""
        return is_out_of_memory(error) or self.store.check([self._key()])

    def failed_elsewhere(self) -> bool:
        """Whether another rank stopped with an error of its own (it reports it)."""
        return self.store.check([_FAILED])

    def announce_failure(self) -> None:
        """This rank stops with an error that is not an out-of-memory step: the others, told
        through the store, abort their group and exit quietly instead of waiting inside a
        collective until its timeout."""
        self.store.set(_FAILED, str(self.placement.rank))
        self._abort(self.generation)

    def step_down(
        self,
        error: BaseException,
        *,
        step: int,
        builder: PlanBuilder,
        engine: StreamingEngine | None = None,
        store: HostStore | None = None,
        same_plan_ok: bool = False,
    ) -> StepDown | SamePlan:
        """`step_down` on every rank at once, after `joins(error)`: announce (this rank's own
        out of memory: the step), abort, undo this rank's part, join a new group, agree on the
        largest shortfall, step down; or keep the plan (`SamePlan`) where every rank that ran
        out of memory did so outside PyTorch's allocator and `same_plan_ok`."""
        own = is_out_of_memory(error)
        failed = self._key()
        shortfall = shortfall_bytes(error, builder.device) if own else 0
        if own:
            self.store.set(failed, str(step))
        self._abort(self.generation)
        begun = engine is not None and engine.updates_begun
        if engine is not None and not begun:
            engine.abandon_step()
        with self._lock:
            self.generation += 1
        rejoin(self.placement, self.generation)
        announced = int(self.store.get(failed))
        where = (
            f"{where_failed(error, announced)} on rank {self.placement.rank}"
            if own
            else f"step {announced} ran out of GPU memory on another rank"
        )
        # the same answers on every rank, from the new group
        if rank_max(int(begun or announced != step)):
            if own:
                raise GpuOutOfMemory(UPDATES_BEGUN.format(where=where, fix=FIX)) from error
            raise SystemExit(1)  # the rank that ran out of memory says why
        # a rank whose own failure was the allocator's rules the plan smaller for good
        allocator = rank_max(int(own and not outside_allocator(error)))
        if same_plan_ok and not allocator:
            return SamePlan(first_line(error) if own else "on another rank")
        shortfall = rank_max(shortfall)
        try:
            change = smaller_plan(builder, shortfall, where, error if own else None)
        except GpuOutOfMemory:
            if own:
                raise
            raise SystemExit(1) from None
        change = dataclasses.replace(change, transient=not allocator)
        tier_to_host(builder, engine.store if engine is not None else store, change)
        return change

    def close(self) -> None:
        self._closed.set()
