"""Shared by the kill-and-resume tests: a run interrupted inside a given optimizer step."""

from __future__ import annotations

from typing import Any

import pytest


def crash_during_step(trainer: Any, step: int) -> list[float]:
    """Train until the start of optimizer step `step` (1-based), then raise KeyboardInterrupt
    inside it, as a kill would; close the trainer and return the losses of the steps before."""
    real_step, seen = trainer.engine.train_step, []

    def dies(*args: object, **kwargs: object) -> object:
        if len(seen) == step - 1:
            raise KeyboardInterrupt
        result = real_step(*args, **kwargs)
        seen.append(result.loss)
        return result

    trainer.engine.train_step = dies
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trainer.close()
    return seen
