"""GRPO's rank arithmetic without processes (recipes/grpo/ranks.py, plan.py `training_config`):
each rank's rows, seeds, loss weights and plan; tests/distributed/test_distributed_grpo.py runs
two ranks for real."""

from __future__ import annotations

import pytest
import torch
from test_grpo_plan import GRPO, MODEL

from megatrain.config import load_config
from megatrain.distributed import Placement
from megatrain.planning import Hardware
from megatrain.planning.hardware import GIB
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.loss import LOSS_TYPES, GRPOStats, token_weights, weight_totals
from megatrain.recipes.grpo.plan import grpo_plan, training_config
from megatrain.recipes.grpo.ranks import job_rows, job_stats, rank_rows, rollout_seed

RANKS = ["--grpo.prompts_per_step", "4"]  # 4 x 4 = 16 sequences: 8 a rank on 2 ranks


def test_each_rank_takes_whole_groups_and_one_process_is_unchanged() -> None:
    rows = [p for p in "abcd" for _ in range(3)]  # 4 prompts x 3 generations, as the recipe
    shares = [rows[rank_rows(len(rows), r, 2)] for r in range(2)]
    assert shares == [list("aaabbb"), list("cccddd")]  # whole groups, in order
    assert rollout_seed(42, 7, 0, 1) == 42 * 1_000_003 + 7  # one process's seed, as before
    seeds = {rollout_seed(42, i, r, 4) for i in range(50) for r in range(4)}
    assert len(seeds) == 200  # every (batch, rank) its own
    values = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    assert torch.equal(job_rows(values, 0, 1).isnan(), values.isnan())  # identity alone
    stats = GRPOStats(tokens=3, kl_sum=0.5)
    assert job_stats(stats, 1) is stats


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_ranks_weights_are_one_process_weights(loss_type: str) -> None:
    """Each rank's micro-batches weighted with the whole batch's totals give, bit for bit, the
    weights one process gives the same rows (so the ranks' summed losses are its loss)."""
    gen = torch.Generator().manual_seed(0)
    masks = [(torch.rand(4, 9, generator=gen) < 0.6).long() for _ in range(4)]
    alone = token_weights(masks, loss_type=loss_type, max_completion_length=9)
    totals = tuple(map(sum, zip(*(weight_totals(masks[r::2]) for r in range(2)), strict=True)))
    assert totals == weight_totals(masks)
    for r in range(2):
        mine = token_weights(
            masks[r::2], loss_type=loss_type, max_completion_length=9, job_totals=totals
        )
        assert all(torch.equal(a, b) for a, b in zip(mine, alone[r::2], strict=True))
    own = token_weights(masks[:2], loss_type=loss_type, max_completion_length=9)
    assert not torch.equal(own[0], alone[0])  # normalised over one rank's rows: another weight


def _builder(world: int, *extra: str) -> RunBuilder:
    cfg = training_config(load_config(None, [*MODEL, *GRPO, *RANKS, *extra]), world)
    placement = Placement(torch.device("cuda"), 0, world, 0, world)
    hw = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)
    return RunBuilder(cfg, hardware=hw, placement=placement)


def test_a_rank_plans_its_share_and_no_streamed_rollout() -> None:
    bf16 = ("--grpo.rollout_weights", "bf16")  # no compact fallback before the streamed path
    one, two = _builder(1, *bf16), _builder(2, *bf16)
    assert one.cfg.training.gradient_accumulation_steps == 4  # 16 rows in micro-batches of 4
    assert two.cfg.training.gradient_accumulation_steps == 2  # each rank's 8
    alone, ranked = grpo_plan(one), grpo_plan(two)
    assert (alone.rollout.sequences, ranked.rollout.sequences) == (16, 8)
    assert ranked.training.tokens_per_step == 8 * 64 and ranked.fits
    tight = grpo_plan(
        two, free_gpu_bytes=GIB + ranked.rollout.gpu_peak_bytes - 1
    )  # measured: half the margin
    assert tight.rollout.streamed and not tight.fits  # one process would stream; ranks cannot
    assert "does not run under torchrun yet" in tight.problems[-1]
    assert grpo_plan(one, free_gpu_bytes=GIB + alone.rollout.gpu_peak_bytes - 1).fits
    # auto: the ranks fall back to a compact resident rollout (each quantizes the gathered
    # blocks) before the streamed path
    auto = grpo_plan(_builder(2), free_gpu_bytes=GIB + ranked.rollout.gpu_peak_bytes - 1)
    assert auto.rollout.weights == "fp8" and auto.fits


def test_a_kl_run_on_ranks_keeps_its_gpu_tier() -> None:
    # the reference pass runs on a sharded tier (engine.serving; tests/distributed/
    # test_distributed_tier_reference.py): the tier is the run's, as without the KL term
    beta = ["--grpo.beta", "0.1"]
    for tier in ("auto", 2):
        cfg = load_config(
            None, [*MODEL, *GRPO, *RANKS, *beta, "--memory.gpu_state_blocks", str(tier)]
        )
        assert training_config(cfg, 2).memory.gpu_state_blocks == tier
