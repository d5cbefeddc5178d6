"""A real CUDA out-of-memory step on a GPU (skipped without one): undone, the plan steps down,
the run finishes with the losses of a run planned with the smaller tier from the start.

The card is filled by a blocker tensor once the engine is built (its GPU tier of all 10 blocks
allocated), leaving less than one step's activations free; so the first step runs out of
memory, whatever the card. Each step-down moves at least one tier block (0.1 GiB and more
here) back to the host; once enough have gone, the step fits. fp32 compute and the torch AdamW
on host and device: the two runs differ only in where each block's update ran (the CPU's and
the GPU's fused AdamW kernels, each exact to fp32 rounding), so after 3 steps the losses agree
to a few fp32 ulps of the update, far inside 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.recipes.sft import Trainer

pytestmark = pytest.mark.gpu
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
SHAPE = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}


def _trainer(tmp: Path, tier: int) -> Trainer:
    overrides = [f"--model.config_overrides.{k}={v}" for k, v in SHAPE.items()]
    cfg = load_config(
        DEMO,
        [
            *overrides,
            *("--training.output_dir", str(tmp), "--training.max_steps", "3"),
            *("--training.device", "cuda", "--training.micro_batch_size", "16"),
            *("--data.cutoff_len", "512", "--data.val_size", "0"),
            *("--memory.gpu_state_blocks", str(tier), "--memory.gpu_margin_gib", "0"),
            *("--optimizer.impl", "torch", "--checkpoint.export_hf", "false"),
            *("--training.compile_layers", "false"),
            *("--logging.progress_bar", "false", "--logging.report_to", "none"),
        ],
    )
    return Trainer(cfg)


def _run(trainer: Trainer, blocker_free_bytes: int | None = None) -> list[float]:
    blocker = None
    if blocker_free_bytes is not None:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        blocker = torch.empty(max(free - blocker_free_bytes, 0), dtype=torch.uint8, device="cuda")
    try:
        return trainer.train().losses
    finally:
        trainer.close()
        del blocker


def test_real_out_of_memory_steps_down_and_finishes(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "tight", 10)
    losses = _run(trainer, blocker_free_bytes=256 * 2**20)
    records = [
        json.loads(line) for line in (tmp_path / "tight" / "metrics.jsonl").read_text().splitlines()
    ]
    downs = [r for r in records if r["kind"] == "plan_step_down"]
    assert downs and all(r["step"] == 1 for r in downs)
    final = downs[-1]["gpu_state_blocks"][1]
    assert final < 10 and len(trainer.engine.tier) == final
    expected = _run(_trainer(tmp_path / "planned", final))
    assert losses == pytest.approx(expected, rel=1e-5)
