"""logging.report_to: each tracker, offline, gets metrics.jsonl's names, steps and values and the
config once; a missing package is one error naming the key and the pip install; rank 0 alone
opens trackers.

The tracker packages are optional (CI installs none but tensorboard): each tracker's test skips
when its package is absent. Values are chosen exact in float32 (TensorBoard stores float32), so
every read-back is compared exactly.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.distributed import Placement
from megatrain.metrics import MetricsLogger
from megatrain.recipes.builder import RunBuilder
from megatrain.trackers import TRACKER_NAMES, TrackerRun, open_trackers, tracker_names

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
CONFIG = {"optimizer": {"learning_rate": 3e-3}, "logging": {"project": "megatrain-test"}}
# key -> {step: value} that _log_run's two steps and one eval produce
EXPECTED = {
    "train/loss": {1: 2.5, 2: 2.0},
    "train/tokens_per_s": {1: 256.0, 2: 512.0},
    "train/time/compute_s": {1: 0.25, 2: 0.125},
    "eval/eval_loss": {2: 1.5},
}


def _log_run(name: str, out: Path) -> None:
    """Open tracker `name` and send it two steps and an eval through MetricsLogger."""
    run = TrackerRun(out, project="megatrain-test", name="run-a", start_step=0, config=CONFIG)
    logger = MetricsLogger(
        out,
        total_steps=2,
        start_step=0,
        log_every=1,
        jsonl=False,
        trackers=open_trackers((name,), run),
        progress_bar=False,
        flops_per_token=6.0,
        peak_flops_per_s=None,
        echo=False,
    )
    for step, (loss, step_s) in enumerate([(2.5, 0.5), (2.0, 0.25)], start=1):
        record = {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 128, "step_s": step_s}
        logger.log_step(step, record | {"time/compute_s": step_s / 2})
    logger.log_eval(2, 1.5, 64)
    logger.close()


def _picked(series: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    return {key: series.get(key, {}) for key in EXPECTED}


def _leveldb_records(path: Path, ident: bytes) -> Iterator[bytes]:
    """The records of a LevelDB-log file (W&B's .wandb, SwanLab's .swanlab): a 7-byte header,
    then 32 KiB blocks of chunks (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first,
    3 middle, 4 last); a block's last < 7 bytes are padding."""
    data = path.read_bytes()
    assert data[:4] == ident
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b""


def test_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_run("tensorboard", tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    series = {k: {e.step: e.value for e in acc.Scalars(k)} for k in acc.Tags()["scalars"]}
    assert _picked(series) == EXPECTED
    (text,) = acc.Tensors("config/text_summary")
    assert "learning_rate: 0.003" in text.tensor_proto.string_val[0].decode()


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_run("wandb", tmp_path)
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    series: dict[str, dict[int, float]] = {}
    for data in _leveldb_records(path, b":W&B"):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "run":
            assert (record.run.project, record.run.display_name) == ("megatrain-test", "run-a")
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
            assert config["optimizer"] == CONFIG["optimizer"]
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                series.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    assert _picked(series) == EXPECTED


def test_mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database
    _log_run("mlflow", tmp_path)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name("megatrain-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    series = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in EXPECTED
    }
    assert series == EXPECTED
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(config).read_text()) == CONFIG


def test_swanlab_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("swanlab")
    record_pb2 = pytest.importorskip("swanlab.proto.swanlab.record.v1.record_pb2")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "home"))
    _log_run("swanlab", tmp_path)
    (run_dir,) = (tmp_path / "swanlog").glob("run-*")
    series: dict[str, dict[int, float]] = {}
    for data in _leveldb_records(next(run_dir.glob("run-*.swanlab")), b":SWL"):
        record = record_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "start":
            assert (record.start.project, record.start.name) == ("megatrain-test", "run-a")
        if record.WhichOneof("record_type") == "scalar":
            s = record.scalar
            series.setdefault(s.key, {})[s.step] = s.value.number
    assert _picked(series) == EXPECTED
    config = yaml.safe_load((run_dir / "files" / "config.yaml").read_text())
    assert config["optimizer"]["value"] == CONFIG["optimizer"]


def test_trackio_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    trackio = pytest.importorskip("trackio")
    assert tmp_path / "trackio" == trackio.utils.TRACKIO_DIR, "trackio was imported before"
    from trackio.sqlite_storage import SQLiteStorage

    _log_run("trackio", tmp_path)
    series: dict[str, dict[int, float]] = {}
    for row in SQLiteStorage.get_logs("megatrain-test", "run-a"):
        for key, value in row.items():
            series.setdefault(key, {})[row["step"]] = value
    assert _picked(series) == EXPECTED
    assert (
        SQLiteStorage.get_run_config("megatrain-test", "run-a")["optimizer"]
        == (CONFIG["optimizer"])
    )


# ---- names, missing packages, ranks ----------------------------------------------------------


def _hide(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make `packages` look uninstalled: `import` raises ImportError, find_spec says None."""
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)


def test_report_to_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tracker_names("none") == () and tracker_names(()) == ()
    _hide(monkeypatch, *(n for n in TRACKER_NAMES if n != "tensorboard"))
    assert tracker_names("all") == ("tensorboard",)
    assert tracker_names(("tensorboard", "tensorboard")) == ("tensorboard",)


def test_missing_package_is_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "wandb")
    with pytest.raises(ValueError, match=r"logging.report_to names wandb .* pip install wandb "):
        tracker_names(("tensorboard", "wandb"))
    run = TrackerRun(tmp_path, project="p", name="n", start_step=0, config={})
    with pytest.raises(ValueError, match="pip install wandb "):
        open_trackers(("wandb",), run)
    # the command refuses before it touches the output folder or loads anything
    out = tmp_path / "out"
    argv = ["train", "--config", str(DEMO), "--training.output_dir", str(out)]
    assert main([*argv, "--logging.report_to", "wandb"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "pip install wandb" in err and not out.exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("neptune", "logging.report_to='neptune' must be one of"),
        ("[all, wandb]", "mixes 'all' or 'none' with other names"),
    ],
)
def test_report_to_checked(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(DEMO, ["--logging.report_to", value])


def test_removed_tensorboard_key_names_its_replacement() -> None:
    with pytest.raises(ValueError, match=r"logging\.report_to replaced it"):
        load_config(DEMO, ["--logging.tensorboard", "false"])


def test_list_and_string_forms() -> None:
    cfg = load_config(DEMO, ["--logging.report_to", "[tensorboard, mlflow]"])
    assert cfg.logging.report_to == ("tensorboard", "mlflow")
    assert load_config(DEMO, ["--logging.report_to", "wandb"]).logging.report_to == "wandb"


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_zero_alone_opens_trackers(tmp_path: Path, rank: int) -> None:
    cfg = load_config(DEMO, ["--training.output_dir", str(tmp_path), "--training.device", "cpu"])
    placement = Placement(torch.device("cpu"), rank=rank, world_size=2)
    logger = RunBuilder(cfg, placement=placement).metrics(total_steps=1, start_step=0)
    logger.log_eval(1, 2.0, 10)  # metrics.jsonl is made at the first record
    logger.close()
    assert (tmp_path / "tensorboard").is_dir() == (rank == 0)  # report_to's default
    assert (tmp_path / "metrics.jsonl").exists() == (rank == 0)
