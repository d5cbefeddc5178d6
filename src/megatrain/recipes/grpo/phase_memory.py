"""The GPU memory of each phase of a GRPO step (rollout, log-prob passes, training), for its
metrics (`gpu_start_gib/<phase>`, `gpu_peak_gib/<phase>`, docs/grpo.md); nothing off CUDA.
Starting a measurement resets PyTorch's peak statistics of the device: one phase at a time."""

from __future__ import annotations

import torch


class PhasePeak:
    """One phase's GPU memory on CUDA: what was allocated as it began, and the most allocated
    from then until `record`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.start = 0
        if self.device is not None:
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def record(self, phase: str) -> dict[str, float]:
        """The phase's metrics, `gpu_start_gib/<phase>` and `gpu_peak_gib/<phase>` (none off
        CUDA); before anything else resets the peak statistics (memory_record does)."""
        if self.device is None:
            return {}
        peak = torch.cuda.max_memory_allocated(self.device)
        return {
            f"gpu_start_gib/{phase}": round(self.start / 2**30, 2),
            f"gpu_peak_gib/{phase}": round(peak / 2**30, 2),
        }
