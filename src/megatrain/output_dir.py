"""The run's output folder: never reuse one by accident, never delete what another run wrote.

`prepare_output_dir` runs before anything is written or loaded:
- a new run (`checkpoint.resume_from: null`) in a non-empty `training.output_dir` is refused,
  with the three ways out: resume it, choose another folder, or `training.overwrite_output_dir`;
- with `overwrite_output_dir: true` the files a run writes there (config.yaml, metrics.jsonl,
  the trackers' tensorboard/, wandb/, swanlog/, checkpoints/, hf_model/) of the previous run
  are moved into `previous-<UTC time>/` inside the folder, never deleted; other files are left
  alone. So metrics.jsonl never mixes two runs and `resume_from: auto` never picks up the old
  run;
- a resumed run continues the folder (its metrics are cut back to the checkpoint's step by
  megatrain.metrics); a non-empty `hf_model/` that is not a MegaTrain export is refused up
  front, not after training, when the export would have to replace it.

`interrupted_message` is the one line printed on Ctrl-C: where the last checkpoint is and how to
resume from it.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from megatrain.checkpoint import check_export_target, latest_checkpoint
from megatrain.config import TrainConfig, save_config
from megatrain.trackers import TRACKER_FOLDERS

RUN_FILES = ("config.yaml", "metrics.jsonl", *TRACKER_FOLDERS, "checkpoints", "hf_model")
"""What a run writes at the top of its output_dir (moved aside by overwrite_output_dir)."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; str() says where the last checkpoint is and how to resume."""


def prepare_output_dir(
    output_dir: str | Path, *, resume_from: str | None, overwrite: bool, export_hf: bool
) -> Path | None:
    """Check (and with `overwrite`, clear by moving aside) the output folder before a run.

    Returns the folder the previous run's files were moved to, if any.
    """
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"training.output_dir={str(out)!r} is a file, not a folder; choose a folder"
        )
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    moved = None
    if entries and resume_from is None:
        if not overwrite:
            resume = (
                "Resume the old run with --checkpoint.resume_from auto, choose"
                if latest_checkpoint(out) is not None
                else "It has no checkpoint to resume from: choose"
            )
            raise ValueError(
                f"training.output_dir={str(out)!r} is not empty (it holds "
                f"{_list(entries)}) and checkpoint.resume_from is null, so this would be a new "
                "run on top of an old one: its checkpoints could replace the old ones and "
                f"metrics.jsonl would mix both runs. {resume} another training.output_dir, or set "
                "--training.overwrite_output_dir true to start a new run there (the previous "
                "run's files are moved into a previous-<time>/ folder inside it, never deleted)"
            )
        moved = _move_previous_run(out)
    if export_hf:
        check_export_target(
            out / "hf_model",
            key="the export folder",
            fix="Move or rename it (the end-of-run export replaces only a previous export), "
            "or set checkpoint.export_hf: false",
        )
    return moved


def open_output_dir(cfg: TrainConfig) -> str:
    """Make `training.output_dir` this run's (prepare_output_dir's rules), write its
    config.yaml, and return a new run id (a resumed run takes its checkpoint's instead)."""
    out = Path(cfg.training.output_dir)
    prepare_output_dir(
        out,
        resume_from=cfg.checkpoint.resume_from,
        overwrite=cfg.training.overwrite_output_dir,
        export_hf=cfg.checkpoint.export_hf,
    )
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    return uuid.uuid4().hex[:12]


def interrupted_message(output_dir: str | Path, step: int) -> str:
    """One line for Ctrl-C: where the last checkpoint is and the resume key."""
    last = latest_checkpoint(output_dir)
    if last is None:
        return (
            f"interrupted at step {step}; no checkpoint was saved yet in {output_dir} "
            "(checkpoint.save_every sets how often): run the same command with "
            "--checkpoint.resume_from auto to start it over in the same folder"
        )
    return (
        f"interrupted at step {step}; the last checkpoint is {last}: resume with the same "
        "command and --checkpoint.resume_from auto (or checkpoint.resume_from: auto in the YAML)"
    )


def _move_previous_run(out: Path) -> Path | None:
    present = [name for name in RUN_FILES if (out / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest, n = out / f"previous-{stamp}", 0
    while dest.exists():
        n += 1
        dest = out / f"previous-{stamp}.{n}"
    dest.mkdir()
    for name in present:
        os.rename(out / name, dest / name)
    print(f"training.overwrite_output_dir: the previous run's {_list(present)} moved to {dest}")
    return dest


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


__all__ = [
    "RUN_FILES",
    "TrainingInterrupted",
    "interrupted_message",
    "prepare_output_dir",
]
