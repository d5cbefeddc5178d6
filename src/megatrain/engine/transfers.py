"""Copy streams and events, or their synchronous stand-ins on the CPU.

On CUDA, host-to-device weight copies run on one stream and device-to-host gradient copies on
another, so both directions of the PCIe link work at once, beside the compute stream. Every
copy returns an event; whoever consumes the copied data waits on that event (compute stream:
`wait`, a host thread: `synchronize`). On the CPU the copy happens at once and its event is
already complete: the engine's code path is the same on both devices.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Event(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class _DoneEvent:
    """A CPU stand-in for a CUDA event whose work is already finished."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE: Event = _DoneEvent()


class Transfers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)

    def compute_event(self) -> Event:
        """An event marking 'compute issued so far is done' (e.g. a slot is free again)."""
        if not self.is_cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Event | None) -> None:
        """Make the compute stream wait for `event` (no host block). Sync point (GPU side)."""
        if self.is_cuda and event is not None and event is not DONE:
            torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        return self._copy(dst, src, (after,), self.h2d_stream if self.is_cuda else None)

    def h2d_new(
        self, src: torch.Tensor, dtype: torch.dtype | None = None, *, after: Event | None = None
    ) -> tuple[torch.Tensor, Event]:
        """A new device tensor holding host `src` (in `dtype`, default src's) and its copy's
        event; the copy also waits for `after`. The tensor's memory comes from the compute
        stream's pool, and the caching allocator hands a block back the moment the compute
        stream frees it, while kernels queued there may still write it: the copy waits for the
        compute issued so far, or it lands before such a write and is overwritten (a
        micro-batch's embedding rows took values of +-3.4e38 and infinities that way while the
        GPU update share loaded the GPU: docs/optimizer_states.md, "The share's NaN")."""
        dtype = src.dtype if dtype is None else dtype
        dst = torch.empty(src.shape, dtype=dtype, device=self.device)
        stream = self.h2d_stream if self.is_cuda else None
        return dst, self._copy(dst, src, (after, self.compute_event()), stream)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        return self._copy(dst, src, (after,), self.d2h_stream if self.is_cuda else None)

    def _copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        after: tuple[Event | None, ...],
        stream: torch.cuda.Stream | None,
    ) -> Event:
        """`src` into `dst` on `stream` once every event of `after` is done (None: at once)."""
        if stream is None:
            dst.copy_(src)
            return DONE
        with torch.cuda.stream(stream):
            for event in after:
                if event is not None and event is not DONE:
                    stream.wait_event(event)  # type: ignore[arg-type]  # sync point (GPU side)
            dst.copy_(src, non_blocking=True)
            # The copy reads/writes memory the caching allocator gave to the compute stream.
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event
