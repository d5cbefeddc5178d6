"""The resource plan of a GRPO run: its training phase and its rollout phase, before loading.

Training phase: the builder's plan (what `train` checks and the engine runs) of the config
`training_config` makes: one generation batch, N = prompts_per_step x num_generations sequences,
is one optimizer step in micro-batches of `training.micro_batch_size` rows, each row at most
max_prompt_length + max_completion_length tokens. Rollout phase: planning/rollout.py for N
sequences of max_prompt_length + max_completion_length tokens, resident when that fits in the
GPU memory left beside the engine's persistent buffers (weight slots, gradient accumulators,
head, GPU tier), else streamed. With `memory.gpu_state_blocks: auto` the GPU tier is chosen to
leave the resident rollout its room (`rollout_reserve`, the builder's gpu_reserve), so the tier
never pushes generation onto the streamed path. `grpo.generation: resident | streamed` forces a
path; on the CPU it is resident. The resident rollout's weights (grpo.rollout_weights,
recipes/grpo/rollout_weights.py) are the compute dtype's when that fits, else a compact format's
when that does (tried in `rollout_weights.candidates` order), and a compact rollout turns on the
loss's truncated importance weights (`importance_cap`). A resident rollout decodes on the
static path (recipes/grpo/decode.py: static KV cache, CUDA graphs, the forward compiled or not)
when `grpo.compile_decode` asks for it and the model allows it (`decode_mode`).

Log-prob passes (`logprob_passes`): with grpo.beta > 0 the reference's, with grpo.num_iterations
> 1 the old policy's, once per generation batch, each a forward-only pass over the training
step's own micro-batches (StreamingEngine.logprobs: the engine's forward schedule, no layer
input kept, the head's forward only), planned as the timing model's forward-only replay
(StepTime.forward_s); the reference's adds the GPU tier's swap (planning/timing.py
reference_swap_s). With num_iterations 1 the weights that sampled the batch are the ones
trained, so the old policy's pass is not run: old_logp = logp.detach() (ratio 1 in value, the
gradient of A x logp), as TRL does. One generation batch: rollout + log-prob passes +
num_iterations training steps.

Invariant: the recipe generates on the path this plan chooses (recipes/grpo/recipe.py asks it
with the free memory the device reports), so `megatrain estimate --grpo` names the path the run
takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from megatrain.config import TrainConfig
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import GIB, gib
from megatrain.planning.plan import ResourcePlan
from megatrain.planning.rollout import DECODE_OP_S, RolloutEstimate, rollout_estimate
from megatrain.planning.timing import tier_params
from megatrain.recipes.grpo.decode_support import static_decode_problem
from megatrain.recipes.grpo.rollout_weights import (
    COMPUTE,
    candidates,
    describe,
    fp8_matmul,
    importance_sampling,
)
from megatrain.recipes.grpo.train_config import training_config


@dataclass(frozen=True)
class LogprobPass:
    """One forward-only pass over a generation batch, in the training step's micro-batches."""

    name: str  # "old policy" or "reference"
    setting: str  # the key that asks for it
    forward_s: float  # the engine's forward and the head's, replayed (StepTime.forward_s)
    swap_s: float  # the reference's weights into the GPU tier and back (engine.serving)

    @property
    def seconds(self) -> float:
        return self.forward_s + self.swap_s


@dataclass(frozen=True)
class GRPOPlan:
    training: ResourcePlan
    rollout: RolloutEstimate  # on the chosen path
    reason: str  # why that path
    decode_reason: str  # why a resident rollout decodes the way it does (decode_mode)
    problems: tuple[str, ...]  # training's and the rollout's; empty when both fit
    on_gpu: bool  # a CUDA run (else everything, rollout included, runs on the CPU)
    logprobs: tuple[LogprobPass, ...] = ()  # the passes each generation batch runs
    iterations: int = 1  # optimizer steps per generation batch (grpo.num_iterations)
    weights_reason: str = ""  # why the resident rollout keeps its weights as it does
    importance_cap: float | None = None  # the truncated IS weights' cap; None: not weighted

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def logprob_s(self) -> float:
        return sum(p.seconds for p in self.logprobs)

    @property
    def train_s(self) -> float:
        """The generation batch's optimizer steps."""
        return self.iterations * self.training.estimate.time.step_s

    @property
    def step_s(self) -> float:
        """One generation batch: rollout + log-prob passes + num_iterations training steps."""
        return self.rollout.rollout_s + self.logprob_s + self.train_s

    def require_fit(self) -> None:
        if self.problems:
            raise ValueError("this GRPO run does not fit: " + "; ".join(self.problems))


def rollout_reserve(builder: PlanBuilder) -> int:
    """GPU bytes the automatic GPU tier leaves for the resident rollout (the builder's
    `gpu_reserve` of a GRPO run): where it may run resident, the peak of the first format
    (rollout_weights.candidates) that fits beside the engine without a tier, so the tier gives
    way to the compute-dtype rollout when it can and keeps its room when only a compact one
    fits; when none does, the last one's (the tier then leaves all it can); else 0."""
    cfg, g = builder.cfg, builder.cfg.grpo
    if not builder.placement.is_cuda or g.generation == "streamed":
        return 0
    if cfg.memory.gpu_state_blocks != "auto":
        return 0
    options = candidates(builder)
    peaks = [rollout_of(builder, streamed=False, weights=w).gpu_peak_bytes for w in options]
    if len(peaks) > 1:
        room = _untiered_room(builder)
        return next((peak for peak in peaks if peak <= room), peaks[-1])
    return peaks[0]


def _untiered_room(builder: PlanBuilder) -> int:
    """GPU bytes free beside the engine's persistent buffers without a GPU tier (nor a GPU
    update share: it takes only what the reserve leaves), less the margin (the model's spec
    and config reused: the same model)."""
    cfg = builder.cfg
    memory = dataclasses.replace(cfg.memory, gpu_state_blocks=0)
    optimizer = dataclasses.replace(cfg.optimizer, gpu_update_blocks=0)
    untiered = PlanBuilder(
        dataclasses.replace(cfg, memory=memory, optimizer=optimizer),
        placement=builder.placement,
        hardware=builder.hardware,
    )
    untiered.__dict__.update(hf_config=builder.hf_config, spec=builder.spec)  # cached properties
    untiered.image_share = builder.image_share
    persistent = untiered.plan().estimate.gpu.persistent_bytes
    return builder.hardware.gpu_bytes - int(cfg.memory.gpu_margin_gib * GIB) - persistent


MEASURED_MARGIN_SHARE = 0.5
"""The share of memory.gpu_margin_gib kept free beside the rollout when it is checked against
the memory the device reports free (each generation batch). Planned before loading, the margin
also covers the plan's error on the engine's own buffers, and the automatic GPU tier is sized to
leave the rollout exactly its peak plus the margin; measured, that error is in the reading, so
the whole margin would send a rollout the plan fitted down the streamed path (some 20 ms more
per decoding step per GiB of layers streamed: 19.7 s instead of ~1.5 s for the Qwen2.5-7B
shape's fp8 rollout, run 61) for any error at all. The other half covers the rollout's own
estimate."""


def rollout_margin(cfg: TrainConfig, *, measured: bool) -> int:
    """GPU bytes kept free beside the rollout: the margin, or MEASURED_MARGIN_SHARE of it
    against a reading of the free memory."""
    return int(cfg.memory.gpu_margin_gib * GIB * (MEASURED_MARGIN_SHARE if measured else 1.0))


def rollout_of(
    builder: PlanBuilder, *, streamed: bool, weights: str = COMPUTE, tier: int = 0
) -> RolloutEstimate:
    """The rollout phase of one generation batch, resident (its weights in `weights`) or
    `streamed` (planning/rollout.py), decoding as the recipe will (decode_mode; the streamed
    path and the CPU: generate); `tier`: the engine's GPU-tier blocks (the weight copy reads
    theirs on the device; the GPU peak does not depend on it)."""
    cfg, g = builder.cfg, builder.cfg.grpo
    decode, _ = decode_mode(builder)
    return rollout_estimate(
        builder.spec,
        builder.hardware,
        sequences=g.prompts_per_step * g.num_generations // builder.placement.world_size,
        prompt_tokens=g.max_prompt_length or max(cfg.seq_len - g.max_completion_length, 1),
        completion_tokens=g.max_completion_length,
        streamed=streamed,
        num_slots=cfg.memory.num_slots,
        decode="generate" if streamed or not builder.placement.is_cuda else decode,
        cuda=builder.placement.is_cuda,
        weights_format=COMPUTE if streamed else weights,
        fp8_matmul=fp8_matmul(builder),
        tier_params=tier_params(builder.spec, tier) if builder.placement.is_cuda else 0,
        ranks=builder.shape().ranks,
    )


def grpo_plan(builder: PlanBuilder, *, free_gpu_bytes: int | None = None) -> GRPOPlan:
    """Plan both phases; `free_gpu_bytes`: what the device reports free now (None: the GPU's
    size less the engine's persistent buffers, as predicted)."""
    cfg, g = builder.cfg, builder.cfg.grpo
    world = builder.placement.world_size
    assert cfg == training_config(cfg, world), "plan GRPO with training_config's config"
    sequences = g.prompts_per_step * g.num_generations // world  # each rank's
    hw, margin = builder.hardware, rollout_margin(cfg, measured=free_gpu_bytes is not None)
    _, decode_reason = decode_mode(builder)
    on_gpu = builder.placement.is_cuda
    training = builder.plan()  # the engine's
    if free_gpu_bytes is None:
        free_gpu_bytes = hw.gpu_bytes - training.estimate.gpu.persistent_bytes
    budget = int(free_gpu_bytes - margin)
    tier = training.gpu_state_blocks
    tried = _resident(builder, budget if on_gpu else None, tier)
    resident, needs = tried[-1], ", ".join(f"{r.weights} {gib(r.gpu_peak_bytes)}" for r in tried)
    margin_gib = margin / GIB
    room = f"{gib(max(budget, 0))} free beside the engine (margin {margin_gib:g} GiB)"
    if g.generation != "auto":
        streamed, reason = g.generation == "streamed", f"grpo.generation: {g.generation}"
    elif not on_gpu:
        streamed, reason = False, "a CPU run streams nothing"
    else:
        streamed = resident.gpu_peak_bytes > budget
        reason = f"the resident rollout needs {needs} of {room}"
    chosen = rollout_of(builder, streamed=True) if streamed else resident
    why = f"grpo.rollout_weights: {g.rollout_weights}"
    if len(tried) > 1:
        first = tried[0]
        why += f", and {first.weights} needs {gib(first.gpu_peak_bytes)} of {gib(max(budget, 0))}"
    weights_reason = f"{resident.weights} ({describe(resident.weights, builder)}; {why})"
    problems = list(training.problems)
    if on_gpu and chosen.gpu_peak_bytes > budget:
        problems.append(
            f"the rollout phase needs {gib(chosen.gpu_peak_bytes)} on the GPU "
            f"(KV cache {gib(chosen.kv_cache_bytes)} for {sequences} sequences of "
            f"{chosen.prompt_tokens} + {chosen.completion_tokens} tokens) but "
            f"{gib(max(budget, 0))} are free beside "
            "the engine: lower grpo.prompts_per_step, grpo.num_generations or "
            "grpo.max_completion_length"
            + ("" if streamed else ", or set grpo.generation: streamed")
            + ("" if streamed or chosen.weights != COMPUTE else " or grpo.rollout_weights: fp8")
        )
    if streamed and world > 1:
        problems.append(
            f"{reason}, so the rollout would stream the layers, which does not run under "
            f"torchrun yet (each of the {world} ranks holds a shard of the weights): lower "
            "grpo.prompts_per_step, grpo.num_generations or grpo.max_completion_length, or "
            "use more ranks (each generates prompts_per_step / ranks prompts)"
        )
    passes = logprob_passes(builder, training)
    return GRPOPlan(
        training,
        chosen,
        reason,
        decode_reason,
        tuple(problems),
        on_gpu,
        passes,
        g.num_iterations,
        weights_reason,
        g.importance_sampling_cap if importance_sampling(g, chosen.weights) else None,
    )


def _resident(builder: PlanBuilder, budget: int | None, tier: int) -> list[RolloutEstimate]:
    """The resident rollout on each format (rollout_weights.candidates) up to the first whose
    peak fits in `budget` bytes (None: the first only): the last is the one the plan takes."""
    tried = []
    for weights in candidates(builder):
        tried.append(rollout_of(builder, streamed=False, weights=weights, tier=tier))
        if budget is None or tried[-1].gpu_peak_bytes <= budget:
            break
    return tried


def logprob_passes(builder: PlanBuilder, training: ResourcePlan) -> tuple[LogprobPass, ...]:
    """The log-prob passes of one generation batch (the module docstring): none with
    num_iterations 1 and beta 0."""
    g, forward_s = builder.cfg.grpo, training.estimate.time.forward_s
    passes = []
    if g.num_iterations > 1:
        passes.append(
            LogprobPass("old policy", f"grpo.num_iterations {g.num_iterations}", forward_s, 0.0)
        )
    if g.beta > 0:
        swap_s = builder.reference_swap_s(training.gpu_state_blocks)
        passes.append(LogprobPass("reference", f"grpo.beta {g.beta:g}", forward_s, swap_s))
    return tuple(passes)


def decode_mode(builder: PlanBuilder) -> tuple[str, str]:
    """How resident rollouts decode (one of planning/rollout.py's DECODE_MODES), and why.

    grpo.compile_decode "auto": "compiled" on CUDA when the model allows it, else "generate";
    true / "graphs": "compiled" / "graphs" wherever the model allows it (the CPU runs the
    same steps without CUDA graphs), else an error; false: "generate". On the Qwen2.5-7B shape
    (run 21) the compiled step decodes in 7.75 ms against 9.97 with eager kernels, for a
    compile of about 25 s in the first generation batch.
    """
    setting, on_gpu = builder.cfg.grpo.compile_decode, builder.placement.is_cuda
    shown = str(setting).lower() if isinstance(setting, bool) else setting  # as YAML writes it
    if setting is False:
        return "generate", "transformers' generate (grpo.compile_decode: false)"
    if setting == "auto" and not on_gpu:
        return "generate", "transformers' generate (grpo.compile_decode: auto, on the CPU)"
    problem = static_decode_problem(builder.spec.config, builder.cfg.model.attn_implementation)
    if problem is None:
        mode = "graphs" if setting == "graphs" else "compiled"
        kernels = "torch.compile'd forward" if mode == "compiled" else "eager kernels"
        graphs = "one CUDA graph per token" if on_gpu else "no CUDA graphs on the CPU"
        return mode, f"static KV cache, {kernels}, {graphs} (grpo.compile_decode: {shown})"
    if setting != "auto":
        raise ValueError(
            f"grpo.compile_decode: {shown}, but this model cannot decode on the static path: "
            f"{problem}; set grpo.compile_decode: auto (transformers' generate for this model)"
        )
    return "generate", f"transformers' generate: {problem}"


def rollout_dict(plan: GRPOPlan) -> dict[str, Any]:
    """The rollout phase as JSON: the estimate's fields, its peak, the log-prob passes and
    the GRPO step (one generation batch)."""
    r = plan.rollout
    return asdict(r) | {
        "gpu_peak_bytes": r.gpu_peak_bytes,
        "kv_cache_bytes": r.kv_cache_bytes,
        "tokens_per_s": r.tokens_per_s,
        "reason": plan.reason,
        "decode": plan.decode_reason,
        "weights_reason": plan.weights_reason,
        "importance_cap": plan.importance_cap,
        "logprob_passes": [asdict(p) | {"seconds": p.seconds} for p in plan.logprobs],
        "logprob_s": plan.logprob_s,
        "train_s": plan.train_s,
        "step_s": plan.step_s,
    }


def format_rollout(plan: GRPOPlan) -> str:
    """The rollout phase and the GRPO step, as lines under the training estimate's table."""
    r = plan.rollout
    where = "GPU" if plan.on_gpu else "CPU"
    path = "layers streamed per decoding step" if r.streamed else f"whole model on the {where}"
    decode = "" if r.streamed else f"\n  decoding: {plan.decode_reason}"
    if not r.streamed:
        decode += f"\n  rollout weights: {plan.weights_reason}"
    if not r.streamed and plan.importance_cap is not None:
        decode += (
            f"\n  importance sampling: each token's loss x min(pi_old / pi_rollout, "
            f"{plan.importance_cap:g}) (grpo.importance_sampling_correction; the rollout's "
            "log-probs recorded while decoding)"
        )
    per_step = ""
    if r.decode in DECODE_OP_S:  # a graph replay: the reads, then each op at DECODE_OP_S
        op_s = DECODE_OP_S[r.decode]
        reads_ms = 1e3 * (r.decode_token_s - r.decode_ops * op_s)
        per_step = f" (reads {reads_ms:.2f} ms + {r.decode_ops} ops x {1e6 * op_s:.1f} us)"
    lines = [
        f"GRPO rollout phase ({path}: {plan.reason}){decode}",
        f"  {r.sequences} sequences x ({r.prompt_tokens} prompt + {r.completion_tokens} "
        "completion tokens)",
        *(f"  {name:<44}{gib(n):>14}" for name, n in r.gpu_items.items()),
        f"  {'rollout GPU peak (freed before training)':<44}{gib(r.gpu_peak_bytes):>14}",
        f"  weight copy {r.weight_copy_s:.2f} s + prefill {r.prefill_s:.2f} s + "
        + (f"graph capture {r.capture_s:.2f} s + " if r.capture_s else "")
        + f"{r.completion_tokens} decoding steps x {1e3 * r.decode_token_s:.1f} ms{per_step} = "
        f"{r.rollout_s:.1f} s ({r.tokens_per_s:,.0f} tokens/s)",
        *format_logprobs(plan),
    ]
    return "\n".join(lines)


def format_logprobs(plan: GRPOPlan) -> list[str]:
    """The log-prob passes and the whole GRPO step, as lines of `format_rollout`."""
    t = plan.training
    lines = [
        f"GRPO log-prob passes (forward only, no layer input kept; the training micro-batches: "
        f"{t.grad_accum} x {t.micro_batch_size} rows)"
    ]
    for p in plan.logprobs:
        swap = f" + GPU-tier swap {p.swap_s:.2f} s" if p.swap_s else ""
        lines.append(f"  {p.name} ({p.setting}): forward {p.forward_s:.2f} s{swap}")
    if plan.iterations == 1:
        lines.append(
            "  old policy: not run (grpo.num_iterations 1: the sampling weights are the "
            "trained ones, old_logp = logp.detach(), ratio 1, as in TRL)"
        )
    if all(p.name != "reference" for p in plan.logprobs):
        lines.append("  reference: not run (grpo.beta 0: no KL term)")
    steps = f"{plan.iterations} x " if plan.iterations > 1 else ""
    lines.append(
        f"GRPO step: rollout {plan.rollout.rollout_s:.1f} s + log-prob passes "
        f"{plan.logprob_s:.1f} s + training {steps}{t.estimate.time.step_s:.1f} s = "
        f"{plan.step_s:.1f} s" + (" per generation batch" if plan.iterations > 1 else "")
    )
    return lines
