"""Host worker that applies each block's AdamW update as soon as its gradient has landed.

The main thread drives the GPU; this thread waits for a block's device-to-host gradient copy
(its event) and runs the update, so the CPU optimizer overlaps GPU work. Updates run in
submission order on one thread (the kernel itself is multi-threaded). The next step's copy of a
block to the GPU waits for that block's update only (`wait(block)`), not for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from megatrain.engine.transfers import Event
from megatrain.optim.adamw import CpuAdamW
from megatrain.store.blocks import ParamBlock


class UpdateWorker:
    def __init__(self, optimizer: CpuAdamW, *, threaded: bool = True) -> None:
        self.optimizer = optimizer
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="megatrain-adamw")
                      if threaded else None)
        self._pending: dict[str, Future[float]] = {}
        # Called with each block once its gradient has landed, before its update (verify, tests).
        self.on_landed: Callable[[ParamBlock], None] | None = None
        self.busy_s = 0.0  # CPU seconds spent in updates collected by wait()

    def submit(self, block: ParamBlock, landed: Event, *, lr: float, grad_scale: float) -> None:
        assert block.name not in self._pending, f"{block.name}: previous update not collected"
        if self._pool is None:
            self.busy_s += self._run(block, landed, lr, grad_scale)
            return
        self._pending[block.name] = self._pool.submit(self._run, block, landed, lr, grad_scale)

    def _run(self, block: ParamBlock, landed: Event, lr: float, grad_scale: float) -> float:
        landed.synchronize()  # sync point: this block's gradient copy to the host is complete
        if self.on_landed is not None:
            self.on_landed(block)
        t0 = time.perf_counter()
        self.optimizer.update(block, lr=lr, grad_scale=grad_scale)
        return time.perf_counter() - t0

    def wait(self, block: ParamBlock) -> float:
        """Block the host until `block`'s update is done; returns the seconds spent waiting."""
        future = self._pending.pop(block.name, None)
        if future is None:
            return 0.0
        t0 = time.perf_counter()
        self.busy_s += future.result()  # sync point (host): re-raises a failed update
        return time.perf_counter() - t0

    def wait_all(self, blocks: list[ParamBlock]) -> float:
        return sum(self.wait(b) for b in blocks)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
