"""int4 AdamW states in real training runs of the demo: the engine with the C kernel equals the
engine with the torch reference bit for bit.

(Checkpoints of int4 states resume bit for bit, and the demo's eval loss with int4 stays within
its measured margin of fp32's: test_optim_states_training.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.native import load_adamw_kernel
from megatrain.recipes.sft import Trainer
from run_helpers import FEW_SAMPLES

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
    losses and every block's master and states, C kernel against the torch reference. 2 rows
    a step, not the demo's 8: CPU bf16 matmuls are slow without native bf16, and the kernels'
    agreement does not depend on the tokens (test_bf16_master_training.py does the same)."""
    common = ("--optimizer.state_dtype", "int4", "--model.compute_dtype", "bf16",
              "--training.micro_batch_size", "2", "--training.max_steps", "4",
              "--checkpoint.export_hf", "false", "--data.val_size", "0",
              *FEW_SAMPLES)  # fmt: skip
    runs = {impl: _train(tmp_path / impl, *common, "--optimizer.impl", impl) for impl in IMPLS}
    (c_losses, _, c_run), (ref_losses, _, ref_run) = runs["c"], runs["torch"]
    assert c_losses == ref_losses and len(c_losses) == 4
    for ours, ref in zip(c_run.store.blocks, ref_run.store.blocks, strict=True):
        assert ours.step == ref.step == 4
        assert torch.equal(ours.master, ref.master), ours.name
        for key, state in ours.state_tensors().items():
            assert torch.equal(state, ref.state_tensors()[key]), (ours.name, key)
