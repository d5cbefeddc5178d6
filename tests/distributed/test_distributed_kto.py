"""KTO (`megatrain dpo`, dpo.loss_type kto) on two ranks on the CPU (gloo, torchrun) against one
process with the same global batch: KTO's reference point kl, the mean of (logp - ref) over the
step's KL rows, is the whole step's (each rank's sum and count summed over the ranks,
recipes/dpo/objective.py), so every step's kl, loss and metrics, and the eval's, are one
process's.

Tolerance (fp32), as tests/distributed/test_distributed_dpo.py derives it: the runs differ only
in the order of fp32 sums, at most 5 K u relative in a row's log-prob sum (K = 64, the
intermediate size; u = 2^-24), i.e. 5 K u L absolute with L the largest |log-prob sum| of a row.
kl is a mean of such differences (policy minus reference: 2 x 5 K u L), and the loss, a weighted
mean of 1 - sigmoid(beta (r - kl)), moves by at most beta / 4 per unit of r - kl (sigmoid' <=
1/4; r and kl each within 2 x 5 K u L): beta x 5 K u L. L is bounded by twice the largest
|logps/...| mean logged (a row's sum against the mean over rows). A rank that used its own KL
rows' mean would log its own kl, not the step's, once training moves the policy (kl > 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distributed.test_distributed_ranks import megatrain_job
from run_helpers import SMALL, kto_folder

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "dpo_demo.yaml"
K, U, BETA = 64, 2.0**-24, 0.1


def _run(out: Path, data: Path, ranks: int) -> list[dict]:
    """The run's records (`megatrain_job`: one process runs in this one)."""
    args = [
        "dpo", "--config", str(DEMO), "--training.device", "cpu",
        "--model.config_overrides", SMALL, "--data.dataset", "kto", "--data.dataset_dir",
        str(data), "--data.stage", "kto", "--dpo.loss_type", "kto", "--dpo.beta", str(BETA),
        "--data.val_size", "0.2", "--data.cutoff_len", "64",
        "--training.micro_batch_size", "4", "--training.num_epochs", "2",
        "--training.gradient_accumulation_steps", str(4 // ranks),  # 8 rows per step either way
        "--optimizer.learning_rate", "3e-3", "--checkpoint.save_every", "0",
        "--checkpoint.export_hf", "false", "--logging.progress_bar", "false",
        "--logging.report_to", "none", "--logging.log_every", "1",
        "--training.output_dir", str(out),
    ]  # fmt: skip
    megatrain_job(args, ranks)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] != "reference_pass"]


def test_kto_two_ranks_match_one_process(tmp_path: Path) -> None:
    data = kto_folder(tmp_path / "data", 40)
    two, one = _run(tmp_path / "two", data, 2), _run(tmp_path / "one", data, 1)
    assert [r["kind"] for r in two] == [r["kind"] for r in one] == ["train"] * 8 + ["eval"]
    prefix = {"train": "", "eval": "eval_"}
    logps = [abs(r[prefix[r["kind"]] + k]) for r in one for k in ("logps/chosen", "logps/rejected")]
    row_sum = 2 * max(logps)  # L
    loss_atol, kl_atol = BETA * 5 * K * U * row_sum, 2 * 5 * K * U * row_sum
    for a, b in zip(two, one, strict=True):
        p = prefix[a["kind"]]
        assert a[p + "kl"] == pytest.approx(b[p + "kl"], abs=kl_atol, rel=0)
        assert a[p + "loss"] == pytest.approx(b[p + "loss"], abs=loss_atol, rel=0)
        assert a[p + "rewards/chosen"] == pytest.approx(b[p + "rewards/chosen"], abs=kl_atol)
    assert max(r["kl"] for r in one[:8]) > 100 * kl_atol  # trained: kl tells the ranks apart
