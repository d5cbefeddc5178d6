"""Host RAM, GPU peak and step time of one training setup, before anything large is allocated.

Host (bytes per parameter P; the store of store/host.py, every block):
- bf16 compute: fp32 master + exp_avg + exp_avg_sq pageable (12), bf16 shadow pinned (2;
  gradients land in it). fp32 compute: exp_avg + exp_avg_sq pageable (8), fp32 master and
  fp32 gradient pinned (8). exp_avg + exp_avg_sq take 8 with `state_dtype` fp32, 4 with bf16
  and 2 + 8/2048 (codes + per-block scales) with int8 (store/states.py, counted per block):
  14, 10 and ~8 B/param in bf16 compute.
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

GPU (what `torch.cuda.max_memory_allocated` sees; c = bytes of the compute dtype, L layers,
T tokens per step, Tm per micro-batch, D hidden, V vocab, Pl largest layer, Ph head block):
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
  hidden gradient), the embedding gradient's bf16 staging at the end of the backward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from megatrain.dtypes import torch_dtype
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.head import default_chunk_tokens
from megatrain.planning.activations import LayerProfile, layer_profile, loss_chunk
from megatrain.planning.hardware import Hardware, detect, gib
from megatrain.planning.host_memory import HostMemory, host_memory, pinned_reserved
from megatrain.planning.long_context import device_inputs, host_input_bytes
from megatrain.planning.ranks import ONE_PROCESS, Ranks
from megatrain.planning.spec import ModelSpec, build_spec
from megatrain.planning.timing import StepTime, step_time


@dataclass(frozen=True)
class GpuMemory:
    items: dict[str, int]  # at the peak phase, name -> bytes; sums to peak_bytes
    peak_bytes: int
    peak_phase: str  # "layer backward", "loss" or "embedding backward"

    @property
    def persistent_bytes(self) -> int:
        """What the engine keeps on the GPU between steps (a step's activations are freed)."""
        return sum(self.items.get(k, 0) for k in PERSISTENT_ITEMS)


PERSISTENT_ITEMS = (
    "GPU tier (fp32 master, m, v, gradient, weights)",
    "weight slots",
    "gradient accumulators (fp32)",
    "gradient staging (bf16)",
    "head weights",
    "tied lm_head table",
    "head + embedding gradients (fp32)",
)
"""The GPU items of `gpu_memory` that live across steps."""


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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["host"]["store_bytes"] = self.host.store_bytes
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


def estimate(
    config: PretrainedConfig | ModelSpec,
    *,
    seq_len: int,
    micro_batch_size: int,
    grad_accum: int = 1,
    compute_dtype: str | torch.dtype | None = None,
    num_slots: int = 2,
    padded: bool = True,
    packed: bool = False,
    clipping: bool = True,
    hardware: Hardware | None = None,
    loss_chunk_tokens: int | None = None,
    data_bytes: int = 0,
    pin_memory: bool = True,
    state_dtype: str = "fp32",
    gpu_state_blocks: int = 0,
    compiled: bool = False,
    boundary_plan: BoundaryPlan | None = None,
    mlp_tiles: int = 1,
    ranks: Ranks = ONE_PROCESS,
) -> Estimate:
    """Predict host RAM, GPU peak and step time of training `config` with these settings.

    `boundary_plan`: where the layers' saved inputs wait (planning/long_context.py; None: all
    on the GPU); `mlp_tiles`: sequence tiles of each layer's MLP (engine/tiling.py).

    `gpu_state_blocks`: blocks kept on the GPU with their optimizer states, counted layers
    first, then embedding, then head (engine/tier.py); more than the model has means all.

    `padded`: micro-batches carry padding masks (4-D [B,1,S,S] masks under sdpa); `packed`:
    rows of several samples (position ids restart); neither: full rows, no mask.
    `ranks`: the processes the run is planned for (several: per-rank batch, per-rank GPU with
    the GPU tier's states sharded, per-node host).
    `clipping`: gradient-norm clipping on (the optimizer then starts after the backward).
    `compute_dtype` "bf16" or "fp32"; None: the spec's, or bf16 for a config.
    `state_dtype`: the AdamW states' layout, "fp32", "bf16" or "int8" (optimizer.state_dtype).
    `compiled`: decoder layers run torch.compile'd (training.compile_layers).
    """
    for name, value in (
        ("seq_len", seq_len),
        ("micro_batch_size", micro_batch_size),
        ("grad_accum", grad_accum),
        ("num_slots", num_slots),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if padded and packed:
        raise ValueError("a micro-batch is either padded or packed, not both")
    spec = model_spec(config, compute_dtype)
    tier = min(max(gpu_state_blocks, 0), spec.num_layers + 2)
    slots = min(num_slots, spec.num_layers - min(tier, spec.num_layers))  # streamed layers only
    hw = hardware or detect()
    layout = "padded" if padded else "packed" if packed else "full"
    chunk = min(
        loss_chunk_tokens or default_chunk_tokens(spec.vocab_size), micro_batch_size * seq_len
    )
    # the engine splits attention heads where it tiles: not for compiled layers (recipes/builder.py)
    split = mlp_tiles > 1 and not compiled
    profile = layer_profile(spec, micro_batch_size, seq_len, layout, mlp_tiles, split)
    plan = boundary_plan or BoundaryPlan.on_device(spec.num_layers)
    input_bytes = micro_batch_size * seq_len * spec.hidden_size * spec.compute_dtype.itemsize
    reserved = pinned_reserved if pin_memory else (lambda n: n)
    gpu = gpu_memory(
        spec,
        profile,
        tokens_mb=micro_batch_size * seq_len,
        micro_batches=grad_accum,
        num_slots=slots,
        chunk_tokens=chunk,
        gpu_state_blocks=tier,
        ranks=ranks,
        device_inputs=device_inputs(plan),
    )
    host = host_memory(
        spec,
        hw,
        data_bytes=data_bytes,
        offload_bytes=host_input_bytes(plan, input_bytes, grad_accum, reserved),
        pin_memory=pin_memory,
        state_dtype=state_dtype,
        gpu_state_blocks=tier,
        ranks=ranks,
    )
    chunks_per_mb = -(-micro_batch_size * seq_len // chunk)
    timing = step_time(
        spec,
        hw,
        rows=micro_batch_size,
        seq=seq_len,
        micro_batches=grad_accum,
        num_slots=slots,
        clipping=clipping,
        gpu_state_blocks=tier,
        state_dtype=state_dtype,
        compiled=compiled,
        layer_ops=profile.ops,
        recomputed=[plan.places[i + 1] == "none" for i in range(spec.num_layers - 1)] + [False],
        loss_ops=chunks_per_mb * loss_chunk(spec, chunk)[1],
        ranks=ranks,
    )
    settings = dict(
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        tokens_per_step=seq_len * micro_batch_size * grad_accum,
        compute_dtype="bf16" if spec.compute_dtype == torch.bfloat16 else "fp32",
        num_slots=slots,
        layout=layout,
        clipping=clipping,
        loss_chunk_tokens=chunk,
        state_dtype=state_dtype,
        gpu_state_blocks=tier,
        compiled=compiled,
        activations=plan.describe(),
        mlp_tiles=mlp_tiles,
        nproc_per_node=ranks.nproc_per_node,
        nnodes=ranks.nnodes,
    )
    return Estimate(
        model=spec.describe(),
        total_params=spec.total_params,
        active_params=spec.active_params,
        layer_params_max=spec.layer_params_max,
        settings=settings,
        host=host,
        gpu=gpu,
        time=timing,
        hardware=hw,
        notes=_notes(hw),
    )


def gpu_memory(
    spec: ModelSpec,
    profile: LayerProfile,
    *,
    tokens_mb: int,
    micro_batches: int,
    num_slots: int,
    chunk_tokens: int,
    gpu_state_blocks: int = 0,
    device_inputs: int | None = None,
    ranks: Ranks = ONE_PROCESS,
) -> GpuMemory:
    """`device_inputs`: saved layer inputs per micro-batch on the device at the backward's peak
    (planning/long_context.py; None: every layer's)."""
    c = torch.finfo(spec.compute_dtype).bits // 8
    bf16 = spec.compute_dtype == torch.bfloat16
    n = spec.num_layers
    streamed = [la.params for la in spec.layers[gpu_state_blocks:]]
    embed_tier, head_tier = gpu_state_blocks > n, gpu_state_blocks > n + 1
    pl, d, table = max(streamed, default=0), spec.hidden_size, spec.embed_params
    head = 0 if head_tier else spec.head_params  # streamed head / embedding: their buffers
    streamed_table = 0 if embed_tier else table
    tier_blocks = [la.params for la in spec.layers[:gpu_state_blocks]]
    tier_blocks += [table] * embed_tier + [spec.head_params] * head_tier
    # fp32 master (unless it is the weights), m, v, gradient: the rank's shard of each block
    tier_states = sum(ranks.shard(p) for p in tier_blocks) * (16 if bf16 else 12)
    sharded = ranks.world > 1  # a tier's gradients accumulate in the shared buffers
    acc_pl = max((la.params for la in spec.layers), default=0) if sharded else pl
    acc_head, acc_table = (spec.head_params, table) if sharded else (head, streamed_table)
    tokens = tokens_mb * micro_batches
    layer_peak, captured = profile.peak_bytes, profile.captured_bytes
    base = {
        "GPU tier (fp32 master, m, v, gradient, weights)": sum(tier_blocks) * c + tier_states,
        "weight slots": num_slots * pl * c,
        "gradient accumulators (fp32)": 2 * acc_pl * 4,
        "gradient staging (bf16)": 2 * acc_pl * 2 if bf16 else 0,
        "head weights": head * c,
        "tied lm_head table": streamed_table * c if spec.tied else 0,
        "head + embedding gradients (fp32)": (acc_head + acc_table) * 4,
        "embedding rows": micro_batches * min(tokens_mb, spec.vocab_size) * d * c,
        "captured masks + rotary": micro_batches * captured,
        "all-gathered embedding table (ranks)": streamed_table * c if sharded else 0,
        "reduce-scatter output (ranks, fp32)": ranks.shard(pl) * 4 if ranks.world > 1 else 0,
    }
    boundary = {
        "boundary activations": (spec.num_layers if device_inputs is None else device_inputs)
        * tokens
        * d
        * c,
        "last hidden / its gradient": tokens * d * c,
    }
    phases = {
        "layer backward": {
            **boundary,
            "one layer recompute + backward": layer_peak,
            "attention backward workspace": profile.workspace_extra_bytes,
        },
        "loss": {
            **boundary,
            "loss chunk + hidden gradient": loss_chunk(spec, chunk_tokens)[0] + tokens_mb * d * c,
        },
        "embedding backward": {
            "layer-0 inputs + gradients": 2 * tokens * d * c,
            "embedding gradient staging": streamed_table * 2 if bf16 else 0,
        },
    }
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    items = {k: v for k, v in {**base, **phases[phase]}.items() if v}
    return GpuMemory(items=items, peak_bytes=sum(items.values()), peak_phase=phase)


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
        notes.append(
            f"assumed, not measured here: {', '.join(assumed)} (defaults of the H100 "
            "test host; `megatrain estimate --probe` measures them)"
        )
    return notes
