"""Checkpoints do not depend on the GPU tier: a run killed and resumed with any tier split
continues exactly like the straight run: tier blocks are written to, and read from, the same
files as host blocks.

The demo run (4 layers, fp32, clipping on) with optimizer.impl c: a tier block's update
(`CpuAdamW.update_device`, here the torch reference of the C kernel) is bit for bit the host's C
kernel, so every split gives bit-identical steps (tests/engine/test_gpu_tier.py) and losses
after a resume must equal the straight run's exactly. (impl torch updates fp32 host blocks with
torch's fused AdamW, whose scalars and order of operations round differently from the C
kernel's: its splits agree within fp32 rounding, not bit for bit.) With int8 states too (a
compressed tier keeps the store's codes and scales, so its files are a host block's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatrain.checkpoint.saving import latest_checkpoint
from megatrain.config import load_config
from megatrain.native import load_adamw_kernel
from megatrain.recipes.sft import Trainer
from run_helpers import FEW_SAMPLES, crash_during_step

pytestmark = pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler for the kernel")
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
COMMON = (
    "--training.max_steps",
    "6",
    "--checkpoint.save_every",
    "3",
    "--checkpoint.export_hf",
    "false",
    "--data.val_size",
    "0",
    "--optimizer.impl",
    "c",
    "--logging.progress_bar",
    "false",
    "--logging.report_to",
    "none",
    *FEW_SAMPLES,
)


def _trainer(out: Path, tier: int, *overrides: str) -> Trainer:
    cfg = load_config(
        DEMO,
        [
            "--training.output_dir",
            str(out),
            "--memory.gpu_state_blocks",
            str(tier),
            *COMMON,
            *overrides,
        ],
    )
    return Trainer(cfg)


def _losses(out: Path, tier: int, *overrides: str) -> list[float]:
    trainer = _trainer(out, tier, *overrides)
    try:
        assert len(trainer.engine.tier) == tier
        return trainer.train().losses
    finally:
        trainer.close()


STATES = {
    "fp32": ["exp_avg", "exp_avg_sq"],
    "int8": ["exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"],
}


@pytest.fixture(scope="module", params=list(STATES))
def states(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, states: str) -> list[float]:
    return _losses(tmp_path_factory.mktemp("straight"), 0, "--optimizer.state_dtype", states)


# 6: every block of the 4-layer demo (layers, embedding = tied lm_head, head = final norm)
@pytest.mark.parametrize(("crash_tier", "resume_tier"), [(2, 0), (0, 6)])
def test_resume_across_tier_splits_is_exact(
    tmp_path: Path, straight: list[float], states: str, crash_tier: int, resume_tier: int
) -> None:
    dtype = ("--optimizer.state_dtype", states)
    crashed = _trainer(tmp_path, crash_tier, *dtype)
    seen = crash_during_step(crashed, 4)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step-00000003"
    for i in range(4):  # every layer's file holds fp32 master, m, v as stored, wherever it lived
        with safe_open(str(ckpt / "blocks" / f"layer.{i}.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(["master", *STATES[states]])
            assert f.get_tensor("master").dtype == torch.float32
            assert f.metadata()["step"] == "3"
    resumed = _losses(tmp_path, resume_tier, *dtype, "--checkpoint.resume_from", "auto")
    assert len(seen) == 3 and len(resumed) == 3
    assert seen + resumed == straight
