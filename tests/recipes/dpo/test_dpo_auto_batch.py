"""`training.micro_batch_size: auto` under `megatrain dpo` (its default): the plan's micro-batch
holds whole pairs (an even row count: chosen and rejected share a micro-batch), and a run with
the size it picks equals the run with that size set by hand bit for bit. With
training.global_batch_size the step's rows are fixed and the plan picks among their even
divisors; without it the accumulation is kept and the micro-batch grows (as under `train`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatrain.cli import main
from run_helpers import DEMO, tiny_run_args


def _args(out: Path, *overrides: str) -> list[str]:
    """A config file without micro_batch_size, and overrides without it: 24 demo_dpo pairs."""
    config = yaml.safe_load(DEMO.read_text())
    del config["training"]["micro_batch_size"]
    file = out.parent / f"{out.name}.yaml"
    file.write_text(yaml.safe_dump(config))
    args = tiny_run_args(
        out,
        "--data.dataset", "demo_dpo", "--data.stage", "dpo", "--data.packing", "false",
        "--data.max_samples", "24", "--data.cutoff_len", "64", "--optimizer.warmup_ratio", "0",
        "--optimizer.learning_rate", "3e-3", "--dpo.beta", "0.5", *overrides,
    )  # fmt: skip
    i = args.index("--training.micro_batch_size")
    return ["--config", str(file), *args[:i], *args[i + 2 :]]


def _train(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_auto_is_the_default_and_equals_the_hand_set_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = ("--training.global_batch_size", "8", "--training.max_steps", "2")
    assert main(["dpo", *_args(tmp_path / "auto", *rows)]) == 0
    printed = capsys.readouterr().out
    assert "micro_batch_size auto: micro_batch_size 8 x grad_accum 1" in printed
    hand = ("--training.micro_batch_size", "8", "--training.max_steps", "2")
    assert main(["dpo", *_args(tmp_path / "hand", *hand)]) == 0
    auto, by_hand = _train(tmp_path / "auto"), _train(tmp_path / "hand")
    assert len(auto) == len(by_hand) == 2
    for a, h in zip(auto, by_hand, strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins"):
            assert a[key] == h[key], key


def test_auto_micro_batches_hold_whole_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without global_batch_size the candidates are 2, 4, ..., 64 rows (never 1): the CPU plan
    fits the largest. Rows per step that no even micro-batch divides are refused."""
    assert main(["dpo", *_args(tmp_path / "grow", "--training.max_steps", "1")]) == 0
    assert "micro_batch_size auto: micro_batch_size 64 x grad_accum 1" in capsys.readouterr().out
    odd = ("--training.global_batch_size", "5", "--training.max_steps", "1")
    assert main(["dpo", *_args(tmp_path / "odd", *odd)]) == 2
    err = capsys.readouterr().err
    assert "training.global_batch_size gives 5 rows per step" in err
    assert "a multiple of 2 (a preference pair's rows share one)" in err
