"""The node's memory in use while a command runs (bench/run.py, bench/cli_train.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def node_used_gib() -> float | None:
    """The node's memory in use (MemTotal - MemAvailable, /proc/meminfo), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[1:2]}
    except (OSError, ValueError):
        return None
    return (kib["MemTotal"] - kib["MemAvailable"]) / 2**20


class NodeMemory:
    """The node's peak memory in use, sampled every `every_s` seconds until `stop()`; with
    `only_when`, only the samples taken while it returns True count (`peak` stays None until
    one does).

    Under torchrun the sum of each rank's own peak RSS overstates the node's peak when the
    ranks peak at different times (loading in turns), and rank 0's RSS alone is not the node's:
    this is what the host actually held."""

    def __init__(self, every_s: float = 1.0, only_when: Callable[[], bool] | None = None) -> None:
        self.before = node_used_gib()
        self.peak = None if only_when else self.before
        self._only_when = only_when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            if self._only_when is not None and not self._only_when():
                continue
            used = node_used_gib()
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        if self.before is None or self.peak is None:
            return "node memory: not readable here"
        return f"node memory in use: {self.before:.1f} GiB before, peak {self.peak:.1f} GiB"
