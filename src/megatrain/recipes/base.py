"""The base recipe: the lifecycle every training recipe shares, from config to finished run.

    recipe = SomeRecipe(cfg)   # output folder locked; setup (below); folder claimed
    summary = recipe.train()   # steps, periodic and final checkpoints, export; Ctrl-C handled
    recipe.close()             # engine closed, process group left, folder released

Setup, in this order (each step before anything it would waste is spent):
1. `prepare_config(cfg)` (hook), the builder (recipes/builder.py), the output folder locked
   (rank 0; checkpoint/output_dir.py): a busy or unusable folder is refused before loading;
2. the checkpoint to resume (checkpoint.resume_from) found, and torch's CPU threads set for the
   whole run (threads.compute_threads: training.threads, OMP_NUM_THREADS, the resumed
   checkpoint's count, the affinity cores; put back by `close()`), before anything computes;
3. `torch.manual_seed(training.seed)`, the tokenizer, `build_data()` (hook);
4. `plan_run()` (hook) and its fit check, then the disk check: the kept checkpoints (each of
   `checkpoint_bytes()`: from the parameter counts and the actual state dtype, planning/disk.py
   `checkpoint_nbytes`, plus `extra_checkpoint_bytes()`) and the export must fit the disk;
   `report_plan(plan)` (hook) prints it, and the threads line follows;
5. the folder claimed (config.yaml written; a new run id), the model and store, the engine;
   `build_parts()` (hook: loaders, a reference model...), `count_steps()` (hook), the
   learning-rate schedule;
6. resume: a checkpoint of another world size is refused; the store, the step and the run id
   come back, then `load_state(state, path)` (hook) restores the recipe's own state (loader
   position, RNG...).

Training (`run()`, which a recipe's `train()` calls and wraps into its summary): while steps
remain, `advance(metrics)` (hook) takes one or more optimizer steps, each through
`optimizer_step()` (out-of-memory recovery, recipes/oom.py; a non-finite loss stops the run);
a checkpoint is saved whenever the step crosses a multiple of checkpoint.save_every; then
`finish(metrics)` (hook: a final eval), the final checkpoint (unless this step is saved) and the
export. Ctrl-C anywhere in it raises `TrainingInterrupted`, whose message names the last
checkpoint and the resume flag.

Checkpoints (checkpoint/checkpointer.py): trainer_state.json holds the step, run id,
total_steps and the CPU threads the run computed with, plus `checkpoint_state()` (hook); the
folder holds config.yaml plus what `write_checkpoint_files(folder)` (hook, rank 0) and
`write_rank_files(folder)` (hook, every rank: its part of a sharded state) write.

Hooks a recipe overrides (defaults in brackets): prepare_config [as is], build_data, plan_run
[the builder's plan], report_plan [print it], build_parts [nothing], count_steps, advance,
finish [nothing], load_state [nothing], checkpoint_state [{}], write_checkpoint_files
[nothing], write_rank_files [nothing], extra_checkpoint_bytes [0]; `loss_name` and `loss_fix`
word the non-finite-loss stop. A new recipe, in outline (recipes/sft.py and
recipes/grpo/recipe.py are the full ones):

    class MyTrainer(Recipe):
        def build_data(self): self.rows = load_rows(self.cfg.data, self.tokenizer)
        def build_parts(self): self.loader = self.builder.loader(self.rows)
        def count_steps(self): return self.cfg.training.max_steps or len(self.loader)
        def advance(self, metrics):
            batches, lr = next(self.batches), self.schedule.lr_at(self.step)
            result = self.optimizer_step(
                lambda engine: engine.train_step(batches, lr=lr, objective=...), metrics
            )
            metrics.log_step(self.step, step_record(result, lr, step_s, self.device))
        def train(self): end = self.run(); return MySummary(self.step, end.checkpoint)

Invariants: `step` counts completed optimizer steps; the store and the recipe's state after
step N are what a checkpoint of step N holds, and a resume computes on the checkpoint's thread
count unless training.threads or OMP_NUM_THREADS says otherwise, so resuming continues bit for
bit. Only a recipe writes into output_dir, and only after its claim. The engine is used through
its public methods.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain.checkpoint.checkpointer import Checkpointer, saved_threads
from megatrain.checkpoint.output_dir import (
    OutputFolder,
    TrainingInterrupted,
    interrupted_message,
    resume_hint,
)
from megatrain.config import TrainConfig, save_config
from megatrain.distributed import close as close_process_group
from megatrain.distributed import on_rank0
from megatrain.engine.engine import StepResult, StreamingEngine
from megatrain.errors import NonFiniteLoss
from megatrain.metrics import MetricsLogger
from megatrain.model.kernels import kernel_report
from megatrain.planning.disk import check_run_disk, checkpoint_nbytes, run_disk_bytes
from megatrain.recipes import records
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.oom import recovering_step
from megatrain.recipes.rank_failures import RankFailures
from megatrain.run_files import CONFIG_FILE
from megatrain.threads import compute_threads, use_compute_threads
from megatrain.trackers import tracker_names


@dataclass
class RunEnd:
    """What `run()` leaves: the last checkpoint saved and the export (None: not written)."""

    checkpoint: Path | None
    export_dir: Path | None


class Recipe:
    """One run of a recipe: owns the run's parts (built by RunBuilder) and its step counter.
    Subclasses implement the hooks of the module docstring."""

    engine: StreamingEngine  # built in setup; None only while a step-down rebuilds it
    loss_name = "loss"
    loss_fix = "lower optimizer.learning_rate or keep optimizer.max_grad_norm > 0"

    def __init__(self, cfg: TrainConfig, builder: RunBuilder | None = None) -> None:
        cfg = self.prepare_config(cfg)
        self.cfg = cfg
        self.builder = builder or self.make_builder(cfg)
        self.device = self.builder.device
        self.output_dir = Path(cfg.training.output_dir)
        self.checkpointer = Checkpointer(
            self.output_dir,
            world_size=self.builder.placement.world_size,
            keep_last=cfg.checkpoint.keep_last,
        )
        placement = self.builder.placement
        # several ranks: an out-of-memory step on one reaches them all (recipes/rank_failures.py)
        self.rank_failures = RankFailures(placement) if placement.world_size > 1 else None
        self.plan_stepped_up = False  # a transient step-down went back up once (recipes/oom.py)
        # GPU memory held outside PyTorch's allocator as the first step began (recipes/oom.py)
        self.outside_allocator_bytes: int | None = None
        self.run_id = ""  # the claim's; a resumed run takes its checkpoint's
        self.step = 0
        self.saved_step: int | None = None  # the step of this run's last checkpoint
        self.folder: OutputFolder | None = None
        self.threads_before: int | None = None  # torch's CPU threads before the run's own

        def open_folder() -> None:
            tracker_names(cfg.logging.report_to)  # a tracker's missing package: before anything
            self.folder = OutputFolder(cfg)

        on_rank0(open_folder)  # several ranks: rank 0 alone holds the folder and writes it
        try:
            self._setup()
        except BaseException:
            self._restore_threads()
            self._release_folder()
            raise

    # ------------------------------------------------------------------ hooks

    def prepare_config(self, cfg: TrainConfig) -> TrainConfig:
        """The config this recipe runs (a recipe's own defaults); refuse what it cannot run."""
        return cfg

    def make_builder(self, cfg: TrainConfig) -> RunBuilder:
        """The run's builder (a recipe whose other phases need GPU room passes `gpu_reserve`)."""
        return RunBuilder(cfg)

    def build_data(self) -> None:
        """Load the recipe's data (the tokenizer is `self.tokenizer`); before the plan."""
        raise NotImplementedError

    def plan_run(self) -> Any:
        """The run's resource plan: anything with `require_fit()`; checked before loading."""
        return self.builder.plan()

    def report_plan(self, plan: Any) -> None:
        """Print what the plan chose (the batch, GPU tier, tiles) and its predicted resources."""
        records.report_plan(plan, self.builder.placement.is_cuda)

    def build_parts(self) -> None:
        """What the recipe needs beside the model, store and engine (loaders, a reference)."""

    def count_steps(self) -> int:
        """The run's optimizer steps (training.max_steps, or from the data)."""
        raise NotImplementedError

    def advance(self, metrics: MetricsLogger) -> None:
        """One or more optimizer steps (each through `optimizer_step`), logged to `metrics`."""
        raise NotImplementedError

    def finish(self, metrics: MetricsLogger) -> None:
        """After the last step, before the final checkpoint and the export (a final eval)."""

    def load_state(self, state: dict[str, Any], path: Path) -> None:
        """Restore the recipe's own state from checkpoint `path` (its trainer_state `state`)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """The recipe's own entries of trainer_state.json (JSON values)."""
        return {}

    def write_checkpoint_files(self, folder: Path) -> None:
        """Write the recipe's own files into a checkpoint's temporary `folder` (rank 0 only)."""

    def write_rank_files(self, folder: Path) -> None:
        """Write this rank's own files into a checkpoint's temporary `folder` (every rank, each
        its own names; in one process, that process)."""

    def extra_checkpoint_bytes(self) -> int:
        """Bytes of the files `write_checkpoint_files` and every rank's `write_rank_files` add
        to each checkpoint."""
        return 0

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        b, t = self.builder, self.cfg.training
        self.resume_path = self.checkpointer.resume_path(self.cfg.checkpoint.resume_from)
        saved = saved_threads(self.resume_path) if self.resume_path is not None else None
        self.threads = compute_threads(t.device, t.threads, saved)
        self.threads_before = use_compute_threads(self.threads)  # before anything computes
        torch.manual_seed(t.seed)
        self.tokenizer = b.tokenizer()
        self.build_data()
        self.plan = self.plan_run()
        self.plan.require_fit()  # before anything large is allocated
        self._check_disk()  # before training time is spent
        self.report_plan(self.plan)
        print(self.threads.describe(), flush=True)

        def claim() -> None:  # the inputs are good: the folder becomes this run's
            assert self.folder is not None
            self.run_id = self.folder.claim()

        on_rank0(claim)
        self.structure, self.store = b.model_and_store()
        print(f"model: {self.structure.describe()}", flush=True)
        for line in kernel_report(self.structure):
            print(f"kernels: {line}", flush=True)
        began = time.perf_counter()
        self.engine = b.engine(self.structure, self.store)
        parts = b.load_seconds | {"engine": time.perf_counter() - began}
        print("loaded: " + ", ".join(f"{k} {s:.1f} s" for k, s in parts.items()), flush=True)
        self.build_parts()
        self.total_steps = self.count_steps()
        self.schedule = b.schedule(self.total_steps)
        self._resume()

    def checkpoint_bytes(self) -> int:
        """One checkpoint of this run, predicted from the parameter counts (before loading)."""
        spec, b = self.builder.spec, self.builder
        blocks = spec.block_params
        world = b.placement.world_size
        opt = self.cfg.optimizer
        states = checkpoint_nbytes(
            blocks, opt.state_dtype, world=world, master_dtype=opt.master_dtype
        )
        return states + self.extra_checkpoint_bytes()

    def _check_disk(self) -> None:
        """Refuse a run whose checkpoints and export the output_dir's disk cannot hold."""
        c, one = self.cfg.checkpoint, self.checkpoint_bytes()
        disk = run_disk_bytes(
            self.builder.spec.total_params,
            save_every=c.save_every,
            save_final=c.save_final,
            keep_last=c.keep_last,
            export_hf=c.export_hf,
            export_dtype=c.export_dtype,
            total_steps=self.cfg.training.max_steps,
            checkpoint_bytes=one,
            state_dtype=self.cfg.optimizer.state_dtype,
            master_dtype=self.cfg.optimizer.master_dtype,
        )
        # a resumed run prunes the kept checkpoints as it writes new ones
        kept = min(len(self.checkpointer.checkpoints()), c.keep_last) if c.resume_from else 0
        check_run_disk(self.output_dir, disk, already_written=kept * one)

    def _resume(self) -> None:
        path = self.resume_path
        if path is None:
            return
        state = self.checkpointer.load(path, self.store)  # refuses another world size
        self.engine.weights_loaded()  # a sharded GPU tier gathers the loaded shards
        self.load_state(state, path)
        self.step = self.saved_step = int(state["step"])
        self.run_id = state.get("run_id") or self.run_id
        print(f"resumed from {path} at step {self.step}", flush=True)

    # ------------------------------------------------------------------ training

    def run(self) -> RunEnd:
        """Train to `total_steps`, then the final checkpoint and export (module docstring)."""
        metrics = self.builder.metrics(total_steps=self.total_steps, start_step=self.step)
        checkpoint = None
        try:
            while self.step < self.total_steps:
                before = self.step
                self.advance(metrics)
                every = self.cfg.checkpoint.save_every
                if every and self.step // every > before // every:  # crossed a multiple
                    checkpoint = self.save()
            self.finish(metrics)
            if self.cfg.checkpoint.save_final and self.saved_step != self.step:
                checkpoint = self.save()
            export_dir = self.export() if self.cfg.checkpoint.export_hf else None
        except KeyboardInterrupt as e:
            raise TrainingInterrupted(interrupted_message(self.output_dir, self.step)) from e
        finally:
            metrics.close()
        return RunEnd(checkpoint, export_dir)

    def optimizer_step(
        self, run: Callable[[StreamingEngine], StepResult], metrics: MetricsLogger
    ) -> StepResult:
        """`run(engine)` as optimizer step `step + 1`, then `step` advanced. Out of GPU memory,
        the step is undone and run again on a smaller plan (recipes/oom.py); a non-finite loss
        stops the run."""
        result = recovering_step(self, self.step + 1, run, metrics)
        self.step += 1
        if not math.isfinite(result.loss):
            raise NonFiniteLoss(self._non_finite_message(result.loss))
        return result

    def _non_finite_message(self, loss: float) -> str:
        """The paragraph a non-finite loss stops the run with (NonFiniteLoss)."""
        cuda = self.engine.transfers.is_cuda  # on the CPU the share's update is synchronous
        share = len(self.engine.share.blocks) if cuda else 0
        suspect = (
            f"; the GPU update share was on (optimizer.gpu_update_blocks: {share} blocks), whose "
            'earlier NaN losses came from a race fixed since (docs/optimizer_states.md, "The '
            "share's NaN\"): set it to 0 to rule it out"
            if share
            else ""
        )
        hint = resume_hint(self.output_dir)
        return (
            f"{self.loss_name} is {loss} at step {self.step}: {self.loss_fix}{suspect}. "
            f"{hint[0].upper()}{hint[1:]}"
        )

    # ------------------------------------------------------------------ save, export, close

    def save(self) -> Path:
        self.engine.wait_updates()  # every update applied: master and shadow are consistent
        state = {
            **self.checkpoint_state(),
            "total_steps": self.total_steps,
            "threads": self.threads.count,  # a resume computes on them (threads.compute_threads)
        }
        path = self.checkpointer.save(
            self.step,
            self.store,
            state,
            run_id=self.run_id,
            write_extra=self._write_extra,
            write_part_extra=self.write_rank_files,
        )
        self.saved_step = self.step
        return path

    def _write_extra(self, folder: Path) -> None:
        save_config(self.cfg, folder / CONFIG_FILE)
        self.write_checkpoint_files(folder)

    def export(self) -> Path:
        self.engine.wait_updates()  # every update applied: the master is the trained model
        return self.builder.export(self.store)

    def close(self) -> None:
        try:
            if self.engine is not None:  # None: a step-down's engine rebuild failed
                self.engine.close()
            if self.rank_failures is not None:
                self.rank_failures.close()
            close_process_group()
        finally:
            self._restore_threads()
            self._release_folder()

    def _restore_threads(self) -> None:
        """torch's CPU threads back to what they were before this run (a process-wide setting
        that outlives the run in a test or a notebook)."""
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None

    def _release_folder(self) -> None:
        if self.folder is not None:
            self.folder.release()
