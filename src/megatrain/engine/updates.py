"""Host worker that applies each block's AdamW update as soon as its gradient has landed.

The main thread drives the GPU; this thread waits for blocks' device-to-host gradient copies
and runs their updates, so the CPU optimizer overlaps GPU work. Among the blocks whose gradient
has landed it always takes the one the next forward needs first (lowest forward position:
embedding, layer 0, layer 1, ..., head): the backward delivers gradients last layer first, and
when the optimizer lags behind it, the next forward can start on layer 0 while the updates of
later layers are still running. The next step's copy of a block to the GPU waits for that
block's update only (`wait(block)`).

Gradient copies complete in the order they were issued (one copy stream), so the oldest pending
task is the first to land; when none has landed the worker blocks on that one's event.

Every error reaches the thread that waits: an update's (or `on_landed`'s) is raised by `wait`
for that block; one that stops the worker itself (a failing event query) fails every pending
and later task, so no `wait` blocks forever on a dead thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatrain.engine.transfers import Event
from megatrain.optim.adamw import CpuAdamW
from megatrain.store.blocks import ParamBlock


@dataclass
class _Task:
    order: int  # forward position of the block: lower runs first once landed
    seq: int  # submission order: the order gradients land in
    block: ParamBlock
    landed: Event
    lr: float
    grad_scale: float
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seconds: float = 0.0


class UpdateWorker:
    def __init__(self, optimizer: CpuAdamW, *, threaded: bool = True) -> None:
        self.optimizer = optimizer
        # Called with each block once its gradient has landed, before its update (verify, tests).
        self.on_landed: Callable[[ParamBlock], None] | None = None
        self.busy_s = 0.0  # CPU seconds spent in updates collected by wait()
        self._tasks: dict[str, _Task] = {}  # submitted, not yet collected by wait()
        self._queue: list[_Task] = []  # submitted, not yet started
        self._seq = 0
        self._cond = threading.Condition()
        self._closed = False
        self._dead: BaseException | None = None  # what stopped the worker thread, if anything
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="megatrain-adamw", daemon=True)
            self._thread.start()

    def submit(
        self, block: ParamBlock, landed: Event, *, order: int, lr: float, grad_scale: float
    ) -> None:
        assert block.name not in self._tasks, f"{block.name}: previous update not collected"
        task = _Task(
            order=order, seq=self._seq, block=block, landed=landed, lr=lr, grad_scale=grad_scale
        )
        self._seq += 1
        self._tasks[block.name] = task
        if self._thread is None:
            self._run(task)
            return
        with self._cond:
            if self._dead is not None:
                task.error = self._dead
                task.done.set()
                return
            self._queue.append(task)
            self._cond.notify()

    def wait(self, block: ParamBlock) -> float:
        """Block the host until `block`'s update is done; returns the seconds spent waiting."""
        task = self._tasks.pop(block.name, None)
        if task is None:
            return 0.0
        t0 = time.perf_counter()
        task.done.wait()  # sync point (host): this block's update has been applied
        waited = time.perf_counter() - t0
        self.busy_s += task.seconds
        if task.error is not None:
            raise RuntimeError(f"optimizer update of {block.name} failed") from task.error
        return waited

    def wait_all(self, blocks: list[ParamBlock]) -> float:
        return sum(self.wait(b) for b in blocks)

    def close(self) -> None:
        if self._thread is not None:
            with self._cond:
                self._closed = True
                self._cond.notify()
            self._thread.join()

    def _next(self) -> _Task | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            landed = [t for t in self._queue if t.landed.query()]
            if landed:
                task = min(landed, key=lambda t: t.order)
            else:
                task = min(self._queue, key=lambda t: t.seq)
            self._queue.remove(task)
            return task

    def _loop(self) -> None:
        try:
            while (task := self._next()) is not None:
                self._run(task)
        except BaseException as e:  # the worker stops: fail what waits on it instead of hanging
            with self._cond:
                self._dead = e
                for task in self._queue:
                    task.error = e
                    task.done.set()
                self._queue.clear()

    def _run(self, task: _Task) -> None:
        try:
            task.landed.synchronize()  # sync point: this block's gradient is on the host
            if self.on_landed is not None:
                self.on_landed(task.block)
            t0 = time.perf_counter()
            self.optimizer.update(task.block, lr=task.lr, grad_scale=task.grad_scale)
            task.seconds = time.perf_counter() - t0
        except BaseException as e:  # handed to the thread that waits for this block
            task.error = e
        finally:
            task.block.release_landing()  # a shared landing (clipping off) is free again
            task.done.set()
