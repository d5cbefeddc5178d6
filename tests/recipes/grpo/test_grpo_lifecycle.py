"""`megatrain grpo` shares the base recipe's lifecycle (recipes/base.py): its disk check (the KL
reference counted), the world-size check on resume, and Ctrl-C's message naming the last
checkpoint and the resume flag."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import pytest
from test_grpo_command import DEMO, TINY, _reward_file

from megatrain import disk_space
from megatrain.checkpoint.output_dir import TrainingInterrupted
from megatrain.config import load_config
from megatrain.recipes.grpo.recipe import GRPOTrainer

_Usage = namedtuple("_Usage", "total used free")


def _trainer(out: Path, tmp: Path, *extra: str) -> GRPOTrainer:
    reward = _reward_file(tmp)
    overrides = [*TINY, "--training.output_dir", str(out), "--grpo.reward_funcs", f"[{reward}]"]
    return GRPOTrainer(load_config(DEMO, [*overrides, *extra]))


def _tensor_bytes(folder: Path) -> int:
    total = 0
    for file in folder.rglob("*.safetensors"):
        raw = file.read_bytes()
        total += len(raw) - 8 - int.from_bytes(raw[:8], "little")
    return total


def test_disk_check_counts_the_reference_and_matches_the_checkpoint(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "o", tmp_path, "--training.max_steps", "1", "--grpo.beta", "0.5")
    try:
        predicted = trainer.checkpoint_bytes()
        reference = trainer.extra_checkpoint_bytes()
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary.checkpoint is not None
    assert (summary.checkpoint / "reference.safetensors").is_file()
    assert reference == 4 * trainer.builder.spec.total_params  # fp32 compute on the CPU
    assert _tensor_bytes(summary.checkpoint) == predicted


def test_a_disk_too_small_is_refused_before_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = _Usage(2**30, 2**30 - 2**20, 2**20)
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: usage)
    out = tmp_path / "o"
    with pytest.raises(ValueError, match="not enough disk for this run") as caught:
        _trainer(out, tmp_path, "--training.max_steps", "2")
    assert f"training.output_dir={str(out)!r} is on a filesystem with 0.00 GiB free" in str(
        caught.value
    )
    assert not out.exists()  # refused before the folder was claimed: nothing left behind


def test_resume_with_another_world_size_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o"
    trainer = _trainer(out, tmp_path, "--training.max_steps", "1")
    try:
        saved = trainer.train().checkpoint
    finally:
        trainer.close()
    assert saved is not None
    state = json.loads((saved / "trainer_state.json").read_text())
    (saved / "trainer_state.json").write_text(json.dumps({**state, "world_size": 2}))
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\) and this run has 1"):
        _trainer(out, tmp_path, "--training.max_steps", "2", "--checkpoint.resume_from", "auto")


def test_ctrl_c_names_the_last_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "o"
    trainer = _trainer(out, tmp_path, "--training.max_steps", "4", "--checkpoint.save_every", "2")
    real, calls = trainer.engine.train_step, []

    def interrupted_in_step_3(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)  # type: ignore[arg-type]

    trainer.engine.train_step = interrupted_in_step_3  # type: ignore[method-assign]
    try:
        with pytest.raises(TrainingInterrupted) as caught:
            trainer.train()
    finally:
        trainer.close()
    last = out / "checkpoints" / "step-00000002"
    assert f"interrupted at step 2; the last checkpoint is {last}" in str(caught.value)
    assert "--checkpoint.resume_from auto" in str(caught.value)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
