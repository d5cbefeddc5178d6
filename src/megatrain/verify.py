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

Like is compared with like:
- Dropout and router jitter are turned off on every side: two implementations that draw their
  random numbers in a different order (the engine runs layer-major, PyTorch micro-batch-major)
  apply different masks, and no tolerance can compare them. That the engine's backward uses the
  masks of its own forward is proven by tests/test_engine_dropout.py.
- MoE routing (fp32 compute): a top-k choice whose runner-up is within rounding of the last
  expert kept is decided by rounding, differently in float64, fp32 and the engine. The data is
  drawn (seed after seed) so that every routing decision of the float64 run keeps a relative
  margin of at least MIN_ROUTING_MARGIN; the margin reached is reported.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.engine.engine import StreamingEngine, random_config_keys
from megatrain.engine.microbatch import shifted_targets
from megatrain.model.loading import load_causal_lm, load_config
from megatrain.model.router import RoutingMargins
from megatrain.model.structure import discover
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore

# Error always allowed, before the 10x-PyTorch-noise allowance (module docstring).
TOLERANCES = {
    "float32": {"loss": 1e-5, "grad": 1e-5, "weight": 1e-5},
    "bfloat16": {"loss": 1e-3, "grad": 1e-2, "weight": 1e-3},
}
NOISE_FACTOR = 10.0
# Routing decisions must keep this relative margin (module docstring). An engine within the fp32
# tolerance 1e-5 of the target moves each top-k input by at most 1e-5 of the row's scale, so
# the gap between two of them by at most 2e-5: below that, rounding could pick the expert.
MIN_ROUTING_MARGIN = 2 * TOLERANCES["float32"]["grad"]
DATA_SEED_TRIES = 12


@dataclass
class VerifyConfig:
    source: str | None = None
    model_type: str | None = None
    tiny: bool = False
    steps: int = 3
    grad_accum: int = 2
    batch_size: int = 2
    seq_len: int = 24
    packed: bool = False
    compute_dtype: str = "float32"
    device: str = "cpu"
    lr: float = 1e-3
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    num_slots: int = 2
    seed: int = 0
    judge: bool = True  # run the extra target/noise references that decide pass or fail
    config_overrides: dict = field(default_factory=dict)


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
    random_off: dict[str, float] = field(default_factory=dict)  # dropout/jitter set to 0
    routing_margin: float | None = None  # smallest top-k margin of the float64 run (MoE, fp32)
    data_seed: int = 0  # seed of the random micro-batches


def make_batches(
    cfg: VerifyConfig, vocab: int, pad_id: int, data_seed: int | None = None
) -> list[list[Batch]]:
    """Random micro-batches for every step: padded (last row shorter) or packed rows."""
    gen = torch.Generator().manual_seed((cfg.seed if data_seed is None else data_seed) + 1)
    steps = []
    for _ in range(cfg.steps):
        micro = []
        for _ in range(cfg.grad_accum):
            ids = torch.randint(3, vocab, (cfg.batch_size, cfg.seq_len), generator=gen)
            labels = ids.clone()
            labels[:, : cfg.seq_len // 4] = IGNORE_INDEX  # a "prompt" that is not supervised
            if cfg.packed:
                cut = cfg.seq_len // 2 - 1
                pos = torch.cat([torch.arange(cut), torch.arange(cfg.seq_len - cut)])
                labels[:, cut] = IGNORE_INDEX  # first token of the second sample
                micro.append(Batch(ids, labels, None, pos.expand(cfg.batch_size, -1).clone()))
            else:
                mask = torch.ones_like(ids)
                short = cfg.seq_len - cfg.seq_len // 3
                mask[-1, short:] = 0
                ids[-1, short:] = pad_id
                labels[-1, short:] = IGNORE_INDEX
                micro.append(Batch(ids, labels, mask, None))
        steps.append(micro)
    return steps


def run_verify(cfg: VerifyConfig) -> list[StepReport]:
    random_off = random_config_keys(
        load_config(
            cfg.source, model_type=cfg.model_type, tiny=cfg.tiny, overrides=cfg.config_overrides
        )
    )
    overrides = {**cfg.config_overrides, **{key: 0.0 for key in random_off}}
    load: dict[str, Any] = dict(
        model_type=cfg.model_type, tiny=cfg.tiny, seed=cfg.seed, config_overrides=overrides or None
    )
    structure = discover(load_causal_lm(cfg.source, **load))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.compute_dtype]
    store = HostStore(
        structure, compute_dtype=dtype, pin_memory=torch.device(cfg.device).type == "cuda"
    )
    hyper = AdamWHyper(weight_decay=cfg.weight_decay)
    engine = StreamingEngine(
        structure,
        store,
        CpuAdamW(hyper),
        device=cfg.device,
        num_slots=cfg.num_slots,
        max_grad_norm=cfg.max_grad_norm,
    )
    landed: dict[str, torch.Tensor] = {}
    engine.worker.on_landed = lambda block: _snapshot(block, landed)
    decay = {e.full_name: e.decay for b in store.blocks for e in b.entries}

    def reference(model: torch.nn.Module, bf16_master: bool = False) -> _Reference:
        return _Reference(model, decay, cfg, hyper, bf16_master)

    ref = reference(load_causal_lm(cfg.source, **load))
    target, noise = ref, None
    if cfg.judge and dtype == torch.float32:
        target, noise = reference(_float64(load_causal_lm(cfg.source, **load))), ref
    elif cfg.judge:
        noise = reference(load_causal_lm(cfg.source, **load), bf16_master=True)
    tol = TOLERANCES[cfg.compute_dtype]
    config = ref.model.config.get_text_config()
    pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    data_seed, margin = cfg.seed, None
    if cfg.judge and dtype == torch.float32 and _routes(config.to_dict()):
        data_seed, margin = _tie_free_data_seed(cfg, load, reference, config.vocab_size, pad_id)
    reports = []
    try:
        for step, micro in enumerate(make_batches(cfg, config.vocab_size, pad_id, data_seed)):
            result = engine.train_step(micro, lr=cfg.lr)
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
            excess, worst = _judge(ours, exact, noisy, tol, per_tensor=dtype == torch.float32)
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
                    random_off=random_off,
                    routing_margin=margin,
                    data_seed=data_seed,
                )
            )
    finally:
        engine.close()
    return reports


def _routes(config: dict[str, Any]) -> bool:
    """Whether the model routes tokens to experts (it has a number of experts per token)."""
    return any(
        isinstance(config.get(key), int) and config[key] > 0
        for key in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
    )


def _tie_free_data_seed(
    cfg: VerifyConfig, load: dict[str, Any], reference: Any, vocab: int, pad_id: int
) -> tuple[int, float]:
    """The first data seed whose float64 training keeps every routing decision clear of a tie.

    Runs the float64 reference (what the judgement's target computes, deterministically) on the
    micro-batches of seed after seed; returns the first seed whose smallest top-k margin is at
    least MIN_ROUTING_MARGIN, else the seed with the largest margin seen (reported as is).
    """
    best = (cfg.seed, -1.0)
    for data_seed in range(cfg.seed, cfg.seed + DATA_SEED_TRIES):
        probe = reference(_float64(load_causal_lm(cfg.source, **load)))
        with RoutingMargins() as margins:
            for micro in make_batches(cfg, vocab, pad_id, data_seed):
                probe.step(micro)
        if margins.smallest >= MIN_ROUTING_MARGIN:
            return data_seed, margins.smallest
        best = max(best, (data_seed, margins.smallest), key=lambda item: item[1])
    return best


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
        cfg: VerifyConfig,
        hyper: AdamWHyper,
        bf16_master: bool = False,
    ) -> None:
        self.model: Any = model.to(cfg.device)
        self.cfg = cfg
        self.named = dict(model.named_parameters())
        self.master = dict(self.named)
        if bf16_master:
            self.master = {n: torch.nn.Parameter(p.detach().clone()) for n, p in self.named.items()}
            self.model.to(torch.bfloat16)
        groups = [
            {
                "params": [p for n, p in self.master.items() if decay[n]],
                "weight_decay": cfg.weight_decay,
            },
            {"params": [p for n, p in self.master.items() if not decay[n]], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=hyper.betas, eps=hyper.eps)

    def step(self, micro: list[Batch]) -> dict[str, dict[str, torch.Tensor]]:
        model, cfg = self.model, self.cfg
        denom = sum(b.num_target_tokens for b in micro)
        total = 0.0
        for batch in micro:
            b = batch.to(cfg.device)
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
        if cfg.max_grad_norm and cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.master.values(), cfg.max_grad_norm)
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
    first = reports[0]
    if first.random_off:
        keys = ", ".join(f"{k}={v:g}" for k, v in first.random_off.items())
        lines.append(
            f"dropout/jitter off on both sides ({keys} -> 0): random masks cannot be compared "
            "across two implementations; training keeps them, with the forward's masks reused "
            "in the backward recompute"
        )
    if first.routing_margin is not None:
        flag = "" if first.routing_margin >= MIN_ROUTING_MARGIN else " (a near-tie: may flip)"
        lines.append(
            f"routing: smallest relative top-k margin {first.routing_margin:.1e}{flag}, "
            f"data seed {first.data_seed}"
        )
    lines.append(
        f"tolerance: loss {tol['loss']:.0e}, grad {tol['grad']:.0e}, weight "
        f"{tol['weight']:.0e}; excess = error / allowed (<= 1 passes); worst at step "
        f"{worst.step}: {worst.worst}"
    )
    return "\n".join(lines)


def within(reports: list[StepReport]) -> bool:
    return all(r.excess <= 1.0 for r in reports)
