"""The rollout's device copy of the model is gone before the training phase begins
(recipes/grpo/rollout.py `device_model`), on both decode paths, without waiting for the garbage
collector: the training plan leaves the GPU no room for it (docs/performance.md run 44 asks
whether a GPU run keeps it)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_grpo_lifecycle import _trainer

import megatrain.recipes.grpo.rollout_phase as grpo_recipe  # where the rollout builds it


@pytest.mark.parametrize("decode", ["graphs", "false"])
def test_the_rollout_copy_is_freed_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decode: str
) -> None:
    copies: list[weakref.ref[Any]] = []
    made = grpo_recipe.device_model

    @contextmanager
    def device_model(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with made(*args, **kwargs) as model:
            copies.extend(weakref.ref(p) for p in model.parameters())
            yield model

    monkeypatch.setattr(grpo_recipe, "device_model", device_model)
    trainer = _trainer(
        tmp_path / "o", tmp_path, "--training.max_steps", "1", "--grpo.compile_decode", decode
    )
    alive: list[int] = []
    step = trainer.optimizer_step

    def optimizer_step(*args: Any, **kwargs: Any) -> Any:
        alive.append(sum(ref() is not None for ref in copies))
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "optimizer_step", optimizer_step)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert copies and alive == [0]
