"""The training recipe: the only module that reads the whole config and wires the parts.

setup (tokenizer, data, model, host store, engine, loader, schedule, resume) -> train (steps,
eval, checkpoints) -> finish (final eval, checkpoint, Hugging Face export) -> close.

Exact resume: a checkpoint holds the store (fp32 master, AdamW states, per-block step), the
data loader's position, the RNG states and the step; the learning rate is a pure function of
the step. So `train 6 steps` and `train 3, resume, train 3` see identical batches, weights and
learning rates, and produce identical losses.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain.batch import Batch
from megatrain.checkpoint import (
    export_hf,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from megatrain.config import TrainConfig, save_config
from megatrain.data import make_loader, prepare_data
from megatrain.device import resolve_device
from megatrain.engine.engine import StepResult, StreamingEngine
from megatrain.metrics import MetricsLogger, peak_flops
from megatrain.model.loading import load_causal_lm
from megatrain.model.loading import load_config as load_hf_config
from megatrain.model.structure import ModelStructure, discover
from megatrain.model.tokenizer import load_tokenizer as load_model_tokenizer
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.optim.schedule import LRSchedule, warmup_steps_for
from megatrain.output_dir import TrainingInterrupted, interrupted_message, prepare_output_dir
from megatrain.resources import (
    detect,
    estimate,
    gpu_problem,
    host_problem,
    model_spec,
    pick_micro_batch,
)
from megatrain.resources.disk import CHECKPOINT_BYTES_PER_PARAM, check_run_disk, run_disk_bytes
from megatrain.store.host import HostStore


@dataclass
class TrainSummary:
    steps: int
    losses: list[float]
    eval_loss: float | None
    checkpoint: Path | None
    export_dir: Path | None


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(resolve_device(cfg.training.device))
        self.output_dir = Path(cfg.training.output_dir)
        prepare_output_dir(
            self.output_dir,
            resume_from=cfg.checkpoint.resume_from,
            overwrite=cfg.training.overwrite_output_dir,
            export_hf=cfg.checkpoint.export_hf,
        )
        self.run_id = uuid.uuid4().hex[:12]  # a resumed run takes its checkpoint's (_resume)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.output_dir / "config.yaml")
        torch.manual_seed(cfg.training.seed)
        self.tokenizer = load_tokenizer(cfg)
        self.data = prepare_data(cfg.data, self.tokenizer)
        self.seq_len = cfg.training.seq_len or cfg.data.cutoff_len
        self.micro_batch_size, self.grad_accum = self._plan_resources()
        self.structure = self._load_model()
        self.store = HostStore(
            self.structure,
            compute_dtype=_DTYPES[cfg.model.compute_dtype],
            pin_memory=cfg.memory.pin_memory and self.device.type == "cuda",
            no_decay=cfg.optimizer.no_decay,
            decay_1d=cfg.optimizer.decay_1d,
        )
        opt = cfg.optimizer
        self.optimizer = CpuAdamW(
            AdamWHyper(
                betas=(opt.betas[0], opt.betas[1]), eps=opt.eps, weight_decay=opt.weight_decay
            ),
            impl=opt.impl,
            num_threads=opt.threads or max(1, (os.cpu_count() or 2) - 2),
        )
        self.engine = StreamingEngine(
            self.structure,
            self.store,
            self.optimizer,
            device=self.device,
            num_slots=cfg.memory.num_slots,
            max_grad_norm=opt.max_grad_norm,
            loss_chunk_tokens=cfg.memory.loss_chunk_tokens,
            compile_layers=cfg.training.compile_layers,
        )
        self.loader = make_loader(
            self.data.train,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            packing=cfg.data.packing,
            pad_token_id=self.data.pad_token_id,
            shuffle=cfg.data.shuffle,
            seed=cfg.data.seed,
            pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        )
        self.total_steps = self._total_steps()
        self.schedule = LRSchedule(
            peak_lr=opt.learning_rate,
            total_steps=self.total_steps,
            kind=opt.lr_scheduler,
            warmup_steps=warmup_steps_for(self.total_steps, opt.warmup_steps, opt.warmup_ratio),
            min_lr_ratio=opt.min_lr_ratio,
        )
        self.step = 0
        self._resume()
        self.flops_per_token = 6 * active_params(self.structure, self.store.numel)

    # ------------------------------------------------------------------ setup

    def _load_model(self) -> ModelStructure:
        m = self.cfg.model
        model = load_causal_lm(
            m.name_or_path,
            model_type=m.model_type,
            tiny=m.tiny,
            random_init=m.random_init,
            trust_remote_code=m.trust_remote_code,
            attn_implementation=m.attn_implementation,
            config_overrides=dict(m.config_overrides) or None,
            seed=self.cfg.training.seed,
        )
        vocab = model.config.get_text_config().vocab_size
        if len(self.tokenizer) > vocab:
            raise ValueError(
                f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary has "
                f"{vocab}: use the model's own tokenizer (model.tokenizer), or for a random-init "
                f"model set model.config_overrides.vocab_size >= {len(self.tokenizer)}"
            )
        structure = discover(model)
        print(f"model: {structure.describe()}", flush=True)
        return structure

    def _plan_resources(self) -> tuple[int, int]:
        """Micro-batch and accumulation (resolving "auto"), checked to fit before loading.

        Refuses, with the numbers and what to change, a run whose predicted host RAM or GPU
        peak exceeds what this machine has (megatrain.resources), before anything large is
        allocated. The GPU side applies on CUDA only.
        """
        cfg, t, mem = self.cfg, self.cfg.training, self.cfg.memory
        m = cfg.model
        hf_config = load_hf_config(
            m.name_or_path,
            model_type=m.model_type,
            tiny=m.tiny,
            trust_remote_code=m.trust_remote_code,
            overrides=dict(m.config_overrides) or None,
        )
        spec = model_spec(hf_config, m.compute_dtype, m.attn_implementation)
        self._check_disk(spec.total_params)
        hw = detect()
        shape: dict[str, Any] = dict(
            seq_len=self.seq_len,
            num_slots=mem.num_slots,
            padded=not cfg.data.packing,
            packed=cfg.data.packing,
            clipping=cfg.optimizer.max_grad_norm > 0,
        )
        mbs, ga = t.micro_batch_size, t.gradient_accumulation_steps
        if mbs == "auto":
            target: dict[str, Any] = (
                {"tokens_per_step": t.global_batch_size * self.seq_len}
                if t.global_batch_size
                else {"grad_accum": ga}
            )
            mbs, ga, why = pick_micro_batch(
                spec, hardware=hw, gpu_margin_gib=mem.gpu_margin_gib, **target, **shape
            )
            print(f"micro_batch_size auto: {why}; gradient accumulation {ga}", flush=True)
        assert isinstance(mbs, int)
        est = estimate(
            spec,
            micro_batch_size=mbs,
            grad_accum=ga,
            hardware=hw,
            loss_chunk_tokens=mem.loss_chunk_tokens,
            pin_memory=mem.pin_memory and self.device.type == "cuda",
            **shape,
        )
        problems = [host_problem(est, hw, mem.host_margin_gib)]
        if self.device.type == "cuda":
            problems.append(gpu_problem(est, hw, mem.gpu_margin_gib))
        if any(problems):
            raise ValueError("this run does not fit: " + "; ".join(p for p in problems if p))
        print(
            f"resources: host {est.host.total_bytes / 2**30:.1f} GiB"
            + (
                f", GPU peak {est.gpu.peak_bytes / 2**30:.1f} GiB"
                if self.device.type == "cuda"
                else ""
            )
            + " (predicted)",
            flush=True,
        )
        return mbs, ga

    def _check_disk(self, num_params: int) -> None:
        """Refuse a run whose checkpoints and export the output_dir's disk cannot hold."""
        c = self.cfg.checkpoint
        disk = run_disk_bytes(
            num_params,
            save_every=c.save_every,
            save_final=c.save_final,
            keep_last=c.keep_last,
            export_hf=c.export_hf,
            export_dtype=c.export_dtype,
            total_steps=self.cfg.training.max_steps,
        )
        # a resumed run prunes the kept checkpoints as it writes new ones
        kept = min(len(list_checkpoints(self.output_dir)), c.keep_last) if c.resume_from else 0
        written = kept * num_params * CHECKPOINT_BYTES_PER_PARAM
        check_run_disk(self.output_dir, disk, already_written=written)

    def _total_steps(self) -> int:
        t = self.cfg.training
        if t.max_steps is not None:
            return t.max_steps
        per_epoch = len(self.loader) / self.grad_accum
        return max(1, math.ceil(t.num_epochs * per_epoch))

    def _resume(self) -> None:
        where = self.cfg.checkpoint.resume_from
        if where is None:
            return
        path = latest_checkpoint(self.output_dir) if where == "auto" else Path(where)
        if path is None:
            print(
                f"resume: no checkpoint under {self.output_dir}/checkpoints, starting fresh",
                flush=True,
            )
            return
        state = load_checkpoint(path, self.store)
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
        metrics = MetricsLogger(
            self.output_dir,
            total_steps=self.total_steps,
            start_step=self.step,
            log_every=cfg.logging.log_every,
            jsonl=cfg.logging.jsonl,
            tensorboard=cfg.logging.tensorboard,
            progress_bar=cfg.logging.progress_bar,
            flops_per_token=self.flops_per_token,
            peak_flops_per_s=peak_flops(
                torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
            ),
        )
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
                result = self.engine.train_step(micro, lr=lr)
                step_s = time.perf_counter() - t0
                self.step += 1
                if not math.isfinite(result.loss):
                    raise FloatingPointError(
                        f"loss is {result.loss} at step {self.step}: lower "
                        "optimizer.learning_rate, keep optimizer.max_grad_norm > 0, or check "
                        "the data"
                    )
                losses.append(result.loss)
                metrics.log_step(self.step, _record(result, lr, step_s))
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

    def _evaluate(self, metrics: MetricsLogger) -> float | None:
        if not self.data.eval:
            return None
        loader = make_loader(
            self.data.eval,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            packing=self.cfg.data.packing,
            pad_token_id=self.data.pad_token_id,
            shuffle=False,
            pad_to_multiple_of=self.cfg.data.pad_to_multiple_of,
        )
        total, tokens = 0.0, 0
        limit = self.cfg.training.max_eval_batches
        for i, batch in enumerate(loader):
            if limit is not None and i >= limit:
                break
            loss_sum, n = self.engine.eval_loss([batch])
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
        return save_checkpoint(
            self.output_dir,
            self.step,
            self.store,
            state,
            keep_last=self.cfg.checkpoint.keep_last,
            run_id=self.run_id,
            write_extra=lambda d: save_config(self.cfg, d / "config.yaml"),
        )

    def export(self) -> Path:
        self.engine.wait_updates()
        return export_hf(
            self.store,
            self.output_dir / "hf_model",
            dtype=self.cfg.checkpoint.export_dtype,
            tokenizer=self.tokenizer,
        )

    def close(self) -> None:
        self.engine.close()


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_tokenizer(cfg: TrainConfig) -> Any:
    """The run's tokenizer; kept here for callers of the old name (megatrain.model.tokenizer)."""
    return load_model_tokenizer(cfg.model)


def active_params(structure: ModelStructure, total: int) -> int:
    """Parameters one token uses: MoE experts count by the fraction routed to."""
    config = structure.causal_lm.config.get_text_config()
    experts = next(
        (
            getattr(config, k)
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if isinstance(getattr(config, k, None), int)
        ),
        None,
    )
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return total
    expert_params = sum(
        p.numel()
        for n, p in structure.layers.named_parameters()
        if "experts." in n and "shared" not in n
    )
    return int(total - expert_params * (1 - top_k / experts))


def _record(result: StepResult, lr: float, step_s: float) -> dict[str, Any]:
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
    return record
