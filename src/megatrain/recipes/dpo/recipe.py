"""The preference recipe (`megatrain dpo`): the base recipe's lifecycle (recipes/base.py: output
folder, plan and fit, disk check, build, resume, checkpoints, export, Ctrl-C) with preference
data, the preference objective and TRL's metrics. The only DPO module that reads the config.

What differs from the base: the data are pairs (data.stage dpo) or KTO rows with their KL rows
(data.stage kto; data/preference_data.py), `training.micro_batch_size` rows = half as many pairs
per micro-batch; the reference log-probs (not for the reference-free losses orpo and simpo) are,
per dpo.reference, precomputed for every pair (and eval pair) in one streamed pass of the initial
weights before the first step, or computed per step from a host copy of the initial weights
(ReferenceWeights, a forward-only pass over the step's micro-batches; reference.py); one
optimizer step is `grad_accum` micro-batches per rank (steps.py) on `PreferenceObjective`
(objective.py); the step's metrics are TRL's (rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected; KTO: kl)
over the step's pairs; an eval (every training.eval_every steps and at the end) is the same loss
and metrics over the eval pairs, without gradients.

Exact resume: a checkpoint holds the store, the loader's position and the reference: the table
(REFERENCE_FILE, 8 bytes per pair) or the initial weights (ReferenceWeights.FILE); a resumed run
loads it rather than recomputing it from trained weights, so `dpo 6 steps` and `dpo 3, resume,
dpo 3` see the same pairs, references, weights and learning rates, and produce identical losses.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatrain.config import TrainConfig
from megatrain.config.dpo import check_preference_run
from megatrain.data.preference_data import PairLoader, kto_pairs, prepare_preference
from megatrain.distributed import rank_sums
from megatrain.metrics import MetricsLogger
from megatrain.planning.plan import ResourcePlan
from megatrain.recipes.base import Recipe
from megatrain.recipes.dpo.eval import evaluate_pairs
from megatrain.recipes.dpo.loss import REFERENCE_FREE, LossSettings
from megatrain.recipes.dpo.objective import PreferenceObjective
from megatrain.recipes.dpo.plan import (
    format_reference,
    reference_plan,
    with_reference,
)
from megatrain.recipes.dpo.reference import (
    ReferenceTable,
    precompute_reference,
    reference_rows,
    weights_reference,
)
from megatrain.recipes.dpo.steps import StepPairs, step_pairs
from megatrain.recipes.records import report_plan, step_record
from megatrain.store.reference import ReferenceWeights

REFERENCE_FILE = "reference_logps.pt"


@dataclass
class DPOSummary:
    steps: int
    losses: list[float]
    accuracies: list[float] = field(default_factory=list)  # rewards/accuracies per step (dpo)
    eval_loss: float | None = None
    checkpoint: Path | None = None
    export_dir: Path | None = None


class DPOTrainer(Recipe):
    """One preference run (recipes/base.py has the lifecycle and its invariants).

    Invariant: `reference` is None until the first step or a resume sets it, then the table of
    the run's initial weights (train and eval pairs), whatever the step.
    """

    loss_name = "preference loss"

    def prepare_config(self, cfg: TrainConfig) -> TrainConfig:
        check_preference_run(cfg.data.stage, cfg.training.micro_batch_size)
        return cfg

    def build_data(self) -> None:
        settings = {k: v for k, v in vars(self.cfg.dpo).items() if k != "reference"}
        self.settings = LossSettings(**settings)
        self.data = prepare_preference(self.cfg.data, self.tokenizer)

    def plan_run(self) -> ResourcePlan:
        """The builder's plan, refused where the reference's host bytes do not fit beside it."""
        b, plan = self.builder, self.builder.plan()
        self.reference_plan = reference_plan(
            plan,
            b.spec,
            loss_type=self.settings.loss_type,
            reference=self.cfg.dpo.reference,
            pairs=(len(self.data.train), len(self.data.eval or [])),
            world_size=b.placement.world_size,
            swap_s=b.reference_swap_s(plan.gpu_state_blocks),
        )
        return with_reference(
            plan, self.reference_plan, b.hardware, self.cfg.memory.host_margin_gib
        )

    def report_plan(self, plan: ResourcePlan) -> None:
        gpu = self.builder.placement.is_cuda
        report_plan(plan, gpu)
        print(format_reference(self.reference_plan, timed=gpu) + " (predicted)", flush=True)

    def build_parts(self) -> None:
        rows, self.grad_accum = self.plan.micro_batch_size, self.plan.grad_accum
        self.pairs_per_micro = max(1, rows // 2)
        d, p = self.cfg.data, self.builder.placement
        self.rank, self.world = p.rank, p.world_size
        self.desirable: dict[str, np.ndarray] = {}
        self.loader = self._pair_loader("train", self.data.train, shuffle=d.shuffle)
        self.eval_loader = None
        if self.data.eval:
            self.eval_loader = self._pair_loader("eval", self.data.eval, shuffle=False)
        self.reference: dict[str, torch.Tensor] | None = None
        self.weights: ReferenceWeights | None = None
        if self.uses_weights:  # the engine holds the initial weights now (a resume reloads them)
            self.weights = self.builder.reference(self.store)

    def _pair_loader(self, split: str, rows: list[Any], *, shuffle: bool) -> PairLoader:
        d = self.cfg.data
        pairs = rows
        if d.stage == "kto":
            pairs, self.desirable[split] = kto_pairs(rows, cutoff_len=d.cutoff_len)
        return PairLoader(
            pairs,
            micro_batch_size=self.pairs_per_micro,
            seq_len=self.cfg.seq_len,
            pad_token_id=self.data.pad_token_id,
            pad_to_multiple_of=d.pad_to_multiple_of,
            shuffle=shuffle,
            seed=d.seed,
        )

    def count_steps(self) -> int:
        t = self.cfg.training
        if t.max_steps is not None:
            return t.max_steps
        per_epoch = len(self.loader) / (self.grad_accum * self.world)
        return max(1, math.ceil(t.num_epochs * per_epoch))

    # ------------------------------------------------------------------ the reference

    @property
    def needs_reference(self) -> bool:
        return self.settings.loss_type not in REFERENCE_FREE

    @property
    def uses_weights(self) -> bool:
        """The reference comes from the initial weights kept in host RAM, per step."""
        return self.needs_reference and self.cfg.dpo.reference == "weights"

    @property
    def needs_table(self) -> bool:
        """The precomputed table is still to be made (before the first step or eval)."""
        return self.needs_reference and not self.uses_weights and self.reference is None

    def _reference_pass(self, metrics: MetricsLogger) -> dict[str, torch.Tensor]:
        """Both tables, from the weights the engine holds now (the run's initial weights); the
        pass's pairs, time and tokens to metrics.jsonl (a "reference_pass" record)."""
        t0 = time.perf_counter()
        passes = {"train": self._table(self.loader)}
        if self.eval_loader is not None:
            passes["eval"] = self._table(self.eval_loader)
        seconds = time.perf_counter() - t0
        pairs = sum(len(p.table) for p in passes.values())
        tokens = sum(p.tokens for p in passes.values())
        record = {"pairs": pairs, "seconds": round(seconds, 3), "tokens": tokens}
        record["tokens_per_s"] = round(tokens / seconds, 1) if seconds > 0 else 0.0
        metrics.log_event(
            self.step,
            "reference_pass",
            record,
            f"reference: log-probs of {pairs} pairs precomputed in {seconds:.1f} s (one "
            "streamed pass of the initial weights)",
        )
        return {split: p.table for split, p in passes.items()}

    def _table(self, loader: PairLoader) -> ReferenceTable:
        return precompute_reference(
            self.engine,
            loader,
            micro_batches_per_pass=self.grad_accum,
            rank=self.rank,
            world_size=self.world,
        )

    def load_state(self, state: dict[str, Any], path: Path) -> None:
        self.loader.load_state_dict(state["loader"])
        if self.weights is not None:
            self._load_weights(path)
            return
        if not self.needs_reference:
            return
        file = path / REFERENCE_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file}: missing; a dpo.loss_type={self.settings.loss_type!r} run resumes with "
                "the reference log-probs of its initial weights, saved with each checkpoint; "
                "resume from a checkpoint of a run with a reference loss, or start a new run "
                "(another training.output_dir)"
            )
        tables = torch.load(file, weights_only=True)
        expected = {"train": self.loader.num_rows}
        if self.eval_loader is not None:
            expected["eval"] = self.eval_loader.num_rows
        found = {k: len(v) for k, v in tables.items()}
        if found != expected:
            raise ValueError(
                f"{file} holds reference log-probs of {found} pairs, this run's data have "
                f"{expected}: resume with the data (and data.val_size) of the checkpoint's run"
            )
        self.reference = tables
        print(f"reference: log-probs of the initial weights loaded from {file}", flush=True)

    def _load_weights(self, path: Path) -> None:
        """The reference weights of the checkpoint's run (its initial weights, not the loaded)."""
        assert self.weights is not None
        if not (path / self.weights.file_name).is_file():
            raise FileNotFoundError(
                f"{path / self.weights.file_name}: missing; a dpo.reference: weights run resumes "
                "with the initial weights saved with each checkpoint; resume this checkpoint "
                "with the dpo.reference of its run (precomputed, or a reference-free loss), or "
                "start a new run (another training.output_dir)"
            )
        self.weights.load(path)
        print(f"reference: initial weights loaded from {path}", flush=True)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def write_checkpoint_files(self, folder: Path) -> None:
        if self.reference is not None:  # every rank holds the whole table: rank 0 writes it
            torch.save(self.reference, folder / REFERENCE_FILE)

    def write_rank_files(self, folder: Path) -> None:
        if self.weights is not None:  # under several ranks, each rank's shards
            self.weights.save(folder)

    def extra_checkpoint_bytes(self) -> int:
        """The reference (table: 8 bytes per pair and eval pair; or the weights' copy), plus
        its file's framing."""
        ref = self.reference_plan
        return ref.checkpoint_bytes + 4096 if ref.checkpoint_bytes else 0

    # ------------------------------------------------------------------ training

    def train(self) -> DPOSummary:
        self.summary = DPOSummary(steps=0, losses=[])
        end = self.run()
        s = self.summary
        s.steps, s.checkpoint, s.export_dir = self.step, end.checkpoint, end.export_dir
        return s

    def advance(self, metrics: MetricsLogger) -> None:
        """One optimizer step on the preference objective; an eval when one is due."""
        if self.needs_table:  # before step 1 (not on resume)
            self.reference = self._reference_pass(metrics)
        step = step_pairs(
            self.loader, grad_accum=self.grad_accum, rank=self.rank, world_size=self.world
        )
        lr = self.schedule.lr_at(self.step)
        objective = self._objective(step, "train")
        t0 = time.perf_counter()
        result = self.optimizer_step(  # out of GPU memory: a smaller plan (recipes/oom.py)
            lambda engine: engine.train_step(step.batches, lr=lr, objective=objective.objective()),
            metrics,
        )
        step_s = time.perf_counter() - t0
        record = step_record(result, lr, step_s, self.device)
        record |= self._trl_metrics(objective.metrics, step.job_pairs, "train")
        self.summary.losses.append(result.loss)
        if "rewards/accuracies" in record:
            self.summary.accuracies.append(record["rewards/accuracies"])
        metrics.log_step(self.step, record)
        every = self.cfg.training.eval_every
        if every and self.step % every == 0:
            self._evaluate(metrics)

    def _objective(self, step: StepPairs, split: str) -> PreferenceObjective:
        refs = None
        if self.weights is not None:  # one forward-only pass of the initial weights
            refs = weights_reference(self.engine, self.weights, step.batches)
        elif self.reference is not None:
            refs = [reference_rows(self.reference[split], p) for p in step.pairs]
        desirable = None
        if self.settings.loss_type == "kto":
            desirable = [torch.from_numpy(self.desirable[split][p]) for p in step.pairs]
        return PreferenceObjective(
            step.batches, self.settings, step.totals, ref_logps=refs, desirable=desirable
        )

    def _trl_metrics(self, sums: dict[str, float], pairs: np.ndarray, split: str) -> dict:
        """The step's metric sums (every rank's) as TRL's means: over the step's pairs; KTO's
        chosen / rejected over its desirable / undesirable rows, kl (a mean already) as is."""
        names = sorted(k for k in sums if k != "kl")
        totals = dict(zip(names, rank_sums([sums[k] for k in names]), strict=True))
        count = {k: float(len(pairs)) for k in names}
        if self.settings.loss_type == "kto":
            good = int(self.desirable[split][pairs].sum())
            for k in names:
                count[k] = float(good if k.endswith("/chosen") else len(pairs) - good)
        out = {k: totals[k] / max(count[k], 1.0) for k in names}
        if "kl" in sums:
            out["kl"] = sums["kl"]
        return out

    def finish(self, metrics: MetricsLogger) -> None:
        if self.eval_loader is not None:
            self._evaluate(metrics)

    def _evaluate(self, metrics: MetricsLogger) -> None:
        """The preference loss and TRL's metrics over the eval pairs (no gradients)."""
        if self.eval_loader is None:
            return
        if self.needs_table:
            self.reference = self._reference_pass(metrics)
        loss, sums, pairs = evaluate_pairs(
            self.engine,
            self.eval_loader,
            lambda step: self._objective(step, "eval"),
            grad_accum=self.grad_accum,
            rank=self.rank,
            world_size=self.world,
        )
        record = self._trl_metrics(sums, pairs, "eval")
        self.summary.eval_loss = loss
        shown = " ".join(f"{k} {v:.4f}" for k, v in record.items())
        metrics.log_event(
            self.step,
            "eval",
            {"eval_loss": loss, **{f"eval_{k}": v for k, v in record.items()}},
            f"step {self.step}: eval loss {loss:.4f} over {len(pairs)} pairs; {shown}",
        )
