"""Where one optimizer step's time went.

Host-side phases are wall-clock (time.perf_counter). On CUDA, compute and the gaps in which the
compute stream waited for weights are read from events recorded around every layer's compute,
after the step's final sync, so measuring adds no sync point of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timeline:
    step_s: float = 0.0  # wall clock of the whole step on the host
    forward_s: float = 0.0  # host time in the forward phase (issue + waits)
    loss_s: float = 0.0
    backward_s: float = 0.0
    compute_s: float = 0.0  # GPU busy with layer and loss compute (events; host time on CPU)
    wait_weights_s: float = 0.0  # compute stream idle, waiting for a layer's weights (CUDA)
    wait_optimizer_s: float = 0.0  # host blocked on a block's CPU update before its copy
    optimizer_s: float = 0.0  # CPU time spent in AdamW updates that finished in this step
    # the GPU update share's updates waited for in this step: their GPU span, copies in and
    # back included (CUDA events; host time on the CPU)
    gpu_update_s: float = 0.0
    # the GPU tier's AdamW, queued on the compute stream (events; host time on the CPU): GPU
    # work of the step that is not layer compute, so not in compute_s
    tier_update_s: float = 0.0
    # GPU time of each phase (compute-stream events; host time on the CPU): the host phases
    # above end when their work is issued, so queued GPU work shows up in the next one
    forward_gpu_s: float = 0.0
    loss_gpu_s: float = 0.0
    backward_gpu_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.__dict__.items() if not k.startswith("_")}

    def summary(self) -> str:
        return (
            f"step {self.step_s:.3f}s = compute {self.compute_s:.3f} | wait weights "
            f"{self.wait_weights_s:.3f} | wait optimizer {self.wait_optimizer_s:.3f} | "
            f"loss {self.loss_s:.3f} | host {self.host_s:.3f} (optimizer ran "
            f"{self.optimizer_s:.3f}s on the CPU)"
        )

    @property
    def host_s(self) -> float:
        """What the step spent beyond GPU compute and waits: launch overhead, gathers, syncs."""
        return max(0.0, self.step_s - self.compute_s - self.wait_weights_s - self.wait_optimizer_s)


class ComputeTimer:
    """Brackets each compute region; CUDA events on the GPU, host clocks on the CPU.

    Each region records three events on the compute stream: before it waits for its inputs'
    copies (P), after the wait (Q) and after its compute (E). Q - P is time the GPU waited for
    weights; E - Q is compute; P - previous E is time the GPU waited for the host.
    """

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self._regions: list[list[torch.cuda.Event]] = []
        self._host_s = 0.0
        self._t0 = 0.0
        self._marks: list[tuple[float, torch.cuda.Event | None]] = []
        self._updates: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._update_host_s = 0.0

    def update(self, run: Callable[[], object]) -> None:
        """Brackets optimizer work `run` queues on the compute stream (the GPU tier's AdamW);
        read into `tier_update_s`. On the CPU, its host time."""
        if not self.is_cuda:
            t0 = time.perf_counter()
            run()
            self._update_host_s += time.perf_counter() - t0
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        run()
        after.record()
        self._updates.append((before, after))

    def mark(self) -> float:
        """A phase boundary (train_step: start, after forward, loss, backward); returns the
        host clock. On CUDA also an event on the compute stream (no sync)."""
        event = None
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        now = time.perf_counter()
        self._marks.append((now, event))
        return now

    def start(self, wait: Callable[[], object] | None = None) -> None:
        if not self.is_cuda:
            if wait is not None:
                wait()
            self._t0 = time.perf_counter()
            return
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        if wait is not None:
            wait()
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        self._regions.append([before, after])

    def stop(self) -> None:
        if not self.is_cuda:
            self._host_s += time.perf_counter() - self._t0
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._regions[-1].append(end)

    def read(self, timeline: Timeline) -> None:
        """Fill compute and weight-wait times; call after the step's final sync."""
        phases = [
            (b[0] - a[0]) if a[1] is None or b[1] is None else a[1].elapsed_time(b[1]) / 1e3
            for a, b in zip(self._marks, self._marks[1:], strict=False)
        ]
        if len(phases) == 3:
            timeline.forward_gpu_s, timeline.loss_gpu_s, timeline.backward_gpu_s = phases
        if not self.is_cuda:
            timeline.compute_s = self._host_s
            timeline.tier_update_s = self._update_host_s
            return
        timeline.tier_update_s = sum(a.elapsed_time(b) for a, b in self._updates) / 1e3
        busy = waited = 0.0
        for before, after, end in self._regions:
            waited += before.elapsed_time(after) / 1e3
            busy += after.elapsed_time(end) / 1e3
        timeline.compute_s = busy
        timeline.wait_weights_s = waited
