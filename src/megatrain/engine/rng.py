"""Random numbers in training layers (dropout, router jitter): the backward's recompute of a
layer must draw exactly what its forward drew.

The forward saves the CPU (and CUDA) RNG state before each layer call of each micro-batch; the
recompute restores it, runs, and puts the live state back, so masks match and the random stream
of everything after is unchanged (as torch.utils.checkpoint does). Models without randomness
skip all of it (`uses_randomness`).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from megatrain.model.structure import ModelStructure


def uses_randomness(structure: ModelStructure) -> bool:
    """Whether layers may draw random numbers in training (dropout, router jitter)."""
    return bool(random_config_keys(structure.causal_lm.config))


def random_config_keys(config: PretrainedConfig) -> dict[str, float]:
    """The config's nonzero dropout / jitter probabilities: what makes training draw randoms."""
    return {
        key: value
        for key, value in config.get_text_config().to_dict().items()
        if ("dropout" in key or "jitter" in key) and isinstance(value, float) and value > 0
    }


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class restored_rng:
    """Run a layer's recompute with the RNG state its forward saw (identical dropout masks)."""

    def __init__(self, device: torch.device, state: tuple | None) -> None:
        self.device, self.state = device, state

    def __enter__(self) -> None:
        if self.state is None:
            return
        self._saved = rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: object) -> None:
        if self.state is None:
            return
        torch.set_rng_state(self._saved[0])
        if self._saved[1] is not None:
            torch.cuda.set_rng_state(self._saved[1], self.device)
