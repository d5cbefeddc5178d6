"""dpo.reference: weights (the initial weights in host RAM, a forward-only pass per step) against
the precomputed table: the same losses, and an exact resume that keeps the initial weights as
the reference (not the checkpoint's trained ones).

Why exactly equal without shuffling: the table's pass groups pairs in order, micro-batch by
micro-batch as the unshuffled loader does, so both references run the same forward (the same
padded micro-batches through the same engine) on the same weights (the copy is the bf16 shadow /
fp32 master the engine streams, bit for bit). With shuffling the step's micro-batches group
other pairs than the table's pass, so a pair's padded width differs and the forward's fp32
reductions may round otherwise (on this machine they do not: the losses are equal). Bound: each
token's log-prob is off by at most TOKEN_EPS (~170 fp32 units at |logp| <= log 512 + 1, far more
than a forward of two layers over 32-wide hidden states accumulates); a completion has at most
cutoff_len = 64 tokens, so a pair's reference margin is off by at most 2 x 64 x TOKEN_EPS, and
the sigmoid loss, of slope at most beta in the margin, by beta times that. Later steps add only
lr x that through the gradients. A wrong reference (the policy's weights) moves the losses of
steps 2-4 by more than 8e-3 here (each would be log 2), 13x the bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.recipes.dpo import recipe as dpo_recipe
from megatrain.recipes.dpo.recipe import REFERENCE_FILE, DPOTrainer
from megatrain.store.reference import ReferenceWeights
from run_helpers import DEMO, crash_during_step, tiny_run_args

STEPS = ("--training.max_steps", "4")
BETA, CUTOFF, TOKEN_EPS = 0.5, 64, 1e-5


def _trainer(out: Path, *overrides: str) -> DPOTrainer:
    args = tiny_run_args(
        out,
        "--data.dataset", "demo_dpo", "--data.stage", "dpo", "--data.packing", "false",
        "--data.max_samples", "24", "--data.cutoff_len", str(CUTOFF),
        "--training.micro_batch_size", "4", "--training.gradient_accumulation_steps", "2",
        "--optimizer.warmup_ratio", "0", "--optimizer.learning_rate", "3e-3",
        "--optimizer.lr_scheduler", "constant", "--dpo.beta", str(BETA), *STEPS,
        *overrides,
    )  # fmt: skip
    return DPOTrainer(load_config(DEMO, args))


def _losses(out: Path, *overrides: str) -> list[float]:
    trainer = _trainer(out, *overrides)
    try:
        return trainer.train().losses
    finally:
        trainer.close()


def test_weights_give_the_precomputed_losses(tmp_path: Path) -> None:
    unshuffled = ("--data.shuffle", "false")
    table = _losses(tmp_path / "table", *unshuffled)
    weights = _losses(tmp_path / "weights", *unshuffled, "--dpo.reference", "weights")
    assert len(table) == 4 and table[-1] != table[0]  # trained: the reference is not the policy
    assert weights == table
    table = _losses(tmp_path / "table_shuffled")
    weights = _losses(tmp_path / "weights_shuffled", "--dpo.reference", "weights")
    assert weights == pytest.approx(table, abs=BETA * 2 * CUTOFF * TOKEN_EPS, rel=0)


def test_weights_resume_is_exact_with_the_initial_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ("--dpo.reference", "weights", "--checkpoint.save_every", "2")
    straight = _losses(tmp_path / "a", *common)
    seen = crash_during_step(_trainer(tmp_path / "b", *common), 3)
    step2 = tmp_path / "b" / "checkpoints" / "step-00000002"
    assert (step2 / ReferenceWeights.FILE).is_file() and not (step2 / REFERENCE_FILE).exists()
    passes: list[int] = []
    monkeypatch.setattr(dpo_recipe, "precompute_reference", lambda *a, **k: passes.append(1))
    loads: list[Path] = []
    real = ReferenceWeights.load
    monkeypatch.setattr(ReferenceWeights, "load", lambda w, f: loads.append(f) or real(w, f))
    resumed = _losses(tmp_path / "b", *common, "--checkpoint.resume_from", "auto")
    assert len(seen) == 2 and len(resumed) == 2
    assert seen + resumed == straight  # the reference after resume: the initial weights
    assert passes == [] and loads == [step2]  # no table; the reference from the checkpoint
    with pytest.raises(FileNotFoundError, match=REFERENCE_FILE):  # a table run cannot resume it
        _trainer(tmp_path / "b", "--checkpoint.resume_from", "auto").train()
