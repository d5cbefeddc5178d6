"""Where each layer's saved input (its boundary activation) waits between forward and backward.

A `BoundaryPlan` gives every decoder layer one place for its input:
- "gpu": kept on the device, as the plain schedule does;
- "host": copied to a host buffer (pinned on CUDA) on an offload stream of its own while the
  next layer computes, and copied back, on a second stream, during the backward of the kept
  layer above it (the backward's previous segment start);
- "none": not kept. Layer i's input is recomputed in the backward from the nearest kept input
  j < i by running layers j .. i-1 forward again (with their forward RNG states).

Kept layers are every `every`-th (0, K, 2K, ...): a segment is a kept layer and the dropped
ones after it. The backward visits segments last to first; inside a segment it first re-runs
layers j .. e-1 forward (keeping their outputs on the device) and then runs the backward of
e .. j (`backward_uses`). On the CPU the "host" copy is a copy into a separate buffer, so the
same code path runs in CI.

Invariants: layer 0's input is always kept; a host buffer is reused across steps (pinned
allocation is slow) and is rewritten only after its previous copy back to the device is done;
a device tensor handed to a copy stream is recorded on it, so the allocator never reuses its
memory before the copy ends.

Shapes: B = rows, S = sequence, D = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.engine.transfers import DONE, Event, Transfers
from megatrain.store.memory import host_zeros

PLACES = ("gpu", "host", "none")


@dataclass(frozen=True)
class BoundaryPlan:
    """Per layer, where its saved input lives; `every`: one kept every K layers."""

    places: tuple[str, ...]
    every: int = 1

    @staticmethod
    def make(num_layers: int, *, every: int = 1, on_host: int = 0) -> BoundaryPlan:
        """Keep layers 0, K, 2K, ...; the first `on_host` of them go to the host (the last
        ones, which the backward needs first, stay on the device)."""
        assert num_layers >= 1 and every >= 1 and on_host >= 0
        places = []
        kept = 0
        for i in range(num_layers):
            if i % every:
                places.append("none")
            else:
                places.append("host" if kept < on_host else "gpu")
                kept += 1
        return BoundaryPlan(tuple(places), every)

    @staticmethod
    def on_device(num_layers: int) -> BoundaryPlan:
        return BoundaryPlan.make(num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.places)

    def count(self, place: str) -> int:
        return sum(p == place for p in self.places)

    def starts(self) -> list[int]:
        """Kept layers: the first layer of every segment, ascending."""
        return [i for i, p in enumerate(self.places) if p != "none"]

    def backward_uses(self) -> list[tuple[int, bool]]:
        """The backward's layer visits in order: (layer, True) re-runs its forward,
        (layer, False) runs its backward."""
        starts = self.starts()
        ends = [s - 1 for s in starts[1:]] + [self.num_layers - 1]
        uses: list[tuple[int, bool]] = []
        for start, end in reversed(list(zip(starts, ends, strict=True))):
            uses += [(i, True) for i in range(start, end)]
            uses += [(i, False) for i in range(end, start - 1, -1)]
        return uses

    def describe(self) -> str:
        return (
            f"{self.num_layers} layer inputs: {self.count('gpu')} kept on the GPU, "
            f"{self.count('host')} offloaded to host memory, {self.count('none')} recomputed "
            f"(one kept every {self.every} layers)"
        )

    def __post_init__(self) -> None:
        assert self.places and self.places[0] != "none", "layer 0's input is always kept"
        assert all(p in PLACES for p in self.places), self.places


class Boundaries:
    """The step's saved inputs per (micro-batch, layer), wherever the plan puts them."""

    def __init__(self, plan: BoundaryPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        # own streams: offloads and prefetches never queue behind weight or gradient copies
        self.transfers = Transfers(device)
        self._host: dict[tuple[int, int], torch.Tensor] = {}  # reused across steps
        self._host_ready: dict[tuple[int, int], Event] = {}  # offload copy done
        self._host_free: dict[tuple[int, int], Event] = {}  # copy back done: may be rewritten
        self._fetched: dict[tuple[int, int], tuple[torch.Tensor, Event]] = {}

    def keeps_on_device(self, layer: int) -> bool:
        return self.plan.places[layer] == "gpu"

    def save(self, mb: int, layer: int, x_BSD: torch.Tensor) -> torch.Tensor | None:
        """Layer `layer`'s input of micro-batch `mb` in the forward: returned when it stays on
        the device, else offloaded (returns None) or dropped."""
        place = self.plan.places[layer]
        if place == "gpu":
            return x_BSD
        if place == "host":
            key = (mb, layer)
            buf = self._host.get(key)
            if buf is None or buf.shape != x_BSD.shape or buf.dtype != x_BSD.dtype:
                # huge pages, page-locked on CUDA (what the estimate counts as pinned_reserved)
                pin = self.transfers.is_cuda
                buf = host_zeros(x_BSD.numel(), x_BSD.dtype, pin=pin).view(x_BSD.shape)
                self._host[key] = buf
            self._fetched.pop(key, None)  # a copy back left over by an interrupted step
            # sync point (host): the last step's copy back out of this buffer, long done
            self._host_free.pop(key, DONE).synchronize()
            self._host_ready[key] = self.transfers.d2h(
                buf, x_BSD, after=self.transfers.compute_event()
            )
        return None

    def prefetch(self, mb: int, layer: int) -> None:
        """Start copying an offloaded input back to the device (no-op for other places)."""
        key = (mb, layer)
        if self.plan.places[layer] != "host" or key in self._fetched:
            return
        # after the offload copy into buf is done (and the compute queued so far: h2d_new)
        x, ready = self.transfers.h2d_new(self._host[key], after=self._host_ready.pop(key))
        self._host_free[key] = ready
        self._fetched[key] = (x, ready)

    def take(self, mb: int, layer: int) -> torch.Tensor:
        """An offloaded input back on the device; the compute stream waits for its copy."""
        self.prefetch(mb, layer)
        x, ready = self._fetched.pop((mb, layer))
        self.transfers.wait(ready)  # sync point (GPU side): the copy back is done
        return x
