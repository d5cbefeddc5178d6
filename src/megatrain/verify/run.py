"""verify's run: the config it checks, the random micro-batches, the engine beside the references.

See megatrain/verify/__init__.py for what is compared and how pass/fail is decided.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.config import TrainConfig
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.engine.rng import random_config_keys
from megatrain.model.multimodal import trained_vision, unused_vision_params
from megatrain.model.router import RoutingMargins
from megatrain.model.structure import discover
from megatrain.recipes.builder import RunBuilder
from megatrain.verify.images import vision_modules_of, with_images
from megatrain.verify.judge import (
    MIN_ROUTING_MARGIN,
    TOLERANCES,
    StepReport,
    judge,
    rel_errors,
)
from megatrain.verify.reference import (
    Reference,
    all_finite,
    float64,
    master_weights,
    snapshot,
    start_from_engine,
)

if TYPE_CHECKING:
    from megatrain.engine.engine import StepResult

DATA_SEED_TRIES = 12

VERIFY_BASE: dict[str, dict[str, Any]] = {
    "model": {"compute_dtype": "fp32"},
    "data": {"cutoff_len": 24},
    "training": {
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "seq_len": 24,
        "seed": 0,
        "compile_layers": False,
    },
    "optimizer": {"learning_rate": 1e-3, "weight_decay": 0.1, "lr_scheduler": "constant"},
    "memory": {"gpu_state_blocks": 0},
}
"""verify's own defaults when no --config is given: small random batches, fp32, a large lr so
that every step moves the weights measurably. No tokenizer is loaded: the tokens are random.
Every layer streamed (a tiny model would otherwise sit whole in the GPU tier on CUDA), eager;
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


def make_batches(
    cfg: TrainConfig,
    steps: int,
    vocab: int,
    pad_id: int,
    micro_batch_size: int,
    grad_accum: int,
    data_seed: int | None = None,
) -> list[list[Batch]]:
    """Random micro-batches for every step in the run's layout (`cfg.layout`): padded (last row
    shorter), packed rows, or full rows (pre-training)."""
    seed = cfg.training.seed if data_seed is None else data_seed
    gen = torch.Generator().manual_seed(seed + 1)
    rows, seq_len = micro_batch_size, cfg.seq_len
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(grad_accum):
            ids = torch.randint(3, vocab, (rows, seq_len), generator=gen)
            labels = ids.clone()
            labels[:, : seq_len // 4] = IGNORE_INDEX  # a "prompt" that is not supervised
            if cfg.layout == "full":  # pre-training rows: plain causal windows, no mask
                micro.append(Batch(ids, labels, None, None))
            elif cfg.layout == "packed":
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


def without_randomness(cfg: TrainConfig, hf_config: Any) -> tuple[TrainConfig, dict[str, float]]:
    """`cfg` with every nonzero dropout / jitter probability of the model set to 0, and those
    keys: random masks drawn in a different order cannot be compared (package docstring)."""
    random_off = random_config_keys(hf_config)
    if not random_off:
        return cfg, {}
    overrides = {**cfg.model.config_overrides, **dict.fromkeys(random_off, 0.0)}
    model = dataclasses.replace(cfg.model, config_overrides=overrides)
    return dataclasses.replace(cfg, model=model), random_off


def frozen_as_the_engine(model: Any, cfg: TrainConfig) -> Any:
    """The reference model with the parameters the engine does not train frozen: a
    vision-language model's vision modules, but for the parts that train (model.freeze_vision /
    freeze_projector false) without the parameters their features never reach."""
    for module in vision_modules_of(model):
        module.requires_grad_(False)
    st, m = discover(model), cfg.model
    trained = trained_vision(st, tower=not m.freeze_vision, projector=not m.freeze_projector)
    unused = unused_vision_params(st) if trained else set()
    for module in trained.values():
        for p in module.parameters():
            p.requires_grad_(id(p) not in unused)  # PyTorch: no gradient, no update
    return model


def _check_same_parameters(store: Any, ref: Reference) -> None:
    """verify compares what both train: the same set of parameters, or it refuses."""
    ours = {e.full_name for b in store.blocks for e in b.entries}
    if ours != set(ref.named):
        raise ValueError(
            "verify: the engine and the PyTorch reference train different parameters: only the "
            f"engine {sorted(ours - set(ref.named))[:4]}, only the reference "
            f"{sorted(set(ref.named) - ours)[:4]}"
        )


def run_verify(cfg: TrainConfig, *, steps: int = 3, judged: bool = True) -> list[StepReport]:
    """Train `steps` steps with the engine and with plain PyTorch; report their differences.

    `judged`: also run the references that decide pass or fail (float64, or PyTorch's own
    bf16 recipe); without it `excess` compares against fp32 PyTorch and the tolerance alone.
    """
    cfg, random_off = without_randomness(cfg, RunBuilder(cfg).hf_config)
    builder = RunBuilder(cfg)
    device, lr = builder.device, cfg.optimizer.learning_rate
    mbs, grad_accum = builder.batch()
    structure = builder.model()
    # judged against exact AdamW: fp32 states and an fp32 master whatever the config says
    store = builder.store(structure, state_dtype="fp32", master_dtype="fp32")
    engine = builder.engine(structure, store)
    landed: dict[str, torch.Tensor] = {}
    engine.worker.on_landed = lambda block: snapshot(block, landed)
    decay = {e.full_name: e.decay for b in store.blocks for e in b.entries}
    hyper = engine.worker.optimizer.hyper

    def reference(bf16_master: bool = False, exact: bool = False) -> Reference:
        model = frozen_as_the_engine(builder.model().causal_lm, cfg)
        return Reference(
            float64(model) if exact else model,
            decay,
            device=device,
            lr=lr,
            hyper=hyper,
            clip_norm=cfg.optimizer.clip_norm,
            bf16_master=bf16_master,
        )

    fp32_compute = cfg.model.compute_dtype == "fp32"
    ref = reference()
    _check_same_parameters(store, ref)
    target, noise = ref, None
    if judged and fp32_compute:
        target, noise = reference(exact=True), ref
    elif judged:
        noise = reference(bf16_master=True)
    tol = TOLERANCES[cfg.model.compute_dtype]
    config = ref.model.config.get_text_config()
    pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0

    def batches(data_seed: int) -> list[list[Batch]]:
        out = make_batches(cfg, steps, config.vocab_size, pad_id, mbs, grad_accum, data_seed)
        if structure.is_multimodal:
            out = [[with_images(b, ref.model.config, data_seed) for b in m] for m in out]
        return out

    data_seed, margin = cfg.training.seed, None
    if judged and fp32_compute and _routes(config.to_dict()):
        data_seed, margin = _tie_free_data_seed(
            cfg.training.seed, lambda: reference(exact=True), batches
        )
    step_report = functools.partial(
        _step_report, random_off=random_off, routing_margin=margin, data_seed=data_seed
    )
    reports = []
    try:
        for step, micro in enumerate(batches(data_seed)):
            result = engine.train_step(micro, lr=lr)
            engine.wait_updates()
            ours = {
                "loss": {"loss": torch.tensor(result.loss)},
                "grad": {n: landed[n] for n in ref.named},
                "weight": master_weights(store),
            }
            fp32 = ref.step(micro)
            exact = target.step(micro) if target is not ref else fp32
            noisy = fp32 if noise is ref else (noise.step(micro) if noise else None)
            if not all_finite(exact):
                # float64 can turn fully-masked padding rows into NaN where fp32 does not
                # (HF's mask constants): judge against fp32 PyTorch alone from here on.
                target, noise, exact, noisy = ref, None, fp32, None
            verdict = judge(ours, exact, noisy, tol, per_tensor=fp32_compute)
            reports.append(step_report(step + 1, result, ours, fp32, verdict=verdict))
            start_from_engine(store, ref, target, noise)
    finally:
        engine.close()
    return reports


def _step_report(
    step: int,
    result: StepResult,
    ours: dict[str, dict[str, torch.Tensor]],
    fp32: dict[str, dict[str, torch.Tensor]],
    *,
    verdict: tuple[float, str, float, float],
    random_off: dict[str, float],
    routing_margin: float | None,
    data_seed: int,
) -> StepReport:
    """One step's report: the engine against fp32 PyTorch, and `judge`'s verdict."""
    return StepReport(
        step=step,
        loss=result.loss,
        ref_loss=float(fp32["loss"]["loss"]),
        loss_rel=max(rel_errors(ours["loss"], fp32["loss"]).values()),
        grad_rel=max(rel_errors(ours["grad"], fp32["grad"]).values()),
        weight_rel=max(rel_errors(ours["weight"], fp32["weight"]).values()),
        grad_norm=result.grad_norm,
        clipped=result.clip_coef < 1.0,
        excess=verdict[0],
        worst=verdict[1],
        error=verdict[2],
        bound=verdict[3],
        random_off=random_off,
        routing_margin=routing_margin,
        data_seed=data_seed,
    )


def _routes(config: dict[str, Any]) -> bool:
    """Whether the model routes tokens to experts (it has a number of experts per token)."""
    return any(
        isinstance(config.get(key), int) and config[key] > 0
        for key in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
    )


def _tie_free_data_seed(
    seed: int,
    exact_reference: Callable[[], Reference],
    batches: Callable[[int], list[list[Batch]]],
) -> tuple[int, float]:
    """The first data seed whose float64 training keeps every routing decision clear of a tie.

    Runs the float64 reference (what the judgement's target computes, deterministically) on the
    micro-batches of seed after seed; returns the first seed whose smallest top-k margin is at
    least MIN_ROUTING_MARGIN, else the seed with the largest margin seen (reported as is).
    """
    best = (seed, -1.0)
    for data_seed in range(seed, seed + DATA_SEED_TRIES):
        probe = exact_reference()
        with RoutingMargins() as margins:
            for micro in batches(data_seed):
                probe.step(micro)
        if margins.smallest >= MIN_ROUTING_MARGIN:
            return data_seed, margins.smallest
        best = max(best, (data_seed, margins.smallest), key=lambda item: item[1])
    return best
