"""Which torch device a run uses ("auto": the GPU when there is one, else the CPU)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} asked for, but CUDA is not available here; "
            "use device cpu (training.device: cpu, or --device cpu)"
        )
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
    return name
