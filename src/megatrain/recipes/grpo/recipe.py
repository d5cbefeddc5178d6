"""The GRPO recipe (`megatrain grpo`): the base recipe's lifecycle (recipes/base.py: output
folder, plan and fit, disk check, build, resume incl. the world-size check, checkpoints, export,
Ctrl-C) with GRPO's data, step and metrics. The only GRPO module that reads the config, with
its mixin checkpoint.py (the KL reference in checkpoints and the disk check).

What differs from the base: the data are prompts and reward functions; the plan covers both
phases, rollout and training (plan.py); one unit of training is a generation batch of
`prompts_per_step` prompts x `num_generations` completions, trained for `num_iterations`
optimizer steps; checkpoints also hold the KL reference (grpo.beta > 0), and the disk check
counts it.

One generation batch: sample completions with the current weights (rollout.py), score them
(rewards.py), group-normalise the rewards into advantages (advantages.py), lay the sequences
out as micro-batches (sequences.py: grouped by length where there are several); with
num_iterations > 1 keep their log-probs under the current weights (the "old" policy), with
beta > 0 their log-probs under the reference weights;
then take num_iterations engine steps on the GRPO objective (loss.py).

Under torchrun (recipes/grpo/ranks.py) each rank samples and scores its share of the batch's
prompt groups; the rewards are gathered so that every rank computes the whole batch's
advantages and metrics, the loss weights are normalised over the whole batch, and the engine
trains data-parallel on the sharded store (gradients and loss summed over the ranks).

Exact resume: checkpoints are written at generation-batch boundaries only (the base saves when
the step crosses a multiple of save_every, and a batch's steps are one unit); the prompts of
batch g and its sampling seed are pure functions of (grpo.seed, g) and the rank, so a resumed
run (on as many ranks: the base refuses another count) draws the same prompts and, from the
same weights, the same completions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatrain.config import TrainConfig
from megatrain.data.pipeline import pad_token_id_of
from megatrain.distributed import rank_env
from megatrain.engine.head import TokenObjective
from megatrain.metrics import MetricsLogger
from megatrain.model.loading import is_vision_language
from megatrain.package_assets import demo_assets_dir
from megatrain.recipes.base import Recipe
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.advantages import group_advantages
from megatrain.recipes.grpo.checkpoint import ReferenceCheckpoint
from megatrain.recipes.grpo.loss import GRPOLoss, token_weights, weight_totals
from megatrain.recipes.grpo.phase_memory import PhasePeak
from megatrain.recipes.grpo.plan import (
    GRPOPlan,
    decode_mode,
    format_rollout,
    grpo_plan,
    rollout_reserve,
    training_config,
)
from megatrain.recipes.grpo.prompts import Prompt, load_prompts
from megatrain.recipes.grpo.ranks import (
    job_rows,
    job_stats,
    job_totals,
    rank_rows,
)
from megatrain.recipes.grpo.rewards import load_reward, score
from megatrain.recipes.grpo.rollout import Rollout
from megatrain.recipes.grpo.rollout_phase import RolloutPhase
from megatrain.recipes.grpo.sequences import (
    completion_mask,
    length_order,
    per_row,
    per_token,
    sequence_batches,
)
from megatrain.recipes.records import report_plan, step_record


@dataclass
class GRPOSummary:
    steps: int
    rewards: list[float]  # mean reward of each optimizer step's generation batch
    checkpoint: Path | None
    export_dir: Path | None


@dataclass
class _Generation:
    """One generation batch, ready for its optimizer steps."""

    batches: list[Any]
    inputs: list[dict[str, torch.Tensor]]
    record: dict[str, Any]  # its rollout metrics
    began: float  # time.perf_counter() when its rollout began
    importance_cap: float | None = None  # its rollout's weights differ: TIS (loss.py)


class GRPOTrainer(RolloutPhase, ReferenceCheckpoint, Recipe):
    """One GRPO run (recipes/base.py has the lifecycle and its invariants).

    Invariant: `step` is a multiple of num_iterations between generation batches.
    """

    loss_name = "GRPO loss"

    def make_builder(self, cfg: TrainConfig) -> RunBuilder:
        return RunBuilder(cfg, gpu_reserve=rollout_reserve)  # the GPU tier leaves it room

    def prepare_config(self, cfg: TrainConfig) -> TrainConfig:
        env = rank_env()  # torchrun's ranks, before the process group (and anything) starts
        # the plan's batch and rows are the engine's
        return training_config(cfg, env.world_size if env else 1)

    def build_data(self) -> None:
        d, g = self.cfg.data, self.cfg.grpo
        self.prompts = load_prompts(
            d.dataset_names(),
            Path(d.dataset_dir).expanduser() if d.dataset_dir else demo_assets_dir(),
            self.tokenizer,
            chat_template=d.chat_template,
            system_prompt=d.system_prompt,
            max_prompt_length=g.max_prompt_length,
            max_samples=d.max_samples,
            seed=d.seed,
        )
        self.rewards = [load_reward(n, format_pattern=g.format_pattern) for n in g.reward_funcs]

    def plan_run(self) -> GRPOPlan:
        if is_vision_language(self.builder.hf_config):  # before anything loads
            raise ValueError(
                f"model type {self.builder.hf_config.model_type!r} is a vision-language model: "
                "megatrain grpo generates with the language model only and does not take one "
                "yet; train it with megatrain train or megatrain dpo (docs/vision.md)"
            )
        return grpo_plan(self.builder)  # both phases: the fit check covers the rollout too

    def report_plan(self, plan: GRPOPlan) -> None:
        report_plan(plan.training, self.builder.placement.is_cuda)
        print(format_rollout(plan), flush=True)

    def build_parts(self) -> None:
        b = self.builder
        self.reference = b.reference(self.store) if self.cfg.grpo.beta > 0 else None
        self.pad_id = pad_token_id_of(self.tokenizer)
        self.eos_ids = [self.tokenizer.eos_token_id]
        self.min_completion_tokens = self.cfg.grpo.min_completion_length
        self.decode = decode_mode(b)[0]  # how resident rollouts decode (recipes/grpo/decode.py)
        self.rank, self.world = b.placement.rank, b.placement.world_size
        self.told = False  # a rollout path other than the plan's was printed

    def count_steps(self) -> int:
        t, g = self.cfg.training, self.cfg.grpo
        if t.max_steps is not None:
            if t.max_steps % g.num_iterations:
                raise ValueError(
                    f"training.max_steps={t.max_steps} is not a multiple of "
                    f"grpo.num_iterations={g.num_iterations}: every generation batch trains "
                    "num_iterations steps; set max_steps to a multiple"
                )
            return t.max_steps
        batches = math.ceil(t.num_epochs * len(self.prompts) / g.prompts_per_step)
        return max(1, batches) * g.num_iterations

    def batch_prompts(self, index: int) -> list[Prompt]:
        """Generation batch `index`: the next prompts of a seeded permutation per epoch."""
        n, per = len(self.prompts), self.cfg.grpo.prompts_per_step
        out = []
        for k in range(index * per, (index + 1) * per):
            epoch, pos = divmod(k, n)
            order = np.random.default_rng([self.cfg.grpo.seed, epoch]).permutation(n)
            out.append(self.prompts[int(order[pos])])
        return out

    # ------------------------------------------------------------------ training

    def train(self) -> GRPOSummary:
        self.step_rewards: list[float] = []
        end = self.run()
        return GRPOSummary(self.step, self.step_rewards, end.checkpoint, end.export_dir)

    def advance(self, metrics: MetricsLogger) -> None:
        """One generation batch and its num_iterations optimizer steps."""
        g = self.cfg.grpo
        gen = self._generation(self.step // g.num_iterations)
        for it in range(g.num_iterations):
            record = self._train_step(gen, metrics, it)
            self.step_rewards.append(record["reward"])

    def _generation(self, index: int) -> _Generation:
        """Generation batch `index`: this rank's share sampled (recipes/grpo/ranks.py), every
        share scored, the whole batch's advantages; this rank's rows laid out as micro-batches,
        with the per-token inputs of the GRPO objective."""
        g, began = self.cfg.grpo, time.perf_counter()
        job = [p for p in self.batch_prompts(index) for _ in range(g.num_generations)]
        mine = rank_rows(len(job), self.rank, self.world)
        prompts = job[mine]
        rollout, timing, cap = self._rollout(prompts, index)
        texts = self.tokenizer.batch_decode(rollout.completions, skip_special_tokens=True)
        scores = score(self.rewards, prompts, texts, rollout.completions)
        lengths = [len(c) for c in rollout.completions]
        rows = torch.cat([scores, torch.tensor([lengths, rollout.clipped]).T.double()], 1)
        every = job_rows(rows, self.rank, self.world)  # the job's, in one process's order
        adv = group_advantages(
            every[:, :-2],
            torch.tensor(g.weights),
            num_generations=g.num_generations,
            scaling=g.reward_scaling,
        )
        batches, inputs = self._layout(prompts, rollout, adv.advantages[mine])
        t1 = time.perf_counter()
        peak = PhasePeak(self.builder.device)
        self._add_logprobs(batches, inputs)
        logprob_memory = peak.record("logprob") if self._logprob_passes else {}
        total = torch.tensor(adv.rewards)
        record = {
            f"rewards/{fn.name}/mean": float(torch.nanmean(column))
            for fn, column in zip(self.rewards, every[:, :-2].T, strict=True)
        }
        record |= {
            "reward": float(torch.nanmean(total)),
            "reward_std": float(total[~torch.isnan(total)].std()) if total.numel() > 1 else 0.0,
            "completion_length": float(every[:, -2].mean()),
            "completion_length_max": int(every[:, -2].max()),
            "clipped_share": float(every[:, -1].mean()),
            "std_zero_share": adv.std_zero_share,
            "time/generation_s": timing.pop("time/generation_s"),
            "time/logprob_s": round(time.perf_counter() - t1, 4),
            **timing,
            **logprob_memory,
        }
        return _Generation(batches, inputs, record, began, cap)

    def _layout(
        self, prompts: list[Prompt], rollout: Rollout, advantages: list[float]
    ) -> tuple[list[Any], list[dict[str, torch.Tensor]]]:
        """This rank's sequences as micro-batches (grouped by length), and each one's advantages
        and loss weights per token, normalised over the whole batch (every rank's); the
        rollout's log-probs where it kept them (importance sampling)."""
        g, completions = self.cfg.grpo, rollout.completions
        rows = self.builder.batch()[0]  # the plan's, when "auto"
        lengths = [len(p.prompt_ids) + len(c) for p, c in zip(prompts, completions, strict=True)]
        order = length_order(lengths, rows)
        batches = sequence_batches(
            [prompts[i].prompt_ids for i in order],
            [completions[i] for i in order],
            micro_batch_size=rows,
            pad_token_id=self.pad_id,
            pad_to_multiple_of=self.cfg.data.pad_to_multiple_of,
        )
        masks = [completion_mask(x) for x in batches]
        weights = token_weights(
            masks,
            loss_type=g.loss_type,
            max_completion_length=g.max_completion_length,
            job_totals=job_totals(*weight_totals(masks)),
        )
        inputs = [
            {"advantages": a, "weights": w}
            for a, w in zip(per_row([advantages[i] for i in order], batches), weights, strict=True)
        ]
        if rollout.logps is not None:
            for k, logps in enumerate(per_token([rollout.logps[i] for i in order], batches)):
                inputs[k]["rollout_logps"] = logps
        return batches, inputs

    @property
    def _logprob_passes(self) -> bool:
        """Whether a generation batch runs a log-prob pass (plan.py `logprob_passes`)."""
        return self.cfg.grpo.num_iterations > 1 or self.reference is not None

    def _add_logprobs(self, batches: list[Any], inputs: list[dict[str, torch.Tensor]]) -> None:
        """The old policy's log-probs (num_iterations > 1) and the reference's (beta > 0)."""
        g = self.cfg.grpo
        if g.num_iterations > 1:
            for k, logp in enumerate(self.engine.logprobs(batches, temperature=g.temperature)):
                inputs[k]["old_logps"] = logp
        if self.reference is not None:
            with self.engine.serving(self.reference):
                ref = self.engine.logprobs(batches, temperature=g.temperature)
            for k, logp in enumerate(ref):
                inputs[k]["ref_logps"] = logp

    def _train_step(self, gen: _Generation, metrics: MetricsLogger, iteration: int) -> dict:
        g = self.cfg.grpo
        lr = self.schedule.lr_at(self.step)
        fn = GRPOLoss(
            beta=g.beta,
            epsilon=g.epsilon,
            epsilon_high=g.upper_epsilon,
            use_old=g.num_iterations > 1,
            importance_cap=gen.importance_cap,
        )
        t0 = time.perf_counter()
        peak = PhasePeak(self.builder.device)
        objective = TokenObjective(fn, gen.inputs, temperature=g.temperature)
        result = self.optimizer_step(  # out of GPU memory: a smaller plan (recipes/oom.py)
            lambda engine: engine.train_step(gen.batches, lr=lr, objective=objective), metrics
        )
        step_s = time.perf_counter() - t0
        train_memory = peak.record("train")  # before step_record resets the peak
        record = step_record(result, lr, step_s, self.builder.device) | gen.record
        record["time/train_s"] = round(step_s, 4)
        # the optimizer step's whole wall time: with the rollout, its scoring and the log-prob
        # passes for a generation batch's first step (the plan's "GRPO step" for one iteration)
        record["time/grpo_step_s"] = round(
            time.perf_counter() - (gen.began if iteration == 0 else t0), 4
        )
        stats = job_stats(fn.stats, self.world)  # over every rank's tokens
        record["kl"] = stats.kl
        record["clip_ratio"] = stats.clip_ratio
        record["entropy"] = stats.entropy
        if gen.importance_cap is not None:
            record["importance_ratio"] = stats.importance
            record["importance_capped_share"] = stats.importance_capped_share
        record["iteration"] = iteration
        record.update(train_memory)
        metrics.log_step(self.step, record)
        return record
