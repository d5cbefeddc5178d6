"""Host RAM, GPU peak and step time of one training setup, before anything large is allocated.

Host (bytes per parameter P; the store of store/host.py, every block):
- bf16 compute: fp32 master + exp_avg + exp_avg_sq pageable (12), bf16 shadow pinned (2;
  gradients land in it). fp32 compute: exp_avg + exp_avg_sq pageable (8), fp32 master and
  fp32 gradient pinned (8). exp_avg + exp_avg_sq take 8 with `state_dtype` fp32, 4 with bf16
  2 + 8/2048 (codes + per-block scales) with int8 and 1 + 8/128 with int4 (store/states.py,
  counted per block): 14, 10, ~8 and ~7 B/param in bf16 compute. A bf16 master
  (`master_dtype`, store/master.py): the master pinned (2; it is the streamed copy, no shadow)
  and a bf16 gradient landing pinned (2), m and v as above: 12, 8, ~6 and ~5.
- Pinned blocks of 32 MiB and more are huge-page mappings page-locked with cudaHostRegister
  (store/memory.py): their size rounded up to 2 MiB. Smaller ones come from torch's caching
  host allocator, which rounds up to a power of two. `pinned_reserved_bytes` counts that.
- Plus the process baseline (python, torch, CUDA context), the tokenized data and the layer
  inputs offloaded during the step (planning/long_context.py; pinned on CUDA).
- Blocks of the GPU tier (the first `gpu_state_blocks` of: layers, embedding, head) hold
  nothing on the host once the engine is built (they move to the GPU); while the model loads
  they are there.
- Large pageable buffers are zero pages until first written (store/memory.py): the RSS of
  the Adam states appears with the first optimizer update, so `total_bytes` is what the
  process holds from the first step on.
- Several ranks (`ranks`, planning/ranks.py): the host numbers are per node (its ranks'
  shards and baselines), the GPU numbers per rank, the step time per rank with collectives.

GPU (what `torch.cuda.max_memory_reserved` sees: `max_memory_allocated`, the items below, plus
the caching allocator's slack at the peak phase, planning/allocator_slack.py; c = bytes of the
compute dtype, L layers, T tokens per step, Tm per micro-batch, D hidden, V vocab, Pl largest
layer, Ph head block):
- persistent: num_slots x Pl x c weight slots; 2 x Pl x 4 fp32 gradient accumulators;
  2 x Pl x 2 bf16 staging (bf16 only) (Pl over the streamed layers); the GPU tier, per
  parameter fp32 master + m + v + gradient (16) + bf16 weights (2, bf16 only; in fp32 compute
  the master is the weights), which replaces a tier head's or embedding's weights and gradient
  below; Ph x c head weights; V x D x c table (tied only);
  Ph x 4 + V x D x 4 head and embedding gradient accumulators;
  several ranks: a tier block's fp32 master, m, v and gradient are the rank's shard (16 or 12
  bytes per shard parameter), its compute-dtype weights whole (c per parameter); its gradient
  accumulates in the shared accumulators (Pl then over every layer) or, for the head and
  embedding, in their own (whole) accumulators, and is reduce-scattered into the shard;
- per step: every layer's input for every micro-batch, L x T x D x c (fewer with offload or
  one kept every K layers: planning/long_context.py), and one more T x D x c
  (the last hidden state, then its gradient), the gathered embedding rows, the captured layer
  arguments (masks, rotary tables) of every micro-batch;
- transient, the largest of: one layer's recompute + backward on one micro-batch (measured
  on meta, planning/activations.py) plus its fused attention backward's block (per head
  group at long rows: engine/attention_heads.py), one loss chunk (+ its micro-batch's
  hidden gradient), the embedding gradient's bf16 staging at the end of the backward;
- allocator slack: the largest single transient tensor of the peak phase (on CUDA only); the
  peak phase is the one whose allocated bytes plus its slack are the most.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from megatrain.dtypes import torch_dtype
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.gpu_share import share_size, work_bytes
from megatrain.engine.layout import SHARE_STAGING, SLOTS, TIER, VISION, VISION_TRAIN, DeviceLayout
from megatrain.engine.plan import TierSplit, tier_size
from megatrain.engine.schedule import StepSchedule
from megatrain.model.multimodal import patches_per_image_token, vision_saved_bytes_per_patch
from megatrain.planning.activations import LayerProfile, layer_profile, loss_chunk
from megatrain.planning.allocator_slack import SLACK_ITEM, allocator_slack
from megatrain.planning.hardware import RATES, Hardware, detect, gib
from megatrain.planning.host_memory import HostMemory, host_memory, pinned_reserved
from megatrain.planning.layer_time import COMPILED_PACKAGE_SLOWDOWN
from megatrain.planning.long_context import device_inputs, host_input_bytes
from megatrain.planning.setup import Setup
from megatrain.planning.spec import ModelSpec, block_sizes, build_spec
from megatrain.planning.timing import StepTime, step_time
from megatrain.store.grads import gradient_hold


@dataclass(frozen=True)
class GpuMemory:
    items: dict[str, int]  # at the peak phase, name -> bytes; sums to peak_bytes
    peak_bytes: int  # reserved by the allocator (allocated + its slack): what the card holds
    peak_phase: str  # "layer backward", "loss" or "embedding backward"
    persistent_bytes: int  # what the engine keeps between steps (engine/layout.py)

    @property
    def allocated_bytes(self) -> int:
        """The peak phase's `torch.cuda.max_memory_allocated`: the peak less the slack."""
        return self.peak_bytes - self.items.get(SLACK_ITEM, 0)


@dataclass(frozen=True)
class Estimate:
    model: str  # ModelSpec.describe()
    total_params: int
    active_params: int
    layer_params_max: int
    settings: dict[str, Any]
    host: HostMemory
    gpu: GpuMemory
    time: StepTime
    hardware: Hardware
    notes: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)  # what a setting given costs (train prints)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["host"]["store_bytes"] = self.host.store_bytes
        out["gpu"]["allocated_bytes"] = self.gpu.allocated_bytes
        out["hardware"]["measured"] = list(self.hardware.measured)
        return out


def model_spec(
    config: PretrainedConfig | ModelSpec,
    compute_dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> ModelSpec:
    """The spec of `config` in `compute_dtype` (a spec is reused when its dtype matches).

    `compute_dtype` None: a spec's own dtype, else bf16.
    """
    if compute_dtype is None:
        compute_dtype = config.compute_dtype if isinstance(config, ModelSpec) else "bf16"
    dtype = torch_dtype(compute_dtype)
    if isinstance(config, ModelSpec):
        if config.compute_dtype == dtype:
            return config
        return build_spec(config.config, dtype, attn_implementation)
    return build_spec(config, dtype, attn_implementation)


def estimate(spec: ModelSpec, setup: Setup, hardware: Hardware | None = None) -> Estimate:
    """Predict host RAM, GPU peak and step time of training `spec` as `setup` says, on
    `hardware` (None: this machine's, detected)."""
    plan, hw = setup.engine, hardware or detect()
    tier = min(plan.gpu_state_blocks, tier_size(spec.num_layers))
    formats = setup.block_formats(spec.compute_dtype == torch.bfloat16)
    layout = DeviceLayout.of(plan, block_sizes(spec), spec.compute_dtype, formats)
    chunk = min(plan.loss_chunk_tokens, setup.tokens_mb)
    tiles = setup.tile_count
    # the engine splits attention heads where it tiles: not for compiled layers
    split = tiles > 1 and not plan.compile_layers
    profile = layer_profile(
        spec, setup.micro_batch_size, setup.seq_len, setup.layout, tiles, split, plan.untiled
    )
    boundaries = plan.boundary_plan(spec.num_layers)
    input_bytes = setup.tokens_mb * spec.hidden_size * spec.compute_dtype.itemsize
    reserved = pinned_reserved if setup.pin_memory else (lambda n: n)
    gpu = gpu_memory(spec, profile, setup, layout, chunk)
    host = host_memory(
        spec,
        hw,
        data_bytes=setup.data_bytes,
        offload_bytes=host_input_bytes(boundaries, input_bytes, setup.grad_accum, reserved),
        pin_memory=setup.pin_memory,
        state_dtype=setup.state_dtype,
        master_dtype=setup.master_dtype,
        grad_hold=gradient_hold(
            setup.master_dtype,
            setup.grad_dtype,
            clipping=plan.clip_norm is not None,
            bf16_compute=spec.compute_dtype == torch.bfloat16,
        ),
        gpu_state_blocks=tier,
        ranks=setup.ranks,
        vision=(layout.numel(VISION), layout.numel(VISION_TRAIN)),
    )
    slots = layout[SLOTS].count if SLOTS in layout else 0
    schedule = StepSchedule.of(spec.num_layers, min(tier, spec.num_layers), slots, boundaries)
    timing = step_time(
        spec,
        hw,
        setup,
        schedule=schedule,
        layer_ops=profile.ops,
        layer_traffic=profile.traffic,
        layer_fused=profile.fused,
        layer_scores=profile.score_traffic,
        layer_causal=profile.causal_only,
        loss_ops=-(-setup.tokens_mb // chunk) * loss_chunk(spec, chunk).ops,
    )
    return Estimate(
        model=spec.describe(),
        total_params=spec.total_params,
        active_params=spec.active_params,
        layer_params_max=spec.layer_params_max,
        settings=_settings(spec, setup, layout, chunk, tier, boundaries),
        host=host,
        gpu=gpu,
        time=timing,
        hardware=hw,
        notes=_notes(hw),
        advice=_advice(setup, profile),
    )


def _settings(
    spec: ModelSpec,
    setup: Setup,
    layout: DeviceLayout,
    chunk: int,
    tier: int,
    boundaries: BoundaryPlan,
) -> dict[str, Any]:
    plan, n = setup.engine, spec.num_layers
    return dict(
        seq_len=setup.seq_len,
        micro_batch_size=setup.micro_batch_size,
        grad_accum=setup.grad_accum,
        tokens_per_step=setup.tokens_mb * setup.grad_accum,
        compute_dtype="bf16" if spec.compute_dtype == torch.bfloat16 else "fp32",
        num_slots=layout[SLOTS].count if SLOTS in layout else 0,
        layout=setup.layout,
        clipping=plan.clip_norm is not None,
        loss_chunk_tokens=chunk,
        state_dtype=setup.state_dtype,
        master_dtype=setup.master_dtype,
        grad_dtype=setup.grad_dtype,
        gpu_state_blocks=tier,
        gpu_update_blocks=share_size(n, TierSplit.of(n, tier), plan.gpu_update_blocks),
        gpu_update_sets=plan.share_sets,
        compiled=plan.compile_layers,
        activations=boundaries.describe(),
        mlp_tiles=setup.tile_count,
        nproc_per_node=setup.ranks.nproc_per_node,
        nnodes=setup.ranks.nnodes,
    )


SHARE_WORK = "GPU update share / compressed tier: AdamW temporaries"


# A compiled Gated DeltaNet layer (torch's fallback kernels) keeps more for its backward than
# the eager layer the meta profile measures: 12.0 GiB against 6.8 for one Qwen3.5-27B layer,
# forward + backward on 4 x 2048 tokens on an H100 (docs/performance.md run 39); the compiled
# 16-layer run peaked 3.7 GiB above its eager-profiled plan (run 32). Dense compiled layers with
# sdpa attention peak as planned (runs 35, 41), so only linear-attention layers are scaled, and
# eager attention (below).
COMPILED_LINEAR_ATTENTION_PEAK = 12.0 / 6.8
COMPILED_PACKAGE_LINEAR_ATTENTION_PEAK = 2.7
"""The same with flash-linear-attention's kernels, whose calls the profile counts as fla's own
buffers (planning/kernel_memory.py): compiled, that Qwen3.5-27B row (16 layers, micro-batches
of 4 x 2048, 6 tier blocks) peaked at 77.93 GiB allocated on an H100 of each machine
(docs/performance.md run 45), 3.71 GiB over its plan with COMPILED_LINEAR_ATTENTION_PEAK: a
layer's recompute + backward held 10.74 GiB where the eager fla profile counts 3.98."""
COMPILED_EAGER_SCORES = 2.95
"""Score-sized tensors ([rows, heads, seq, seq] in the compute dtype) a compiled layer with eager
attention holds at its backward peak beyond the eager layer the meta profile measures: the
GPT-OSS-20B shape (eager attention with sinks, compiled by `auto`, micro-batches of 4 x 2048)
peaked 5.90 GiB allocated above its eager-profiled plan on an H100 (41.21 against 35.31 for 24
layers, docs/performance.md run 43; 36.99 against 31.09 for 12 layers, run 44), 2.95 of its
2.0 GiB score tensors; inductor keeps the scores' chain for the backward where the eager layer
frees it step by step. (2.2 until run 44, when the profile still counted the layer's weights.)"""


def _layer_peak(spec: ModelSpec, profile: LayerProfile, setup: Setup) -> int:
    """One layer's recompute + backward transient: the meta profile's, for compiled
    linear-attention layers scaled to what runs 39 (torch's kernels) and 45 (fla's) measured,
    for compiled eager-attention layers with COMPILED_EAGER_SCORES more score tensors."""
    if not setup.engine.compile_layers:
        return profile.peak_bytes
    if any("linear_attention" in g.kind for g in spec.structure.groups):
        scale = COMPILED_LINEAR_ATTENTION_PEAK
        if any(profile.fused):  # fla's calls, profiled as its own buffers
            scale = COMPILED_PACKAGE_LINEAR_ATTENTION_PEAK
        return int(profile.peak_bytes * scale)
    eager = [la.attn_heads for la in spec.layers if la.attn_implementation == "eager"]
    heads = max(eager, default=0)
    scores = setup.micro_batch_size * heads * setup.seq_len**2 * spec.compute_dtype.itemsize
    return profile.peak_bytes + int(COMPILED_EAGER_SCORES * scores)


def gpu_memory(
    spec: ModelSpec, profile: LayerProfile, setup: Setup, layout: DeviceLayout, chunk_tokens: int
) -> GpuMemory:
    """The GPU at each phase of the step: the engine's persistent buffers (`layout`) plus what
    the phase holds and the allocator's slack over it; the peak phase's items."""
    c = spec.compute_dtype.itemsize
    d, ranks, mbs = spec.hidden_size, setup.ranks, setup.grad_accum
    formats = setup.block_formats(spec.compute_dtype == torch.bfloat16)
    # device updates' temporaries (`work_bytes`): the share's and a compressed tier's, 2 pools
    tiered = TIER in layout and formats.state_dtype != "fp32"
    shared = work_bytes(formats, share=True) if SHARE_STAGING in layout else 0
    base = {
        **layout.bytes_by_name(),
        "embedding rows": mbs * min(setup.tokens_mb, spec.vocab_size) * d * c,
        "captured masks + rotary": mbs * profile.captured_bytes,
        SHARE_WORK: shared + (work_bytes(formats, share=False) if tiered else 0),
        "reduce-scatter output (ranks, fp32)": (
            ranks.shard(max((la.params for la in spec.layers), default=0)) * 4
            if ranks.world > 1
            else 0
        ),
    }
    phases = _phases(spec, profile, setup, chunk_tokens)
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    items = {k: v for k, v in {**base, **phases[phase]}.items() if v}
    return GpuMemory(
        items=items,
        peak_bytes=sum(items.values()),
        peak_phase=phase,
        persistent_bytes=layout.total_bytes,
    )


def _phases(
    spec: ModelSpec, profile: LayerProfile, setup: Setup, chunk_tokens: int
) -> dict[str, dict[str, int]]:
    """What each phase of the step holds beside the persistent buffers, its allocator slack
    (planning/allocator_slack.py: the phase's largest transient tensor) included."""
    c, d = spec.compute_dtype.itemsize, spec.hidden_size
    tokens_mb, tokens = setup.tokens_mb, setup.tokens_mb * setup.grad_accum
    mb_hidden = tokens_mb * d * c  # one micro-batch's hidden states (or their gradient)
    tier = TierSplit.of(spec.num_layers, setup.engine.gpu_state_blocks)
    staging = (
        spec.embed_params * 2 if spec.compute_dtype == torch.bfloat16 and not tier.embed else 0
    )
    inputs = device_inputs(setup.engine.boundary_plan(spec.num_layers))
    boundary = {
        "boundary activations": (spec.num_layers if inputs is None else inputs) * tokens * d * c,
        "last hidden / its gradient": tokens * d * c,
    }
    loss = loss_chunk(spec, chunk_tokens)
    phases = {
        "layer backward": {
            **boundary,
            "one layer recompute + backward": _layer_peak(spec, profile, setup),
            "attention backward workspace": profile.workspace_extra_bytes,
        },
        "loss": {**boundary, "loss chunk + hidden gradient": loss.peak_bytes + mb_hidden},
        "embedding backward": {
            "layer-0 inputs + gradients": 2 * tokens * d * c,
            "embedding gradient staging": staging,
        },
    }
    largest = {
        "layer backward": max(profile.largest_bytes, profile.workspace_bytes),
        "loss": loss.largest_bytes,
        "embedding backward": max(mb_hidden, staging),
    }
    vision = setup.vision
    front = spec.structure.front
    if front is not None and (vision.tower or vision.projector) and vision.image_share:
        patches = tokens_mb * vision.image_share * patches_per_image_token(spec.config)
        phases["vision backward"] = {  # engine/vision.py: after the layers, per micro-batch
            "first hidden gradients": tokens * d * c,
            "vision tower activations (one micro-batch)": int(
                patches * vision_saved_bytes_per_patch(spec.config, c)
            ),
        }
        # the tower's tensors are not measured (tens of MiB a micro-batch at run 38's shape):
        # the phase keeps the layer backward's, which run 38's slack supports
        largest["vision backward"] = max(mb_hidden, largest["layer backward"])
    for name, held in phases.items():
        held[SLACK_ITEM] = allocator_slack(largest[name], cuda=setup.cuda)
    return phases


def _advice(setup: Setup, profile: LayerProfile) -> list[str]:
    """What a setting the user gave costs where the plan knows a faster one."""
    if setup.engine.compile_layers and any(profile.fused):
        return [
            "training.compile_layers: true compiles layers that call a kernel package's fused "
            f"kernels (flash-linear-attention), which run {COMPILED_PACKAGE_SLOWDOWN}x their eager "
            f"GPU time compiled and hold {COMPILED_PACKAGE_LINEAR_ATTENTION_PEAK}x the package's "
            "buffers in their backward (planned so); compile_layers: auto leaves them eager"
        ]
    return []


def _notes(hw: Hardware) -> list[str]:
    assumed = [
        f
        for f in (
            "gpu_bytes",
            "host_bytes",
            "h2d_gbps",
            "d2h_gbps",
            "gpu_tflops_bf16",
            "optimizer_gparams_s",
            "process_baseline_bytes",
        )
        if f not in hw.measured
    ]
    notes = [
        "all tokens assumed supervised (loss FLOPs) and every padded micro-batch assumed "
        "to carry a padding mask"
    ]
    if hw.source("gpu_name") == "assumed":  # detect() found no CUDA device
        notes.append(
            f"no GPU found here: the GPU figures are for an assumed {hw.gpu_name} with "
            f"{gib(hw.gpu_bytes)} (--gpu-gib sets its memory; estimate on the GPU host for its own)"
        )
    if assumed:
        probed = ", ".join(f for f in RATES if f in assumed)
        how = f"; `megatrain estimate --probe` measures {probed}" if probed else ""
        notes.append(
            f"assumed, not measured here: {', '.join(assumed)} (the H100 test host's{how})"
        )
    return notes
