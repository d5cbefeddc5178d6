"""`megatrain verify`: the engine against plain PyTorch training, step by step.

Both sides start from the same weights and see the same micro-batches (random tokens, one
padded row per micro-batch, or packed rows). The reference is the plain HF model with
`torch.optim.AdamW` and `clip_grad_norm_`, the step's loss being the sum of cross-entropy over
the step's supervised tokens divided by their count (+ the router aux loss HF's forward adds,
averaged over micro-batches).

Reported per step: losses, and the largest relative difference (||a - b|| / ||b|| per tensor,
max over tensors) between engine and fp32 PyTorch of the loss, the gradients (before clipping)
and the weights (after the update).

Pass/fail ("excess" <= 1) judges the engine's error against a more exact target, allowing
max(tolerance, 10 x the error plain PyTorch makes at the same precision):
- fp32 compute: target = the same training in float64; noise = PyTorch fp32. Some gradients
  are ill-conditioned (sums that nearly cancel, e.g. a linear-attention decay) and no fp32
  computation, PyTorch's own included, gets them within 1e-5; everything else must be.
- bf16 compute: target = PyTorch fp32; noise = PyTorch training the same way the engine does:
  the model in bf16 (weights, activations, residual stream), gradients copied to fp32 master
  weights, fp32 AdamW (the DeepSpeed / Megatron bf16 recipe). The engine's bf16 run must stay
  within 10x of the drift PyTorch's own bf16 training shows on the same model and data.
  In bf16 the errors are measured over the whole model (all gradients, all weights as one
  vector), not per tensor: a gradient element near zero flips sign under bf16 rounding, which
  moves that weight by 2 x lr, and in a 16-element zero-initialised norm weight one such flip is
  a 50% relative error, in PyTorch's bf16 run as much as in ours.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.builder import RunBuilder
from megatrain.config import TrainConfig
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.engine.microbatch import shifted_targets
from megatrain.optim.adamw import AdamWHyper
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore

# Error always allowed, before the 10x-PyTorch-noise allowance (module docstring).
TOLERANCES = {
    "fp32": {"loss": 1e-5, "grad": 1e-5, "weight": 1e-5},
    "bf16": {"loss": 1e-3, "grad": 1e-2, "weight": 1e-3},
}
NOISE_FACTOR = 10.0

VERIFY_BASE: dict[str, dict[str, Any]] = {
    "model": {"compute_dtype": "fp32"},
    "data": {"cutoff_len": 24},
    "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 2, "seq_len": 24, "seed": 0},
    "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.1, "lr_scheduler": "constant"},
    "memory": {"gpu_state_blocks": 0},
}
"""verify's own defaults when no --config is given: small random batches, fp32, a large lr so
that every step moves the weights measurably. No tokenizer is loaded: the tokens are random.
Every layer streamed (a tiny model would otherwise sit whole in the GPU tier on CUDA);
`--memory.gpu_state_blocks N` checks the tier."""

SHORTHANDS: dict[str, tuple[str, ...]] = {
    "batch_size": ("training.micro_batch_size",),
    "grad_accum": ("training.gradient_accumulation_steps",),
    "seq_len": ("training.seq_len", "data.cutoff_len"),
    "packed": ("data.packing",),
    "dtype": ("model.compute_dtype",),
    "device": ("training.device",),
    "lr": ("optimizer.learning_rate",),
    "weight_decay": ("optimizer.weight_decay",),
    "max_grad_norm": ("optimizer.max_grad_norm",),
    "num_slots": ("memory.num_slots",),
    "seed": ("training.seed",),
}
"""verify's short flags (`--grad-accum 2`) and the config keys each one sets."""


def verify_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    model: str | None = None,
    model_type: str | None = None,
    tiny: bool = False,
    config_overrides: dict[str, Any] | None = None,
    **shorthands: Any,
) -> TrainConfig:
    """The run config verify checks: a YAML file (+ `--section.key` overrides), or a model
    (hub id / directory, or `model_type` with `tiny`) on VERIFY_BASE; short flags on top."""
    values = model_values(model, model_type, tiny, config_overrides=config_overrides)
    for name, value in shorthands.items():
        if name not in SHORTHANDS:
            raise TypeError(f"verify_config: unknown shorthand {name!r}")
        values |= {key: value for key in SHORTHANDS[name]}
    return shorthand_config(path, overrides, base=VERIFY_BASE, values=values)


@dataclass
class StepReport:
    step: int
    loss: float
    ref_loss: float
    loss_rel: float  # engine vs plain PyTorch in fp32, relative
    grad_rel: float  # max over tensors, ||engine - torch|| / ||torch||, before clipping
    weight_rel: float  # same, weights after the update
    grad_norm: float
    clipped: bool
    excess: float  # worst error / allowed error over loss, gradients, weights; <= 1 passes
    worst: str  # where `excess` occurs


def make_batches(
    cfg: TrainConfig, steps: int, vocab: int, pad_id: int, micro_batch_size: int, grad_accum: int
) -> list[list[Batch]]:
    """Random micro-batches for every step: padded (last row shorter) or packed rows."""
    gen = torch.Generator().manual_seed(cfg.training.seed + 1)
    rows, seq_len = micro_batch_size, cfg.seq_len
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(grad_accum):
            ids = torch.randint(3, vocab, (rows, seq_len), generator=gen)
            labels = ids.clone()
            labels[:, : seq_len // 4] = IGNORE_INDEX  # a "prompt" that is not supervised
            if cfg.data.packing:
                cut = seq_len // 2 - 1
                pos = torch.cat([torch.arange(cut), torch.arange(seq_len - cut)])
                labels[:, cut] = IGNORE_INDEX  # first token of the second sample
                micro.append(Batch(ids, labels, None, pos.expand(rows, -1).clone()))
            else:
                mask = torch.ones_like(ids)
                short = seq_len - seq_len // 3
                mask[-1, short:] = 0
                ids[-1, short:] = pad_id
                labels[-1, short:] = IGNORE_INDEX
                micro.append(Batch(ids, labels, mask, None))
        out.append(micro)
    return out


def run_verify(cfg: TrainConfig, *, steps: int = 3, judge: bool = True) -> list[StepReport]:
    """Train `steps` steps with the engine and with plain PyTorch; report their differences.

    `judge`: also run the references that decide pass or fail (float64, or PyTorch's own
    bf16 recipe); without it `excess` compares against fp32 PyTorch and the tolerance alone.
    """
    builder = RunBuilder(cfg)
    device, lr = builder.device, cfg.optimizer.learning_rate
    mbs, grad_accum = builder.batch()
    structure = builder.model()
    store = builder.store(structure)
    engine = builder.engine(structure, store)
    landed: dict[str, torch.Tensor] = {}
    engine.worker.on_landed = lambda block: _snapshot(block, landed)
    decay = {e.full_name: e.decay for b in store.blocks for e in b.entries}
    hyper = engine.worker.optimizer.hyper

    def reference(bf16_master: bool = False, float64: bool = False) -> _Reference:
        model = builder.model().causal_lm
        return _Reference(
            _float64(model) if float64 else model,
            decay,
            device=device,
            lr=lr,
            hyper=hyper,
            clip_norm=cfg.optimizer.clip_norm,
            bf16_master=bf16_master,
        )

    fp32_compute = cfg.model.compute_dtype == "fp32"
    ref = reference()
    target, noise = ref, None
    if judge and fp32_compute:
        target, noise = reference(float64=True), ref
    elif judge:
        noise = reference(bf16_master=True)
    tol = TOLERANCES[cfg.model.compute_dtype]
    config = ref.model.config.get_text_config()
    pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    reports = []
    try:
        batches = make_batches(cfg, steps, config.vocab_size, pad_id, mbs, grad_accum)
        for step, micro in enumerate(batches):
            result = engine.train_step(micro, lr=lr)
            engine.wait_updates()
            ours = {
                "loss": {"loss": torch.tensor(result.loss)},
                "grad": {n: landed[n] for n in ref.named},
                "weight": _master_weights(store),
            }
            fp32 = ref.step(micro)
            exact = target.step(micro) if target is not ref else fp32
            noisy = fp32 if noise is ref else (noise.step(micro) if noise else None)
            if not _all_finite(exact):
                # float64 can turn fully-masked padding rows into NaN where fp32 does not
                # (HF's mask constants): judge against fp32 PyTorch alone from here on.
                target, noise, exact, noisy = ref, None, fp32, None
            excess, worst = _judge(ours, exact, noisy, tol, per_tensor=fp32_compute)
            reports.append(
                StepReport(
                    step=step + 1,
                    loss=result.loss,
                    ref_loss=float(fp32["loss"]["loss"]),
                    loss_rel=max(_rel_errors(ours["loss"], fp32["loss"]).values()),
                    grad_rel=max(_rel_errors(ours["grad"], fp32["grad"]).values()),
                    weight_rel=max(_rel_errors(ours["weight"], fp32["weight"]).values()),
                    grad_norm=result.grad_norm,
                    clipped=result.clip_coef < 1.0,
                    excess=excess,
                    worst=worst,
                )
            )
    finally:
        engine.close()
    return reports


def _judge(
    ours: dict[str, dict[str, torch.Tensor]],
    exact: dict[str, dict[str, torch.Tensor]],
    noisy: dict[str, dict[str, torch.Tensor]] | None,
    tol: dict[str, float],
    per_tensor: bool,
) -> tuple[float, str]:
    excess, worst = 0.0, ""
    for kind in ("loss", "grad", "weight"):
        group = _rel_errors if per_tensor else _global_rel_error
        errs = group(ours[kind], exact[kind])
        noise_errs = group(noisy[kind], exact[kind]) if noisy is not None else None
        e, where = _excess(errs, noise_errs, tol[kind])
        if e >= excess:
            excess, worst = e, f"{kind} {where}"
    return excess, worst


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64; MoE experts on the eager path (grouped_mm has no float64 kernel)."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        with contextlib.suppress(ValueError):  # no switchable experts implementation
            setter("eager")
    return model.double()


def _all_finite(tensors: dict[str, dict[str, torch.Tensor]]) -> bool:
    return all(bool(torch.isfinite(t).all()) for group in tensors.values() for t in group.values())


def _snapshot(block: ParamBlock, out: dict[str, torch.Tensor]) -> None:
    flat = block.grad_landing.float()
    for e in block.entries:
        out[e.full_name] = block.view(flat, e).clone()


def _master_weights(store: HostStore) -> dict[str, torch.Tensor]:
    return {e.full_name: b.view(b.master, e) for b in store.blocks for e in b.entries}


class _Reference:
    """Plain PyTorch training of the HF model: AdamW, clip_grad_norm_, same decay groups.

    With `bf16_master`, the model computes in bf16 and AdamW updates fp32 master copies of its
    weights, which are cast back into the model after every step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        decay: dict[str, bool],
        *,
        device: torch.device,
        lr: float,
        hyper: AdamWHyper,
        clip_norm: float | None,
        bf16_master: bool = False,
    ) -> None:
        self.model: Any = model.to(device)
        self.device, self.clip_norm = device, clip_norm
        self.named = dict(model.named_parameters())
        self.master = dict(self.named)
        if bf16_master:
            self.master = {n: torch.nn.Parameter(p.detach().clone()) for n, p in self.named.items()}
            self.model.to(torch.bfloat16)
        groups = [
            {
                "params": [p for n, p in self.master.items() if decay[n]],
                "weight_decay": hyper.weight_decay,
            },
            {"params": [p for n, p in self.master.items() if not decay[n]], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=hyper.betas, eps=hyper.eps)

    def step(self, micro: list[Batch]) -> dict[str, dict[str, torch.Tensor]]:
        model = self.model
        denom = sum(b.num_target_tokens for b in micro)
        total = 0.0
        for batch in micro:
            b = batch.to(self.device)
            out = model(
                input_ids=b.input_ids,
                attention_mask=b.attention_mask,
                position_ids=b.position_ids,
                use_cache=False,
            )
            logits = out.logits if out.logits.dtype == torch.float64 else out.logits.float()
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1),
                    shifted_targets(b.labels).flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                / denom
            )
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + model.router_aux_loss_coef * out.aux_loss / len(micro)
            loss.backward()
            total += float(loss.detach())
        for name, master in self.master.items():
            grad = self.named[name].grad
            if master is not self.named[name]:
                master.grad = None if grad is None else grad.float()
        grads = {
            n: p.grad.detach().cpu().clone() for n, p in self.master.items() if p.grad is not None
        }
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.master.values(), self.clip_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, master in self.master.items():
                if master is not self.named[name]:
                    self.named[name].copy_(master)
        weights = {n: p.detach().cpu() for n, p in self.master.items()}
        return {
            "loss": {"loss": torch.tensor(total, dtype=torch.float64)},
            "grad": grads,
            "weight": weights,
        }


def _rel_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """||a - b|| / ||b|| per tensor (inf for NaN)."""
    out = {}
    for name, r in ref.items():
        r = r.detach().double().cpu()
        diff = float(torch.linalg.vector_norm(ours[name].double().cpu() - r))
        rel = diff / max(float(torch.linalg.vector_norm(r)), 1e-30)
        out[name] = math.inf if math.isnan(rel) else rel
    return out


def _global_rel_error(
    ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
) -> dict[str, float]:
    """||a - b|| / ||b|| with every tensor of the group concatenated into one vector."""
    diff_sq = sum(
        float((ours[n].double().cpu() - r.double().cpu()).square().sum()) for n, r in ref.items()
    )
    ref_sq = sum(float(r.double().square().sum()) for r in ref.values())
    rel = math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30)
    return {"all": math.inf if math.isnan(rel) else rel}


def _excess(
    engine_err: dict[str, float], noise_err: dict[str, float] | None, tol: float
) -> tuple[float, str]:
    """Worst ratio of the engine's error to what is allowed, and the tensor it occurs in.

    Allowed: `tol`, or NOISE_FACTOR x the error plain PyTorch makes in the same precision
    (`noise_err`, when measured): see the module docstring.
    """
    worst, worst_name = 0.0, ""
    for name, err in engine_err.items():
        allowed = tol if noise_err is None else max(tol, NOISE_FACTOR * noise_err[name])
        ratio = err / allowed
        if math.isnan(ratio):
            ratio = math.inf
        if ratio > worst or math.isinf(ratio):
            worst, worst_name = ratio, name
    return worst, worst_name


def format_report(reports: list[StepReport], tol: dict[str, float]) -> str:
    lines = [
        f"{'step':>4} {'loss':>10} {'torch loss':>10} {'loss rel':>9} {'grad rel':>9} "
        f"{'weight rel':>10} {'grad norm':>9} {'clipped':>7} {'excess':>7}"
    ]
    for r in reports:
        lines.append(
            f"{r.step:>4} {r.loss:>10.6f} {r.ref_loss:>10.6f} {r.loss_rel:>9.2e} "
            f"{r.grad_rel:>9.2e} {r.weight_rel:>10.2e} {r.grad_norm:>9.4f} "
            f"{'yes' if r.clipped else 'no':>7} {r.excess:>7.3f}"
        )
    worst = max(reports, key=lambda r: r.excess)
    lines.append(
        f"tolerance: loss {tol['loss']:.0e}, grad {tol['grad']:.0e}, weight "
        f"{tol['weight']:.0e}; excess = error / allowed (<= 1 passes); worst at step "
        f"{worst.step}: {worst.worst}"
    )
    return "\n".join(lines)


def within(reports: list[StepReport]) -> bool:
    return all(r.excess <= 1.0 for r in reports)
