"""Experiment trackers that receive the run's metrics: TensorBoard, W&B, MLflow, SwanLab, Trackio.

`logging.report_to` names them, as LLaMA-Factory's and TRL's `report_to` does: one name, a list,
"all" (every tracker whose package is installed) or "none". Each tracker is a small adapter
behind one interface (`Tracker`): constructed with the run (`TrackerRun`), it opens the
tracker's run and logs the config once; `log(scalars, step)` takes every record; `close()`
finishes the run.

Invariants:
- Every tracker gets what metrics.jsonl gets, under the same names (`train/<key>`,
  `eval/<key>`) and steps (MetricsLogger sends them).
- Only rank 0 opens trackers (RunBuilder.metrics); the other ranks construct none.
- A tracker's package (its pip name is its name) is imported only when the tracker is opened,
  never by this module (the config imports `TRACKER_NAMES` from here); a package that is
  missing is one error naming `logging.report_to` and the `pip install` that fixes it.
- The settings of a tracker's own (online or offline mode, server URI, entity, API key) are its
  environment variables (WANDB_MODE, MLFLOW_TRACKING_URI, SWANLAB_MODE, TRACKIO_DIR, ...).

Resume: TensorBoard purges the interrupted run's events after the checkpoint's step (as
metrics.jsonl drops its lines); W&B, MLflow, SwanLab and Trackio open a new run that starts at
the checkpoint's step + 1, leaving the interrupted run's as it was.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from megatrain.run_files import CONFIG_FILE


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker opens its run with."""

    output_dir: Path
    project: str  # W&B / SwanLab / Trackio project, MLflow experiment
    name: str  # the run's name
    start_step: int  # steps already done (a resumed run's checkpoint step)
    config: dict[str, Any]  # the run's whole config (section -> key -> value), logged once


class Tracker(ABC):
    """One tracker's run: the constructor opens it and logs the config, `log` takes each
    record's scalars at its step, `close` finishes it."""

    folder: str | None = None
    """What it writes at the top of output_dir (moved aside with the run's other files)."""

    @abstractmethod
    def __init__(self, run: TrackerRun) -> None: ...

    @abstractmethod
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    """Event files in output_dir/tensorboard; the config as a text summary."""

    folder = "tensorboard"

    def __init__(self, run: TrackerRun) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops the interrupted run's events after the checkpoint's step
        self._writer = SummaryWriter(
            str(run.output_dir / self.folder), purge_step=run.start_step + 1
        )
        self._writer.add_text("config", _config_markdown(run.config), run.start_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run, its files under output_dir/wandb (WANDB_MODE=offline: no upload)."""

    folder = "wandb"  # wandb.init(dir=output_dir) names it

    def __init__(self, run: TrackerRun) -> None:
        wandb = _require("wandb")
        self._run = wandb.init(
            project=run.project, name=run.name, dir=str(run.output_dir), config=run.config
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowTracker(Tracker):
    """An MLflow run in experiment `project` at MLFLOW_TRACKING_URI (MLflow's default without
    it); the config as the artifact config.yaml."""

    def __init__(self, run: TrackerRun) -> None:
        mlflow = _require("mlflow")
        from mlflow.entities import Metric

        self._metric = Metric
        self._client = mlflow.MlflowClient()
        experiment = self._client.get_experiment_by_name(run.project)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(run.project)
        )
        self._run_id = self._client.create_run(experiment_id, run_name=run.name).info.run_id
        self._client.log_dict(self._run_id, run.config, CONFIG_FILE)

    def log(self, scalars: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(key, value, now_ms, step) for key, value in scalars.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class SwanLabTracker(Tracker):
    """A SwanLab run, its files under output_dir/swanlog (SWANLAB_MODE=offline or local: no
    upload)."""

    folder = "swanlog"

    def __init__(self, run: TrackerRun) -> None:
        swanlab = _require("swanlab")
        self._run = swanlab.init(
            project=run.project,
            experiment_name=run.name,
            config=run.config,
            logdir=str(run.output_dir / self.folder),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioTracker(Tracker):
    """A Trackio run in the local database under TRACKIO_DIR (Hugging Face's cache without it)."""

    def __init__(self, run: TrackerRun) -> None:
        trackio = _require("trackio")
        self._run = trackio.init(project=run.project, name=run.name, config=run.config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


# name in report_to (also the package's import and pip name) -> its adapter
_TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
}
TRACKER_NAMES = tuple(_TRACKERS)
"""The trackers `logging.report_to` may name (besides "all" and "none")."""

TRACKER_FOLDERS = tuple(t.folder for t in _TRACKERS.values() if t.folder)
"""What the trackers write at the top of output_dir."""


def tracker_names(report_to: str | tuple[str, ...]) -> tuple[str, ...]:
    """The trackers `logging.report_to` asks for: "none" none, "all" every one installed.

    A tracker named whose package is not installed is an error here, so a recipe asks before
    it loads the model (ValueError: the key and the pip install)."""
    names = (report_to,) if isinstance(report_to, str) else report_to
    if names == ("none",):
        return ()
    if names == ("all",):
        return tuple(n for n in TRACKER_NAMES if _installed(n))
    for name in names:
        if not _installed(name):
            raise _missing(name)
    return tuple(dict.fromkeys(names))  # each once


def open_trackers(names: tuple[str, ...], run: TrackerRun) -> list[Tracker]:
    """Open each tracker of `names` (tracker_names' answer) for `run`."""
    return [_TRACKERS[name](run) for name in names]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _require(name: str) -> ModuleType:
    """Tracker `name`'s package, imported; missing: the error of tracker_names."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise _missing(name) from e


def _missing(name: str) -> ValueError:
    return ValueError(
        f"logging.report_to names {name} but the {name} package is not installed: pip install "
        f"{name} (pip install 'megatrain[trackers]' installs every tracker), or take {name} out "
        "of logging.report_to (none: metrics.jsonl only)"
    )


def _config_markdown(config: dict[str, Any]) -> str:
    """The config as an indented YAML block (TensorBoard's text tab renders Markdown)."""
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    return "\n".join("    " + line for line in text.splitlines())
