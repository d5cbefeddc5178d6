"""`megatrain dpo` end to end on the CPU: on a few demo_dpo pairs a tiny model learns to rank the
chosen answers first (rewards/accuracies ~0.5 -> 1), TRL's metrics are logged per step, resume
is exact and loads the reference table rather than recomputing it, and bad settings are refused
with a paragraph naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.recipes.dpo import recipe as dpo_recipe
from megatrain.recipes.dpo.recipe import REFERENCE_FILE, DPOTrainer
from run_helpers import DEMO, crash_during_step, kto_folder, tiny_run_args

TRL_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "loss",
)


def _args(out: Path, *overrides: str) -> list[str]:
    """The demo's tiny model on 24 demo_dpo pairs, 4 pairs (8 rows) per micro-batch."""
    return tiny_run_args(
        out,
        "--data.dataset", "demo_dpo", "--data.stage", "dpo", "--data.packing", "false",
        "--data.max_samples", "24", "--data.cutoff_len", "64",
        "--training.micro_batch_size", "8", "--optimizer.warmup_ratio", "0",
        "--optimizer.learning_rate", "3e-3", "--optimizer.lr_scheduler", "constant",
        "--dpo.beta", "0.5",
        *overrides,
    )  # fmt: skip


def _trainer(out: Path, *overrides: str) -> DPOTrainer:
    return DPOTrainer(load_config(DEMO, _args(out, *overrides)))


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_dpo_command_learns_the_preferences(tmp_path: Path) -> None:
    assert main(["dpo", "--config", str(DEMO), *_args(tmp_path, "--training.num_epochs", "8")]) == 0
    train = _records(tmp_path)
    assert len(train) == 8 * 6  # 24 pairs, 4 per step
    assert all(name in r for r in train for name in TRL_METRICS)
    first = sum(r["rewards/accuracies"] for r in train[:6]) / 6  # the first epoch
    last = sum(r["rewards/accuracies"] for r in train[-6:]) / 6
    assert train[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)  # policy = reference
    assert first < 0.75 and last >= 0.9, (first, last)
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    assert (tmp_path / "checkpoints" / "step-00000048" / REFERENCE_FILE).is_file()


def test_reference_pass_is_a_metrics_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The precomputed reference's one pass: a "reference_pass" record before step 1 (its pairs,
    time and tokens: 24 pairs = 6 micro-batches of 8 padded rows) and the printed line."""
    args = _args(tmp_path, "--training.max_steps", "1")
    assert main(["dpo", "--config", str(DEMO), *args]) == 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["kind"] for r in records] == ["reference_pass", "train"]
    ref = records[0]
    assert ref["step"] == 0 and ref["pairs"] == 24 and ref["seconds"] > 0
    assert 48 * 8 <= ref["tokens"] <= 48 * 64  # 48 rows, padded within cutoff_len 64
    assert ref["tokens"] / ref["tokens_per_s"] == pytest.approx(ref["seconds"], abs=6e-4)
    assert "reference: log-probs of 24 pairs precomputed in" in capsys.readouterr().err


def test_resume_is_exact_and_loads_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ("--training.max_steps", "6", "--checkpoint.save_every", "3")
    trainer = _trainer(tmp_path / "a", *common)
    try:
        straight = trainer.train().losses
    finally:
        trainer.close()
    seen = crash_during_step(_trainer(tmp_path / "b", *common), 4)
    passes = []
    real = dpo_recipe.precompute_reference
    monkeypatch.setattr(
        dpo_recipe, "precompute_reference", lambda *a, **k: passes.append(1) or real(*a, **k)
    )
    trainer = _trainer(tmp_path / "b", *common, "--checkpoint.resume_from", "auto")
    try:
        resumed = trainer.train().losses
    finally:
        trainer.close()
    assert len(straight) == 6 and len(seen) == 3 and len(resumed) == 3
    assert seen + resumed == straight
    assert passes == []  # the table came from the step-3 checkpoint


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("--data.stage", "sft", "--data.dataset", "demo"), "data.stage='sft'"),
        (("--training.micro_batch_size", "3"), "training.micro_batch_size=3"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: tuple[str, ...], named: str
) -> None:
    assert main(["dpo", "--config", str(DEMO), *_args(tmp_path, *overrides)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatrain dpo: error: ") and named in err
    assert "\n" not in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_kto_runs_through_the_command(tmp_path: Path) -> None:
    """KTO rows (demo_dpo's answers, chosen desirable, rejected not, alternately): TRL's KTO
    metrics (no accuracies: the rows are not pairs), and the loss falls."""
    data = kto_folder(tmp_path / "data", 24)
    out = tmp_path / "run"
    kto = ("--data.dataset", "kto", "--data.dataset_dir", str(data), "--data.stage", "kto")
    args = _args(out, *kto, "--dpo.loss_type", "kto", "--training.num_epochs", "4")
    assert main(["dpo", "--config", str(DEMO), *args]) == 0
    train = _records(out)
    assert len(train) == 4 * 6
    assert all("rewards/accuracies" not in r and "kl" in r and "rewards/chosen" in r for r in train)
    assert train[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # 1 - s(0): the policy is the reference
    assert sum(r["loss"] for r in train[-6:]) / 6 < 0.4


def test_data_show_batches_pairs_as_dpo_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """training.micro_batch_size 8 rows: 4 pairs a micro-batch, 6 of them over 24 pairs (the
    6 steps an epoch of test_dpo_command_learns_the_preferences)."""
    assert main(["data", "--config", str(DEMO), *_args(tmp_path), "--show", "0"]) == 0
    assert "micro-batch 4, 24 pairs = 6 micro-batches per epoch" in capsys.readouterr().out


def test_resume_without_a_reference_table_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reference-free run's checkpoint holds no table: resuming it with a reference loss would
    have to compute the reference from trained weights, so it is refused, naming the file."""
    steps = ("--training.max_steps", "2", "--checkpoint.save_every", "2")
    assert (
        main(["dpo", "--config", str(DEMO), *_args(tmp_path, *steps, "--dpo.loss_type", "orpo")])
        == 0
    )
    assert not (tmp_path / "checkpoints" / "step-00000002" / REFERENCE_FILE).exists()
    capsys.readouterr()
    resume = ("--checkpoint.resume_from", "auto", "--training.max_steps", "4")
    assert main(["dpo", "--config", str(DEMO), *_args(tmp_path, *resume)]) == 2
    err = capsys.readouterr().err
    assert f"step-00000002/{REFERENCE_FILE}: missing" in err and "loss_type='sigmoid'" in err
