"""The training recipe: the only module that reads the whole config and wires the parts.

setup (tokenizer, data, model, host store, engine, loader, schedule, resume) -> train (steps,
eval, checkpoints) -> finish (final eval, checkpoint, Hugging Face export) -> close.

Exact resume: a checkpoint holds the store (fp32 master, AdamW states, per-block step), the
data loader's position, the RNG states and the step; the learning rate is a pure function of
the step. So `train 6 steps` and `train 3, resume, train 3` see identical batches, weights and
learning rates, and produce identical losses.

The output folder (checkpoint/output_dir.py) is locked before anything is loaded and claimed
(config.yaml
written) only once the inputs are validated: tokenizer, data, model config, memory and disk.

Several ranks (torchrun; docs/multi_gpu.md): rank 0 alone holds the output folder (its lock),
writes metrics and the export; each rank writes its part of every checkpoint
(checkpoint/shards.py); eval batches are split over the ranks and their sums all-reduced. A
checkpoint resumes only with the world size that wrote it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from megatrain.batch import Batch
from megatrain.checkpoint.checkpointer import Checkpointer
from megatrain.checkpoint.output_dir import OutputFolder, TrainingInterrupted, interrupted_message
from megatrain.checkpoint.rng import rng_state, set_rng_state
from megatrain.config import TrainConfig, save_config
from megatrain.distributed import Placement, on_rank0
from megatrain.distributed import close as close_process_group
from megatrain.engine.engine import StepResult
from megatrain.metrics import MetricsLogger
from megatrain.model.kernels import kernel_report
from megatrain.planning.disk import check_run_disk, checkpoint_nbytes, run_disk_bytes
from megatrain.planning.plan import ResourcePlan
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.oom import recovering_step
from megatrain.run_files import CONFIG_FILE
from megatrain.trackers import tracker_names


@dataclass
class TrainSummary:
    steps: int
    losses: list[float]
    eval_loss: float | None
    checkpoint: Path | None
    export_dir: Path | None


class Trainer:
    """One training run: owns the run's parts (built by RunBuilder) and its step counter.

    Invariants: `step` counts completed optimizer steps; the store, loader position and RNG
    state after step N are exactly what a checkpoint of step N holds, so resuming from it
    continues bit for bit. Only this class writes into `output_dir`.
    """

    def __init__(self, cfg: TrainConfig, builder: RunBuilder | None = None) -> None:
        self.cfg = cfg
        self.builder = builder or RunBuilder(cfg)
        self.device = self.builder.device
        self.output_dir = Path(cfg.training.output_dir)
        self.run_id = ""  # a resumed run takes its checkpoint's (_resume)
        self.folder: OutputFolder | None = None
        self.checkpointer = Checkpointer(
            self.output_dir,
            world_size=self.builder.placement.world_size,
            keep_last=cfg.checkpoint.keep_last,
        )

        def open_folder() -> None:
            tracker_names(cfg.logging.report_to)  # a tracker's missing package: before anything
            self.folder = OutputFolder(cfg)

        on_rank0(open_folder)  # several ranks: rank 0 alone holds the folder and writes it
        try:
            self._setup()
        except BaseException:
            self._release_folder()
            raise

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        cfg, b = self.cfg, self.builder
        torch.manual_seed(cfg.training.seed)
        self.tokenizer = b.tokenizer()
        self.data = b.data()
        self.plan = b.plan()
        self.plan.require_fit()  # before anything large is allocated
        self._check_disk()  # before training time is spent
        report_plan(self.plan, b.placement.is_cuda)

        def claim() -> None:  # the inputs are good: the folder becomes this run's
            assert self.folder is not None
            self.run_id = self.folder.claim()

        on_rank0(claim)
        self.micro_batch_size, self.grad_accum = self.plan.micro_batch_size, self.plan.grad_accum
        self.structure, self.store = b.model_and_store()
        print(f"model: {self.structure.describe()}", flush=True)
        for line in kernel_report(self.structure):
            print(f"kernels: {line}", flush=True)
        self.engine = b.engine(self.structure, self.store)
        self.loader = b.loader(self.data.train)
        self.total_steps = self._total_steps()
        self.schedule = b.schedule(self.total_steps)
        self.step = 0
        self._resume()

    def _check_disk(self) -> None:
        """Refuse a run whose checkpoints and export the output_dir's disk cannot hold: the
        checkpoints at the bytes of the run's state dtype (planning/disk.py)."""
        c, spec = self.cfg.checkpoint, self.builder.spec
        blocks = [spec.embed_params, *(layer.params for layer in spec.layers), spec.head_params]
        world = self.builder.placement.world_size
        one = checkpoint_nbytes(blocks, self.cfg.optimizer.state_dtype, world=world)
        disk = run_disk_bytes(
            spec.total_params,
            save_every=c.save_every,
            save_final=c.save_final,
            keep_last=c.keep_last,
            export_hf=c.export_hf,
            export_dtype=c.export_dtype,
            total_steps=self.cfg.training.max_steps,
            checkpoint_bytes=one,
            state_dtype=self.cfg.optimizer.state_dtype,
        )
        # a resumed run prunes the kept checkpoints as it writes new ones
        kept = min(len(self.checkpointer.checkpoints()), c.keep_last) if c.resume_from else 0
        check_run_disk(self.output_dir, disk, already_written=kept * one)

    def _total_steps(self) -> int:
        t = self.cfg.training
        if t.max_steps is not None:
            return t.max_steps
        # micro-batches of the whole job (every rank's) per epoch over those of one job step: N
        # ranks take the steps of one process with N times the accumulation (data/ranks.py)
        per_epoch = len(self.loader) / (self.grad_accum * self.builder.placement.world_size)
        return max(1, math.ceil(t.num_epochs * per_epoch))

    def _resume(self) -> None:
        path = self.checkpointer.resume_path(self.cfg.checkpoint.resume_from)
        if path is None:
            return
        state = self.checkpointer.load(path, self.store)  # refuses another world size
        self.engine.weights_loaded()  # a sharded GPU tier gathers the loaded shards
        self.loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.run_id = state.get("run_id") or self.run_id
        print(f"resumed from {path} at step {self.step}", flush=True)

    # ------------------------------------------------------------------ training

    def _micro_batches(self) -> Iterator[Batch]:
        while True:
            yield from self.loader

    def train(self) -> TrainSummary:
        cfg = self.cfg
        metrics = self.builder.metrics(total_steps=self.total_steps, start_step=self.step)
        losses: list[float] = []
        stream = self._micro_batches()
        ga = self.grad_accum
        checkpoint = None
        eval_loss = None
        try:
            while self.step < self.total_steps:
                micro = [next(stream) for _ in range(ga)]
                lr = self.schedule.lr_at(self.step)
                t0 = time.perf_counter()
                result = self._train_step(micro, lr, metrics)
                step_s = time.perf_counter() - t0
                self.step += 1
                if not math.isfinite(result.loss):
                    raise FloatingPointError(
                        f"loss is {result.loss} at step {self.step}: lower "
                        "optimizer.learning_rate, keep optimizer.max_grad_norm > 0, or check "
                        "the data"
                    )
                losses.append(result.loss)
                metrics.log_step(self.step, step_record(result, lr, step_s, self.device))
                if cfg.logging.timeline:
                    metrics.console(f"step {self.step}: {result.timeline.summary()}")
                if cfg.training.eval_every and self.step % cfg.training.eval_every == 0:
                    eval_loss = self._evaluate(metrics)
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    checkpoint = self.save()
            if self.data.eval:
                eval_loss = self._evaluate(metrics)
            every = cfg.checkpoint.save_every
            if cfg.checkpoint.save_final and (not every or self.step % every):
                checkpoint = self.save()
            export_dir = self.export() if cfg.checkpoint.export_hf else None
        except KeyboardInterrupt as e:
            raise TrainingInterrupted(interrupted_message(self.output_dir, self.step)) from e
        finally:
            metrics.close()
        return TrainSummary(
            steps=self.step,
            losses=losses,
            eval_loss=eval_loss,
            checkpoint=checkpoint,
            export_dir=export_dir,
        )

    def _train_step(self, micro: list[Batch], lr: float, metrics: MetricsLogger) -> StepResult:
        """One optimizer step; out of GPU memory, undone and run again on a smaller plan
        (megatrain/recipes/oom.py), which the run reports once per change."""
        return recovering_step(
            self, self.step + 1, lambda engine: engine.train_step(micro, lr=lr), metrics
        )

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

    def save(self) -> Path:
        self.engine.wait_updates()  # every update applied: master and shadow are consistent
        state: dict[str, Any] = {
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "total_steps": self.total_steps,
        }
        return self.checkpointer.save(
            self.step,
            self.store,
            state,
            run_id=self.run_id,
            write_extra=lambda d: save_config(self.cfg, d / CONFIG_FILE),
        )

    def export(self) -> Path:
        self.engine.wait_updates()  # every update applied: the master is the trained model
        return self.builder.export(self.store)

    def close(self) -> None:
        try:
            if self.engine is not None:  # None: a step-down's engine rebuild failed
                self.engine.close()
            close_process_group()
        finally:
            self._release_folder()

    def _release_folder(self) -> None:
        if self.folder is not None:
            self.folder.release()


def _rank_share(batches: list[Batch], placement: Placement) -> list[tuple[Batch, bool]]:
    """This rank's eval batches (every world-th), each with whether it counts: every rank runs
    as many forwards (they hold collectives), one without a batch of its own repeats one."""
    world, rank = placement.world_size, placement.rank
    mine = [(b, True) for b in batches[rank::world]]
    rounds = -(-len(batches) // world)
    return mine + [(batches[0], False)] * (rounds - len(mine))


def report_plan(plan: ResourcePlan, gpu: bool) -> None:
    if plan.batch_reason:
        print(
            f"micro_batch_size auto: {plan.batch_reason}; gradient accumulation {plan.grad_accum}",
            flush=True,
        )
    if plan.tier_reason and plan.gpu_state_blocks:
        print(f"memory.gpu_state_blocks auto: {plan.tier_reason}", flush=True)
    if plan.tiles_reason:
        print(f"memory.mlp_tiles auto: {plan.tiles_reason}", flush=True)
    est = plan.estimate
    print(
        f"resources: host {est.host.total_bytes / 2**30:.1f} GiB"
        + (
            f", GPU peak {est.gpu.peak_bytes / 2**30:.1f} GiB, step {est.time.step_s:.2f} s"
            if gpu
            else ""
        )
        + " (predicted)",
        flush=True,
    )


def step_record(
    result: StepResult, lr: float, step_s: float, device: torch.device | None = None
) -> dict[str, Any]:
    """The metrics record of one optimizer step (what MetricsLogger.log_step takes), with the
    memory the step used (`memory_record`) when `device` is given."""
    record: dict[str, Any] = {
        "loss": result.loss,
        "ce_loss": result.ce_loss,
        "grad_norm": result.grad_norm,
        "clip_coef": result.clip_coef,
        "lr": lr,
        "tokens": result.tokens,
        "target_tokens": result.target_tokens,
        "step_s": round(step_s, 4),
    }
    if result.aux_loss is not None:
        record["aux_loss"] = result.aux_loss
    record.update({f"time/{k}": v for k, v in result.timeline.as_dict().items()})
    if device is not None:
        record.update(memory_record(device))
    return record


def memory_record(device: torch.device) -> dict[str, float]:
    """This process's host RSS now and, on CUDA, the most GPU memory the allocator held
    (`gpu_peak_gib`, reserved: what the card must have) and handed out (`gpu_alloc_peak_gib`)
    since the previous record; the peaks then start again. No sync point (host counters)."""
    record = {"host_rss_gib": round(psutil.Process().memory_info().rss / 2**30, 2)}
    if device.type == "cuda":
        record["gpu_peak_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        record["gpu_alloc_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats(device)
    return record
