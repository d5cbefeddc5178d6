"""`megatrain dpo` on two ranks on the CPU (gloo, torchrun) against one process with the same
global batch: each rank takes every other micro-batch of the step (recipes/dpo/steps.py), the
step's totals (pairs, chosen tokens) are the job's on every rank, the metric sums and the eval
are summed over the ranks, and rank 0 writes the reference table into each checkpoint. With
`dpo.reference: weights` each rank keeps the copy of its own shards, swapped into its store for
the per-step pass (the engine's all-gather assembles the reference), and writes them into each
checkpoint as its own file; a job killed and resumed on two ranks continues exactly.

Tolerance (fp32), as tests/distributed/test_distributed_ranks.py derives it: the runs differ
only in the order of fp32 sums (gradients summed over the step's micro-batches in another
order, other thread counts), at most 5 K u relative in the log-probs with K = 64 (the
intermediate size) and u = 2^-24; the sigmoid loss is 1-Lipschitz in beta x the log-prob
margin (beta 0.1), so the loss agrees to that bound too. A rank that divided by its own pairs
or skipped the all-reduce would be off by a factor of 2 in the loss's deviation from log 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from distributed.test_distributed_ranks import megatrain_job
from run_helpers import SMALL

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "dpo_demo.yaml"
K, U = 64, 2.0**-24
LOSS_RTOL = 5 * K * U
COMMON = [
    "--config", str(DEMO), "--training.device", "cpu", "--model.config_overrides", SMALL,
    "--data.max_samples", "40", "--data.val_size", "0.2", "--data.cutoff_len", "64",
    "--training.micro_batch_size", "4", "--training.num_epochs", "2",
    "--optimizer.learning_rate", "3e-3", "--checkpoint.save_every", "4",
    "--checkpoint.keep_last", "2", "--checkpoint.export_hf", "false",
    "--logging.progress_bar", "false", "--logging.report_to", "none", "--logging.log_every", "1",
]  # fmt: skip


def _run(out: Path, ranks: int, *extra: str, ok: bool = True) -> str:
    """The job's output (`megatrain_job`); `ok` False: the job is expected to fail."""
    accum = str(4 // ranks)  # 4 micro-batches of 2 pairs per step either way
    args = ["dpo", *COMMON, "--training.output_dir", str(out)]
    args += ["--training.gradient_accumulation_steps", accum, *extra]
    return megatrain_job(args, ranks, ok)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _matches(two: list[dict], one: list[dict]) -> None:
    """The same steps and eval, the losses within the fp32 bound, the same rows and accuracies."""
    assert [r["kind"] for r in two] == [r["kind"] for r in one] == ["train"] * 8 + ["eval"]
    key = {"train": "loss", "eval": "eval_loss"}
    torch.testing.assert_close(
        torch.tensor([r[key[r["kind"]]] for r in two], dtype=torch.float64),
        torch.tensor([r[key[r["kind"]]] for r in one], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0.0,
    )
    assert [r["tokens"] for r in two[:8]] == [r["tokens"] for r in one[:8]]  # the same rows
    acc = "rewards/accuracies"
    assert [r[acc] for r in two[:8]] == [r[acc] for r in one[:8]]  # summed over the ranks
    assert two[-1]["eval_" + acc] == one[-1]["eval_" + acc]


def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    _run(tmp_path / "two", 2)
    _run(tmp_path / "one", 1)
    two, one = _records(tmp_path / "two"), _records(tmp_path / "one")
    ref_two, ref_one = two.pop(0), one.pop(0)  # the reference pass, before step 1
    assert ref_two["kind"] == ref_one["kind"] == "reference_pass"
    for key in ("pairs", "tokens"):  # every rank's share counted once
        assert ref_two[key] == ref_one[key]
    _matches(two, one)
    for step in (4, 8):
        assert (
            tmp_path / "two" / "checkpoints" / f"step-{step:08d}" / "reference_logps.pt"
        ).is_file()


def test_reference_weights_on_two_ranks_match_one_process_and_resume(tmp_path: Path) -> None:
    weights = ("--dpo.reference", "weights")
    _run(tmp_path / "two", 2, *weights)
    _run(tmp_path / "one", 1, *weights)
    two, one = _records(tmp_path / "two"), _records(tmp_path / "one")
    assert all(r["kind"] != "reference_pass" for r in two + one)  # a pass per step instead
    _matches(two, one)
    ckpt = tmp_path / "two" / "checkpoints" / "step-00000004"
    parts = sorted(p.name for p in ckpt.glob("reference*.safetensors"))
    assert parts == [f"reference.rank{r:03d}-of-002.safetensors" for r in (0, 1)]
    assert not (ckpt / "reference_logps.pt").exists()
    # the 2-rank job again from step 4: the reference read back is the initial weights' shards
    (tmp_path / "straight").mkdir()
    (tmp_path / "two" / "metrics.jsonl").rename(tmp_path / "straight" / "metrics.jsonl")
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step-00000008")
    resume = (*weights, "--checkpoint.resume_from", str(ckpt))
    part = ckpt / "reference.rank001-of-002.safetensors"
    part.rename(tmp_path / part.name)  # rank 1 reads its own part: without it, one paragraph
    assert f"{part}: missing" in _run(tmp_path / "two", 2, *resume, ok=False)
    (tmp_path / part.name).rename(part)
    _run(tmp_path / "two", 2, *resume)
    straight = [r for r in _records(tmp_path / "straight") if r["step"] > 4]
    resumed = _records(tmp_path / "two")
    assert [(r["kind"], r["step"]) for r in resumed] == [(r["kind"], r["step"]) for r in straight]
    key = {"train": "loss", "eval": "eval_loss"}
    assert [r[key[r["kind"]]] for r in resumed] == [r[key[r["kind"]]] for r in straight]
