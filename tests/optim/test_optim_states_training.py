"""Compressed AdamW states in real training runs of the demo: checkpoints hold the states as
stored and resume bit for bit, a checkpoint of another state dtype is refused, and the demo
trained to the end of its (shortened) schedule ends within the margin measured over seeds and
CPUs of fp32's eval loss."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint.saving import latest_checkpoint
from megatrain.config import load_config
from megatrain.recipes.sft import Trainer
from megatrain.store.int4 import INT4_BLOCK
from megatrain.store.states import QUANT_BLOCK
from run_helpers import FEW_SAMPLES, assert_resumes_exactly, checkpoint_blocks

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def _trainer(tmp: Path, *overrides: str) -> Trainer:
    quiet = ["--logging.progress_bar", "false", "--logging.report_to", "none"]
    cfg = load_config(DEMO, ["--training.output_dir", str(tmp), *quiet, *overrides])
    return Trainer(cfg)


def _train(tmp: Path, *overrides: str) -> tuple[list[float], float | None, Trainer]:
    trainer = _trainer(tmp, *overrides)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return summary.losses, summary.eval_loss, trainer


@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4"])
def test_compressed_states_checkpoint_as_stored_and_resume_exactly(
    tmp_path: Path, state_dtype: str
) -> None:
    # bf16 compute: gradients land in the shadow, the compressed kernels read them from there;
    # 2 rows a step (CPU bf16 matmuls are slow without native bf16: test_bf16_master_training)
    common = (
        "--training.micro_batch_size",
        "2",
        "--optimizer.state_dtype",
        state_dtype,
        "--model.compute_dtype",
        "bf16",
        "--training.max_steps",
        "6",
        "--checkpoint.save_every",
        "3",
        "--checkpoint.keep_last",
        "2",
        "--checkpoint.export_hf",
        "false",
        "--data.val_size",
        "0",
        *FEW_SAMPLES,
    )
    straight, _, trainer = _train(tmp_path / "a", *common)
    final = checkpoint_blocks(tmp_path / "a" / "checkpoints" / "step-00000006")
    layer = final["layer.0.safetensors"]
    numel = layer["master"].numel()
    if state_dtype == "bf16":
        assert layer["exp_avg"].dtype == layer["exp_avg_sq"].dtype == torch.bfloat16
        assert set(layer) == {"master", "exp_avg", "exp_avg_sq"}
    else:
        assert layer["exp_avg"].dtype == layer["exp_avg_sq"].dtype == torch.uint8
        block_size = INT4_BLOCK if state_dtype == "int4" else QUANT_BLOCK
        assert layer["exp_avg_scale"].shape == (-(-numel // block_size),)
        assert bool((layer["exp_avg_sq_scale"] > 0).all())
    # the store holds exactly what was saved, and what it holds is this many bytes
    block = trainer.store.layers[0]
    for key, saved in final["layer.0.safetensors"].items():
        assert torch.equal({"master": block.master, **block.state_tensors()}[key], saved)
    expected = {  # m and v: codes (int4: 64 bytes a block of 128, two codes a byte) + scales
        "bf16": 4 * numel,
        "int8": 2 * numel + 8 * -(-numel // QUANT_BLOCK),
        "int4": (2 * 64 + 8) * -(-numel // INT4_BLOCK),
    }
    assert sum(t.nbytes for t in block.state_tensors().values()) == expected[state_dtype]
    # resume from step 3 in a fresh output directory: the same losses and the same bytes
    assert_resumes_exactly(lambda out, *a: _train(out, *a)[0], tmp_path, common, straight)


def test_checkpoint_of_another_state_dtype_is_refused(tmp_path: Path) -> None:
    common = ("--training.max_steps", "1", "--checkpoint.export_hf", "false", *FEW_SAMPLES)
    _train(tmp_path, *common, "--optimizer.state_dtype", "int8")
    assert latest_checkpoint(tmp_path) is not None
    with pytest.raises(ValueError, match=r"int8 but this run has optimizer.state_dtype: fp32"):
        _trainer(tmp_path, *common, "--checkpoint.resume_from", "auto")


# The demo shortened to 2 epochs (98 steps): the final eval loss of each compact store relative
# to fp32's (fp32 compute, fp32 master and states) at the same training seed, (x - fp32) / fp32
# in %, measured 2026-11-27: seeds 42, 1, 2, 3 on an AMD EPYC (AVX-512, 1 thread) and on an
# Intel Xeon (AVX-512, 2 threads; bf16 and int8, seed 42 also once more before the thread count
# was fixed per run), int4 also seed 4 on the AMD EPYC. The difference is a property of the
# trajectory as much as of the format: fp32's own eval loss ranges over 8.8% across these seeds
# (1.3318-1.4493).
COMPACT_STORES: dict[str, tuple[str, ...]] = {
    "bf16": ("--optimizer.state_dtype", "bf16"),
    "int8": ("--optimizer.state_dtype", "int8"),
    "int4": ("--optimizer.state_dtype", "int4"),
    "bf16 master": ("--optimizer.master_dtype", "bf16", "--model.compute_dtype", "bf16"),
}
MEASURED_DIFF_PCT = {
    "bf16": (1.51, -0.75, -1.31, -0.21, 2.04, 1.48, -1.72, -1.57, 0.18),
    "int8": (1.86, 0.05, 2.68, 3.10, 1.60, 1.36, -0.44, 3.32, 2.74),
    "int4": (-0.89, -4.78, -6.57, -1.27, 1.17),
    "bf16 master": (0.48, -1.97, -4.55, -2.40),
}


def _bound_pct(samples: tuple[float, ...]) -> float:
    """mean + 3 standard deviations of the measured differences: a correct store ends above it
    on about 1 CPU or seed in 700 if the differences are normal. One-sided: ending below fp32's
    loss is no defect (int4 does on most seeds)."""
    return statistics.mean(samples) + 3 * statistics.stdev(samples)


@pytest.mark.slow
def test_demo_eval_loss_with_compact_stores_close_to_fp32(tmp_path: Path) -> None:
    """The demo with its schedule shortened to 2 epochs (98 steps, ~15 s per run on 2 cores),
    the same data and seed for each store: each compact store's final eval loss at most its
    margin measured over seeds and CPUs above fp32's (MEASURED_DIFF_PCT: bf16 states 4.3%,
    int8 5.8%, int4 6.9%, bf16 master with bf16 compute 4.1%).

    A fixed 2% was one run's number: bf16 ended 2.04% above fp32 on an Intel Xeon, and int8
    3.3% above at seed 2 there, with nothing wrong in either. What this still catches: a store
    that costs more than its measured spread (a broken quantizer or rounding does not learn, or
    ends far above fp32's loss).
    """
    eval_loss = {}
    for name, overrides in {"fp32": (), **COMPACT_STORES}.items():
        _, loss, _ = _train(
            tmp_path / name.replace(" ", "_"),
            *overrides,
            "--training.num_epochs",
            "2",
            "--checkpoint.export_hf",
            "false",
        )
        assert loss is not None
        eval_loss[name] = loss
    fp32 = eval_loss["fp32"]
    assert fp32 < 2.0  # the run learned (from ~6.2)
    for name, samples in MEASURED_DIFF_PCT.items():
        diff_pct = 100 * (eval_loss[name] - fp32) / fp32
        assert diff_pct <= _bound_pct(samples), (eval_loss, name, diff_pct)
