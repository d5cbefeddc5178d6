"""int4 AdamW states in real training runs of the demo: the engine with the C kernel equals the
engine with the torch reference bit for bit, and int4's eval loss is not worse than fp32's.

(Checkpoints of int4 states resume bit for bit: test_optim_states_training.py, with bf16 and
int8.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.native import load_adamw_kernel
from megatrain.recipes.sft import Trainer

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
IMPLS = ("c", "torch")  # optimizer.impl: the C kernel, the plain-PyTorch reference


def _train(tmp: Path, *overrides: str) -> tuple[list[float], float | None, Trainer]:
    quiet = ["--logging.progress_bar", "false", "--logging.report_to", "none"]
    cfg = load_config(DEMO, ["--training.output_dir", str(tmp), *quiet, *overrides])
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return summary.losses, summary.eval_loss, trainer


@pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler")
def test_engine_with_the_kernel_equals_the_engine_with_the_reference(tmp_path: Path) -> None:
    """Four steps of the demo in bf16 compute (gradients land in the shadow, clipping on): the
    losses and every block's master and states, C kernel against the torch reference."""
    common = ("--optimizer.state_dtype", "int4", "--model.compute_dtype", "bf16",
              "--training.max_steps", "4", "--checkpoint.export_hf", "false",
              "--data.val_size", "0")  # fmt: skip
    runs = {impl: _train(tmp_path / impl, *common, "--optimizer.impl", impl) for impl in IMPLS}
    (c_losses, _, c_run), (ref_losses, _, ref_run) = runs["c"], runs["torch"]
    assert c_losses == ref_losses and len(c_losses) == 4
    for ours, ref in zip(c_run.store.blocks, ref_run.store.blocks, strict=True):
        assert ours.step == ref.step == 4
        assert torch.equal(ours.master, ref.master), ours.name
        for key, state in ours.state_tensors().items():
            assert torch.equal(state, ref.state_tensors()[key]), (ours.name, key)


@pytest.mark.slow
def test_demo_eval_loss_with_int4_states_not_worse_than_fp32(tmp_path: Path) -> None:
    """The demo shortened to 2 epochs (98 steps), seed 42, fp32 and int4 states: int4's final
    eval loss at most 2% above fp32's (the bound int8 and bf16 are held to, two-sided, in
    test_optim_states_training.py).

    One-sided, from five seeds (42, 1, 2, 3, 4; docs/optimizer_states.md): int4 ended -0.9%,
    -4.8%, -6.6%, -1.3% and +1.2% from fp32, while fp32's own eval loss ranged over 1.31-1.45
    from seed to seed and int4's over 1.32-1.35. A two-sided 2% bound fails on the seeds where
    int4 ends well below fp32; a cost of the compression is what this test is for, and every
    seed measured is inside the one-sided bound, by 0.8 points of fp32's loss at least and by
    2.9 at seed 42 (whose 2-epoch run is not chaotic: fp32 with eps x (1 + 1e-4) moves it by
    0.001%, so another CPU's rounding will not move it by points).
    """
    eval_loss = {}
    for state_dtype in ("fp32", "int4"):
        overrides = ("--optimizer.state_dtype", state_dtype, "--training.num_epochs", "2",
                     "--checkpoint.export_hf", "false")  # fmt: skip
        _, loss, _ = _train(tmp_path / state_dtype, *overrides)
        assert loss is not None
        eval_loss[state_dtype] = loss
    assert eval_loss["fp32"] < 2.0  # the run learned (from ~6.2)
    assert eval_loss["int4"] <= 1.02 * eval_loss["fp32"], eval_loss
