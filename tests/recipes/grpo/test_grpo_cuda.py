"""GRPO on CUDA (skipped without a GPU): several generation batches in a row decode on the static
path with CUDA graphs, resident, each phase beginning with the memory it should; and the rollout
path is chosen from the memory PyTorch can hand out, not only what the device reports free (the
training phase's cached blocks count as free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_grpo_command import TINY, _reward_file

from megatrain.config import load_config
from megatrain.recipes.grpo.recipe import GRPOTrainer

pytestmark = pytest.mark.gpu

DEMO = Path(__file__).resolve().parents[3] / "examples" / "grpo_demo.yaml"


def _trainer(tmp_path: Path, *extra: str) -> GRPOTrainer:
    overrides = [
        *TINY,
        *("--training.device", "cuda", "--training.output_dir", str(tmp_path / "out")),
        *("--grpo.reward_funcs", f"[{_reward_file(tmp_path)}]"),
        *("--grpo.max_completion_length", "24", "--grpo.compile_decode", "graphs"),
        *extra,
    ]
    return GRPOTrainer(load_config(DEMO, overrides))


def test_generation_batches_in_a_row_decode_resident_with_graphs(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "--training.max_steps", "3")
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["rollout_streamed"] == 0 and r["time/decode_step_ms"] > 0 for r in rows)
    for r in rows:  # each phase begins with the engine's buffers, and the rollout's are gone
        assert 0 < r["gpu_start_gib/train"] <= r["gpu_start_gib/rollout"] + 0.01
        assert r["gpu_start_gib/rollout"] <= r["gpu_peak_gib/rollout"]


def test_cached_blocks_count_as_free_for_the_rollout(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "--training.max_steps", "1")
    try:
        assert not trainer._streamed_generation()
        free = torch.cuda.mem_get_info()[0]
        held = torch.empty(free - 2**30, dtype=torch.uint8, device="cuda")  # 1 GiB left free
        del held  # cached by PyTorch's allocator, not free for the device
        assert torch.cuda.mem_get_info()[0] < 2**30 + 2**29
        assert not trainer._streamed_generation()  # the rollout needs far less than is cached
    finally:
        trainer.close()
