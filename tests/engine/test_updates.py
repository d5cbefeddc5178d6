"""UpdateWorker: which landed block it updates first, waiting, errors, threaded vs not.

The worker is under test, not the optimizer, so most tests give it a recording optimizer with
CpuAdamW's `update(block, lr=, grad_scale=)` interface, and gradient-copy events that the test
opens by hand (`Gate`): that is how a test controls which gradients have "landed" when the
worker picks its next task. Threaded and unthreaded runs are compared with the real CpuAdamW.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatrain.engine.transfers import DONE, Event
from megatrain.engine.updates import UpdateWorker
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock

TIMEOUT_S = 10.0  # only reached when the worker is broken (hung); passing runs take ms


class Gate:
    """A gradient copy that lands when the test opens it (an Event, like a CUDA event)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.waited_on = threading.Event()  # set once the worker blocks on this copy

    def open(self) -> None:
        self._open.set()

    def query(self) -> bool:
        return self._open.is_set()

    def synchronize(self) -> None:
        self.waited_on.set()
        assert self._open.wait(TIMEOUT_S), "gate never opened"


class RecordingOptimizer:
    """Records each update as (block name, lr, grad_scale); optionally fails on one block."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, float, float]] = []
        self.fail_on = fail_on

    def update(self, block: ParamBlock, *, lr: float, grad_scale: float = 1.0) -> None:
        if block.name == self.fail_on:
            raise FloatingPointError(f"bad gradient in {block.name}")
        self.calls.append((block.name, lr, grad_scale))


NAMES = ["embed", "layer.0", "layer.1", "layer.2", "head"]  # forward order
ORDER = {name: i for i, name in enumerate(NAMES)}


def _block(name: str, n: int = 0, seed: int = 0) -> ParamBlock:
    gen = torch.Generator().manual_seed(seed)
    return ParamBlock(
        name=name,
        entries=[],
        numel=n,
        decay_numel=n // 2,
        master=torch.randn(n, generator=gen),
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
        grad=torch.randn(n, generator=gen),
    )


def _worker(optimizer: object, threaded: bool = True) -> UpdateWorker:
    return UpdateWorker(optimizer, threaded=threaded)


def _submit(worker: UpdateWorker, block: ParamBlock, landed: Event, lr: float = 1e-3) -> None:
    worker.submit(block, landed, order=ORDER[block.name], lr=lr, grad_scale=0.5)


def test_landed_blocks_update_in_forward_order() -> None:
    """Backward delivers head, layer.2, ..., embed; once they have all landed, the worker takes
    them lowest forward position first (what the next forward needs first)."""
    opt, blocks = RecordingOptimizer(), {n: _block(n) for n in NAMES}
    worker = _worker(opt)
    head_gate = Gate()
    _submit(worker, blocks["head"], head_gate)
    assert head_gate.waited_on.wait(TIMEOUT_S)  # the worker is busy with the head
    for name in reversed(NAMES[:-1]):
        _submit(worker, blocks[name], DONE)
    head_gate.open()
    worker.wait_all(list(blocks.values()))
    worker.close()
    assert [c[0] for c in opt.calls] == ["head", "embed", "layer.0", "layer.1", "layer.2"]
    assert all(c[1:] == (1e-3, 0.5) for c in opt.calls)


def test_only_landed_blocks_jump_the_queue() -> None:
    """Among queued tasks only landed ones are picked by forward position; with none landed
    the worker blocks on the oldest submission (the copy that lands first)."""
    opt, blocks = RecordingOptimizer(), {n: _block(n) for n in NAMES}
    worker = _worker(opt)
    gates = {name: Gate() for name in ("head", "layer.1", "embed")}
    _submit(worker, blocks["head"], gates["head"])
    assert gates["head"].waited_on.wait(TIMEOUT_S)
    _submit(worker, blocks["layer.2"], DONE)
    _submit(worker, blocks["layer.1"], gates["layer.1"])
    _submit(worker, blocks["layer.0"], DONE)
    _submit(worker, blocks["embed"], gates["embed"])
    gates["head"].open()
    # head, then the landed ones by position (layer.0, layer.2), then the oldest unlanded
    assert gates["layer.1"].waited_on.wait(TIMEOUT_S)
    gates["embed"].open()  # lands while the worker is committed to layer.1
    gates["layer.1"].open()
    worker.wait_all(list(blocks.values()))
    worker.close()
    assert [c[0] for c in opt.calls] == ["head", "layer.0", "layer.2", "layer.1", "embed"]


def test_wait_returns_only_after_that_blocks_update() -> None:
    opt, gate = RecordingOptimizer(), Gate()
    worker, block = _worker(opt), _block("layer.1")
    _submit(worker, block, gate)
    waiter = threading.Thread(target=worker.wait, args=(block,), daemon=True)
    waiter.start()
    assert gate.waited_on.wait(TIMEOUT_S)
    waiter.join(0.05)
    assert waiter.is_alive() and opt.calls == []  # gradient not landed: still waiting
    gate.open()
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive()
    assert opt.calls == [("layer.1", 1e-3, 0.5)]
    assert worker.wait(block) == 0.0  # collected: a second wait returns at once
    worker.close()


def test_wait_all_collects_every_block_and_busy_time() -> None:
    opt, blocks = RecordingOptimizer(), [_block(n) for n in NAMES]
    worker = _worker(opt)
    for block in reversed(blocks):
        _submit(worker, block, DONE)
    worker.wait_all(blocks)
    assert sorted(c[0] for c in opt.calls) == sorted(NAMES)
    assert worker.busy_s > 0.0
    assert worker._tasks == {}
    worker.close()


def test_on_landed_is_called_with_each_block_before_its_update() -> None:
    opt, blocks = RecordingOptimizer(), [_block(n) for n in NAMES]
    worker = _worker(opt)
    seen: list[tuple[str, int]] = []
    worker.on_landed = lambda block: seen.append((block.name, len(opt.calls)))
    gate = Gate()
    _submit(worker, blocks[-1], gate)
    assert gate.waited_on.wait(TIMEOUT_S)
    for block in reversed(blocks[:-1]):
        _submit(worker, block, DONE)
    gate.open()
    worker.wait_all(blocks)
    worker.close()
    # called once per block, in update order, each before that block's update
    assert [name for name, _ in seen] == [c[0] for c in opt.calls]
    assert [done for _, done in seen] == list(range(len(NAMES)))


def test_close_joins_the_thread_after_draining_the_queue() -> None:
    opt, blocks = RecordingOptimizer(), [_block(n) for n in NAMES]
    worker = _worker(opt)
    for block in reversed(blocks):
        _submit(worker, block, DONE)
    thread = worker._thread
    assert thread is not None and thread.is_alive()
    worker.close()
    assert not thread.is_alive()
    assert sorted(c[0] for c in opt.calls) == sorted(NAMES)  # nothing submitted is dropped


@pytest.mark.parametrize("threaded", [True, False])
def test_optimizer_error_reaches_the_waiting_caller(threaded: bool) -> None:
    opt = RecordingOptimizer(fail_on="layer.1")
    worker, blocks = _worker(opt, threaded), [_block(n) for n in NAMES]
    for block in reversed(blocks):
        _submit(worker, block, DONE)
    with pytest.raises(RuntimeError, match=r"layer\.1") as info:
        worker.wait(blocks[2])
    assert isinstance(info.value.__cause__, FloatingPointError)
    # the other blocks are updated and the worker keeps serving
    worker.wait_all(blocks)
    assert sorted(c[0] for c in opt.calls) == sorted(set(NAMES) - {"layer.1"})
    _submit(worker, blocks[2], DONE)
    with pytest.raises(RuntimeError, match=r"layer\.1"):
        worker.wait(blocks[2])
    worker.close()


def test_on_landed_error_reaches_the_waiting_caller() -> None:
    opt, block = RecordingOptimizer(), _block("head")
    worker = _worker(opt)

    def boom(b: ParamBlock) -> None:
        raise ValueError(f"check of {b.name} failed")

    worker.on_landed = boom
    _submit(worker, block, DONE)
    with pytest.raises(RuntimeError, match="head") as info:
        worker.wait(block)
    assert isinstance(info.value.__cause__, ValueError) and opt.calls == []
    worker.close()


class BrokenEvent:
    """A copy whose status check fails (a CUDA error surfacing at cudaEventQuery)."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def synchronize(self) -> None:
        self.query()


def test_failing_event_query_reaches_the_caller_instead_of_hanging() -> None:
    opt, blocks = RecordingOptimizer(), [_block("layer.0"), _block("layer.1")]
    worker = _worker(opt)
    gate = Gate()
    _submit(worker, blocks[0], gate)
    assert gate.waited_on.wait(TIMEOUT_S)
    _submit(worker, blocks[1], BrokenEvent())  # queried when the worker picks its next task
    gate.open()
    errors: list[BaseException] = []

    def wait_both() -> None:
        for block in blocks:
            try:
                worker.wait(block)
            except RuntimeError as e:
                errors.append(e)

    waiter = threading.Thread(target=wait_both, daemon=True)
    waiter.start()
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive(), "wait() hung after the worker thread died"
    assert [c[0] for c in opt.calls] == ["layer.0"]
    assert len(errors) == 1 and "illegal memory access" in str(errors[0].__cause__)
    # later submissions fail at once with the same error rather than queue forever
    _submit(worker, blocks[0], DONE)
    with pytest.raises(RuntimeError, match=r"layer\.0"):
        worker.wait(blocks[0])
    worker.close()


def test_threaded_and_unthreaded_give_identical_weights() -> None:
    """Each block's update depends only on that block: order and thread change nothing."""
    hyper = AdamWHyper(betas=(0.9, 0.95), weight_decay=0.1)
    results = []
    for threaded in (True, False):
        blocks = [_block(n, n=257 + 64 * i, seed=i) for i, n in enumerate(NAMES)]
        worker = UpdateWorker(CpuAdamW(hyper), threaded=threaded)
        for step in range(3):
            for block in reversed(blocks):
                _submit(worker, block, DONE, lr=1e-2 / (step + 1))
            worker.wait_all(blocks)
        worker.close()
        results.append(blocks)
    for a, b in zip(*results, strict=True):
        assert a.step == b.step == 3
        assert not torch.equal(a.master, _block(a.name, a.numel, NAMES.index(a.name)).master)
        assert torch.equal(a.master, b.master)
        assert torch.equal(a.exp_avg, b.exp_avg) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
