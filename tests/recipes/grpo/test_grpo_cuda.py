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
    # each phase begins with the engine's buffers (a tiny model's round to 0.00 GiB), and the
    # rollout's are gone: its copy, its cache and its side stream's cuBLAS workspace
    for r in rows:
        assert 0 <= r["gpu_start_gib/train"] <= r["gpu_start_gib/rollout"] + 0.01
        assert r["gpu_start_gib/rollout"] <= r["gpu_peak_gib/rollout"]


def test_cached_blocks_count_as_free_for_the_rollout(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, "--training.max_steps", "1")
    try:
        assert not trainer._rollout_plan().rollout.streamed
        free = torch.cuda.mem_get_info()[0]
        held = torch.empty(free - 2**30, dtype=torch.uint8, device="cuda")  # 1 GiB left free
        del held  # cached by PyTorch's allocator, not free for the device
        assert torch.cuda.mem_get_info()[0] < 2**30 + 2**29
        assert not trainer._rollout_plan().rollout.streamed  # it needs far less than is cached
    finally:
        trainer.close()


def test_reference_pass_swaps_a_bf16_gpu_tier_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """beta > 0 in bf16 with every block in the GPU tier (a tiny model): the reference pass
    writes the reference's weights into the tier and rebuilds the policy's from the fp32 master
    on the GPU (StreamingEngine.serving). Step 1 trains the weights the reference holds (KL ~0:
    the same weights, rounding of two passes at most), later steps moved away from it (KL > 0:
    the tier served the reference, not the policy). The log-prob phase starts where the rollout
    did (no host round trip left a buffer behind) and peaks below the training step."""
    trainer = _trainer(
        tmp_path,
        *("--training.max_steps", "3", "--grpo.beta", "0.1", "--model.compute_dtype", "bf16"),
        *("--memory.gpu_state_blocks", "99"),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[0]["kl"] < 1e-4 and rows[1]["kl"] > rows[0]["kl"] and rows[2]["kl"] > 0
    for r in rows:
        assert r["gpu_start_gib/logprob"] <= r["gpu_start_gib/rollout"] + 0.01
        assert r["gpu_peak_gib/logprob"] <= r["gpu_peak_gib/train"]
