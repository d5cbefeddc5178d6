"""The GPU tier under two ranks (gloo, torchrun, CPU): the tier's device code path on the CPU.

With `memory.gpu_state_blocks` T each rank keeps its shard of the first T blocks' fp32 master,
m and v on its device and the whole blocks' weights resident; their gradients are
reduce-scattered into the shards, updated there by the device AdamW, and all-gathered back
(engine/tier.py). Two tiers are run: every block (4 layers, the tied embedding, the head) and
T = 2 (two resident layers beside two streamed ones, the embedding and head streamed).

Parity tolerance against one process: as tests/distributed/test_distributed_ranks.py derives it
(fp32 sums in another order over 4 micro-batches: LOSS_RTOL; weights: WEIGHT_ATOL over the
steps). A tier rank that missed the other's gradient, updated without the clipping coefficient,
or kept the other rank's part of the weights stale after an update would be off by ~lr x |g| ~
1e-3 from the second step on. Against two ranks without a tier the runs are equal bit for bit:
the tier's update is the host's C kernel's arithmetic (its torch reference) on the same shard
of the same reduce-scatter, in bf16 compute landed in the shard's part of the resident weights
as the host lands it in its shadow (`test_a_bf16_tier_under_two_ranks_is_the_host_update`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed.test_distributed_ranks import (
    COMMON,
    DEMO,
    LOSS_RTOL,
    STEPS,
    WEIGHT_ATOL,
    _env,
    _records,
    _torchrun,
)
from megatrain.config import load_config
from megatrain.native import load_adamw_kernel
from megatrain.recipes.sft import Trainer

ALL_BLOCKS = 6  # demo: 4 layers, embedding (tied: also the lm_head), head (final norm)
ACCUM = ["--training.gradient_accumulation_steps", "2"]


def _tier(out: Path, blocks: int, *overrides: str) -> None:
    _torchrun(out, *ACCUM, "--memory.gpu_state_blocks", str(blocks), *overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | list[float]]:
    """2-rank outputs with every block and with 2 blocks in the tier, and the 1-process
    run's output and losses (no tier; twice the accumulation: the same global batch)."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("all", "two", "one")}
    _tier(out["all"], ALL_BLOCKS)
    _tier(out["two"], 2)
    one = ["--training.gradient_accumulation_steps", "4", "--memory.gpu_state_blocks", "0"]
    cfg = load_config(DEMO, ["--training.output_dir", str(out["one"]), *COMMON, *one])
    trainer = Trainer(cfg)
    try:
        losses = trainer.train().losses
    finally:
        trainer.close()
    return {**out, "losses": losses}


@pytest.mark.parametrize("name", ["all", "two"])
def test_tier_under_two_ranks_matches_one_process(
    runs: dict[str, Path | list[float]], name: str
) -> None:
    two, one = runs[name], runs["one"]
    assert isinstance(two, Path) and isinstance(one, Path)
    train = _records(two, "train")
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in train], dtype=torch.float64),
        torch.tensor(runs["losses"], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0.0,
    )
    assert all(r["clip_coef"] < 1.0 for r in train)  # clipping was active
    (ev2,), (ev1,) = _records(two, "eval"), _records(one, "eval")
    torch.testing.assert_close(ev2["eval_loss"], ev1["eval_loss"], rtol=LOSS_RTOL, atol=0.0)
    w2 = load_file(str(two / "hf_model" / "model.safetensors"))
    w1 = load_file(str(one / "hf_model" / "model.safetensors"))
    assert w2.keys() == w1.keys()
    for key, ref in w1.items():
        torch.testing.assert_close(w2[key], ref, rtol=0.0, atol=WEIGHT_ATOL)


def test_tier_checkpoint_is_per_rank_shards_and_exports(
    runs: dict[str, Path | list[float]], tmp_path: Path
) -> None:
    two = runs["all"]
    assert isinstance(two, Path)
    ckpt = two / "checkpoints" / f"step-{STEPS:08d}"
    for block in ("layer.0", "embed", "head"):  # tier blocks: the host blocks' shard files
        assert sorted(p.name for p in (ckpt / "blocks").glob(f"{block}.*")) == [
            f"{block}.rank000-of-002.safetensors",
            f"{block}.rank001-of-002.safetensors",
        ]
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "megatrain", "export", "--checkpoint", str(ckpt)]
    run = subprocess.run(
        [*cmd, "--out", str(out), "--dtype", "fp32"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    exported = load_file(str(out / "model.safetensors"))
    in_run = load_file(str(two / "hf_model" / "model.safetensors"))
    assert exported.keys() == in_run.keys()
    for key, ref in in_run.items():
        assert torch.equal(exported[key], ref), key  # the same fp32 masters, reassembled


# ("two", ALL_BLOCKS) is slow-marked (a torchrun launch, ~30 s on 2 cores): host-written shard
# files read into the tier are what ("two", 2) reads for its tier blocks (the tier's files are
# the host blocks' shard files: test_tier_checkpoint_is_per_rank_shards_and_exports), another
# tier count on the same 2-rank files is ("all", 0), and a resume from no tier into every block
# is tests/engine/test_gpu_tier_checkpoint.py's (0, 6)
@pytest.mark.parametrize(
    ("saved", "resumed"),
    [("two", 2), pytest.param("two", ALL_BLOCKS, marks=pytest.mark.slow), ("all", 0)],
)
def test_resume_with_a_tier_under_two_ranks(
    runs: dict[str, Path | list[float]], tmp_path: Path, saved: str, resumed: int
) -> None:
    """The same tier continues bit for bit; another tier count (the checkpoint does not
    depend on it) continues within the parity tolerance."""
    first = runs[saved]
    assert isinstance(first, Path)
    out = tmp_path / "resumed"
    shutil.copytree(first / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000002")
    _tier(out, resumed, "--checkpoint.resume_from", "auto", "--checkpoint.export_hf", "false")
    before = {r["step"]: r["loss"] for r in _records(first, "train")}
    again = {r["step"]: r["loss"] for r in _records(out, "train")}
    assert sorted(again) == [3, 4]
    if resumed == 2 and saved == "two":
        assert [again[s] for s in (3, 4)] == [before[s] for s in (3, 4)]
    else:
        torch.testing.assert_close(
            torch.tensor([again[s] for s in (3, 4)], dtype=torch.float64),
            torch.tensor([before[s] for s in (3, 4)], dtype=torch.float64),
            rtol=LOSS_RTOL,
            atol=0.0,
        )


@pytest.mark.skipif(load_adamw_kernel() is None, reason="no C compiler for the kernel")
def test_a_bf16_tier_under_two_ranks_is_the_host_update(tmp_path: Path) -> None:
    """bf16 compute, two ranks: with 2 tier layers (each rank's shard of their gradient lands in
    its part of the resident weights, its update is the C kernel's arithmetic, the all-gather
    completes the weights) every loss and exported weight equals the run without a tier."""
    bf16 = ("--model.compute_dtype", "bf16", "--checkpoint.save_every", "0")
    for blocks in (0, 2):
        _tier(tmp_path / str(blocks), blocks, *bf16)
    host, tier = (_records(tmp_path / str(b), "train") for b in (0, 2))
    assert [r["loss"] for r in tier] == [r["loss"] for r in host]
    assert [r["grad_norm"] for r in tier] == [r["grad_norm"] for r in host]
    assert all(r["clip_coef"] < 1.0 for r in tier)  # clipping was active
    w_host, w_tier = (
        load_file(str(tmp_path / str(b) / "hf_model" / "model.safetensors")) for b in (0, 2)
    )
    assert w_tier.keys() == w_host.keys()
    for key, ref in w_host.items():
        assert torch.equal(w_tier[key], ref), key
