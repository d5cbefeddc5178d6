"""Supervised fine-tuning and pre-training (`megatrain train`): the base recipe's lifecycle
(recipes/base.py: output folder, plan and fit, disk check, build, resume, checkpoints, export,
Ctrl-C) with this recipe's data, step and metrics.

What differs from the base: the data are the prepared datasets (data/pipeline.py; chat
samples, or a pre-training corpus whose rows are full `cutoff_len` rows); one optimizer step is
`grad_accum` micro-batches from the shuffled loader at the planned micro-batch size; an eval
(every `training.eval_every` steps and at the end, before the final checkpoint) averages the
loss over the eval set; the steps follow `training.max_steps`, or `training.num_epochs` over
the loader.

Exact resume: a checkpoint holds the store (fp32 master, AdamW states, per-block step), the
data loader's position, the RNG states and the step; the learning rate is a pure function of
the step. So `train 6 steps` and `train 3, resume, train 3` see identical batches, weights and
learning rates, and produce identical losses.

Several ranks (torchrun; docs/multi_gpu.md): the training loader reads this rank's rows
(data/ranks.py); eval batches are split over the ranks and their sums all-reduced; rank 0
alone writes the folder, metrics and export, every rank its part of each checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.batch import Batch
from megatrain.checkpoint.rng import rng_state, set_rng_state
from megatrain.data.sample import image_share
from megatrain.distributed import Placement
from megatrain.metrics import MetricsLogger
from megatrain.recipes.base import Recipe
from megatrain.recipes.records import step_record


@dataclass
class TrainSummary:
    steps: int
    losses: list[float]
    eval_loss: float | None
    checkpoint: Path | None
    export_dir: Path | None


class Trainer(Recipe):
    """One SFT or pre-training run (recipes/base.py has the lifecycle and its invariants).

    Invariant: the loader position and RNG state after step N are what a checkpoint of step N
    holds, so resuming from it continues bit for bit.
    """

    loss_fix = "lower optimizer.learning_rate, keep optimizer.max_grad_norm > 0, or check the data"

    def build_data(self) -> None:
        self.data = self.builder.data()
        self.builder.image_share = image_share(self.data.train)  # the plan's vision load

    def build_parts(self) -> None:
        self.micro_batch_size, self.grad_accum = self.plan.micro_batch_size, self.plan.grad_accum
        self.loader = self.builder.loader(self.data.train)

    def count_steps(self) -> int:
        t = self.cfg.training
        if t.max_steps is not None:
            return t.max_steps
        # micro-batches of the whole job (every rank's) per epoch over those of one job step: N
        # ranks take the steps of one process with N times the accumulation (data/ranks.py)
        per_epoch = len(self.loader) / (self.grad_accum * self.builder.placement.world_size)
        return max(1, math.ceil(t.num_epochs * per_epoch))

    def load_state(self, state: dict[str, Any], path: Path) -> None:
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])

    def checkpoint_state(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "rng": rng_state()}

    # ------------------------------------------------------------------ training

    def train(self) -> TrainSummary:
        self.losses: list[float] = []
        self.eval_loss: float | None = None
        self._stream = self._micro_batches()
        end = self.run()
        return TrainSummary(
            steps=self.step,
            losses=self.losses,
            eval_loss=self.eval_loss,
            checkpoint=end.checkpoint,
            export_dir=end.export_dir,
        )

    def _micro_batches(self) -> Iterator[Batch]:
        while True:
            yield from self.loader

    def advance(self, metrics: MetricsLogger) -> None:
        """One optimizer step of `grad_accum` micro-batches; an eval when one is due."""
        cfg = self.cfg
        micro = [next(self._stream) for _ in range(self.grad_accum)]
        lr = self.schedule.lr_at(self.step)
        t0 = time.perf_counter()
        # out of GPU memory: undone and run again on a smaller plan (megatrain/recipes/oom.py)
        result = self.optimizer_step(lambda engine: engine.train_step(micro, lr=lr), metrics)
        step_s = time.perf_counter() - t0
        self.losses.append(result.loss)
        metrics.log_step(self.step, step_record(result, lr, step_s, self.device))
        if cfg.logging.timeline:
            metrics.console(f"step {self.step}: {result.timeline.summary()}")
        if cfg.training.eval_every and self.step % cfg.training.eval_every == 0:
            self.eval_loss = self._evaluate(metrics)

    def finish(self, metrics: MetricsLogger) -> None:
        if self.data.eval:
            self.eval_loss = self._evaluate(metrics)

    def _evaluate(self, metrics: MetricsLogger) -> float | None:
        if not self.data.eval:
            return None
        loader = self.builder.loader(self.data.eval, train=False)
        total, tokens = 0.0, 0
        limit = self.cfg.training.max_eval_batches
        batches = [b for i, b in enumerate(loader) if limit is None or i < limit]
        for batch, counted in _rank_share(batches, self.builder.placement):
            loss_sum, n = self.engine.eval_loss([batch], counted=counted)  # summed over ranks
            total, tokens = total + loss_sum, tokens + n
        loss = total / max(tokens, 1)
        metrics.log_eval(self.step, loss, tokens)
        return loss


def _rank_share(batches: list[Batch], placement: Placement) -> list[tuple[Batch, bool]]:
    """This rank's eval batches (every world-th), each with whether it counts: every rank runs
    as many forwards (they hold collectives), one without a batch of its own repeats one."""
    world, rank = placement.world_size, placement.rank
    mine = [(b, True) for b in batches[rank::world]]
    rounds = -(-len(batches) // world)
    return mine + [(batches[0], False)] * (rounds - len(mine))
