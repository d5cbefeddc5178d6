"""Shared by the run tests: the demo config shrunk to a tiny model (`tiny_run_args`), and a run
interrupted inside a given optimizer step (`crash_during_step`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
SMALL = (
    "{vocab_size: 512, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, tie_word_embeddings: true}"
)


def tiny_run_args(out: Path, *overrides: str) -> list[str]:
    """Overrides of examples/demo.yaml for a quick run into `out`: a 2-layer model, no eval
    split, no progress bar or TensorBoard, no export (each can be overridden after)."""
    return [
        "--training.output_dir", str(out), "--logging.progress_bar", "false",
        "--logging.report_to", "none", "--model.config_overrides", SMALL,
        "--data.val_size", "0", "--training.micro_batch_size", "2",
        "--checkpoint.export_hf", "false", *overrides,
    ]  # fmt: skip


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
