"""The names of what a run writes: each file and folder name is defined here once, and every
module that reads or writes one imports it (a renamed file cannot leave a reader behind).
The checkpoint package (checkpoint/) owns these files; their names live at the top of the
package so that trackers.py, which checkpoint/ imports (directly and through config/), can use
them without an import cycle (tests/test_layout.py).

Layout of `training.output_dir`:
    .megatrain.lock            LOCK_FILE: the live run's lock (checkpoint/output_dir.py)
    config.yaml                CONFIG_FILE: the resolved config (also in every checkpoint)
    metrics.jsonl              METRICS_FILE: one JSON line per step, eval and event
    checkpoints/step-<N>/      CHECKPOINTS_DIR/step_dir(N): TRAINER_STATE_FILE, BLOCKS_DIR/,
                               CONFIG_FILE (checkpoint/saving.py)
    hf_model/                  HF_MODEL_DIR: the end-of-run Hugging Face export

This module imports nothing, so any module may import it.
"""

from __future__ import annotations

LOCK_FILE = ".megatrain.lock"
"""The live run's lock in its output_dir (it holds the holder's pid and host)."""
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
HF_MODEL_DIR = "hf_model"

TRAINER_STATE_FILE = "trainer_state.json"
"""A checkpoint's step, run id, world size, loader position, RNG states; its presence marks a
complete checkpoint."""
BLOCKS_DIR = "blocks"
"""A checkpoint's store blocks, one safetensors file per block (or per rank's part)."""
EXPORT_MARKER = "megatrain_export.json"
"""Marks a folder as a MegaTrain export and lists its files (checkpoint/export.py)."""


def step_dir(step: int) -> str:
    """The folder name of checkpoint `step` under CHECKPOINTS_DIR."""
    return f"step-{step:08d}"
