"""The RNG states a checkpoint carries, as JSON-safe strings (trainer_state.json's "rng").

`rng_state()` captures torch's CPU generator and, where CUDA is available, the current device's;
`set_rng_state(rng_state())` restores exactly those, so the dropout masks and samples drawn
after a resume are the ones the uninterrupted run drew. A state saved with CUDA and restored
without it restores the CPU generator alone.
"""

from __future__ import annotations

import base64

import torch


def rng_state() -> dict[str, str]:
    state = {"cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, str]) -> None:
    torch.set_rng_state(_unb64(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
