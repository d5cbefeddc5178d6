"""What a run writes honours the umask: checkpoint blocks and the exported model.safetensors
(written through 0600 temporary files by safetensors) get the same mode as every other file, so
on a shared machine the other users can load a model exactly when they can read its folder."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.recipes.sft import Trainer
from run_helpers import DEMO, tiny_run_args

UMASK = 0o027  # group may read, others nothing: neither 0600 nor a fixed 0644 matches it


@pytest.fixture
def umask() -> Iterator[int]:
    previous = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(previous)


def test_run_files_honour_the_umask(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "run"
    args = tiny_run_args(out, "--training.max_steps", "1", "--checkpoint.export_hf", "true")
    trainer = Trainer(load_config(DEMO, args))
    try:
        trainer.train()
    finally:
        trainer.close()
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"model.safetensors", "config.yaml", "metrics.jsonl", "trainer_state.json"} <= names
    assert any(p.parent.name == "blocks" for p in files)
    modes = {str(p.relative_to(out)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
