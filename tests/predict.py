"""The estimate of a setup given as keywords (what the resource tests vary), built into the
planner's objects: `EnginePlan` and `Setup` (planning/estimate.py takes nothing else)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from megatrain.config import TrainConfig
from megatrain.config.shorthand import shorthand_config
from megatrain.distributed import Placement
from megatrain.engine.boundaries import BoundaryPlan
from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.plan import EnginePlan
from megatrain.engine.tiling import TilePolicy, untiled_layers
from megatrain.planning.batch_size import pick_micro_batch
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.estimate import Estimate, estimate, model_spec
from megatrain.planning.hardware import Hardware
from megatrain.planning.plan import ResourcePlan
from megatrain.planning.ranks import ONE_PROCESS, Ranks
from megatrain.planning.setup import Setup
from megatrain.planning.spec import ModelSpec


def setup_of(
    spec: ModelSpec,
    *,
    seq_len: int,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    num_slots: int = 2,
    padded: bool = True,
    packed: bool = False,
    clipping: bool = True,
    loss_chunk_tokens: int | None = None,
    data_bytes: int = 0,
    pin_memory: bool = True,
    state_dtype: str = "fp32",
    master_dtype: str = "fp32",
    grad_dtype: str = "bf16",
    gpu_state_blocks: int = 0,
    compiled: bool = False,
    boundary_plan: BoundaryPlan | None = None,
    mlp_tiles: int = 1,
    ranks: Ranks = ONE_PROCESS,
) -> Setup:
    if padded and packed:
        raise ValueError("a micro-batch is either padded or packed, not both")
    engine = EnginePlan(
        num_slots=num_slots,
        clip_norm=1.0 if clipping else None,
        loss_chunk_tokens=loss_chunk_tokens or default_chunk_tokens(spec.vocab_size),
        compile_layers=compiled,
        gpu_state_blocks=gpu_state_blocks,
        boundaries=boundary_plan,
        tiles=TilePolicy(mlp_tiles),
        untiled=untiled_layers(spec.structure),
        world_size=ranks.world,
    )
    return Setup(
        engine,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        layout="padded" if padded else "packed" if packed else "full",
        state_dtype=state_dtype,
        master_dtype=master_dtype,
        grad_dtype=grad_dtype,
        pin_memory=pin_memory,
        data_bytes=data_bytes,
        ranks=ranks,
    )


def predict(
    config: PretrainedConfig | ModelSpec,
    *,
    compute_dtype: str | None = None,
    hardware: Hardware | None = None,
    **setup: Any,
) -> Estimate:
    """`estimate` of `config` with the setup the keywords describe (setup_of)."""
    spec = model_spec(config, compute_dtype)
    return estimate(spec, setup_of(spec, **setup), hardware)


def pick_batch(
    config: PretrainedConfig | ModelSpec,
    *,
    seq_len: int,
    hardware: Hardware,
    tokens_per_step: int | None = None,
    grad_accum: int | None = None,
    gpu_margin_gib: float = 2.0,
    compute_dtype: str | None = None,
    max_micro_batch_size: int = 64,
    on_host: bool = False,
    host_margin_gib: float = 0.0,
    **setup: Any,
) -> tuple[int, int, str]:
    """`pick_micro_batch` over the setup the keywords describe."""
    spec = model_spec(config, compute_dtype)
    return pick_micro_batch(
        spec,
        setup_of(spec, seq_len=seq_len, **setup),
        tokens_per_step=tokens_per_step,
        grad_accum=grad_accum,
        hardware=hardware,
        gpu_margin_gib=gpu_margin_gib,
        max_micro_batch_size=max_micro_batch_size,
        on_host=on_host,
        host_margin_gib=host_margin_gib,
    )


def ranks_estimate(spec: ModelSpec, ranks: Ranks, hardware: Hardware, tier: int = 0) -> Estimate:
    """The ranks tests' setup: 4 micro-batches of one 2048-token row per rank, full rows,
    clipping on, nothing pinned, `tier` GPU-tier blocks."""
    return predict(
        spec,
        seq_len=2048,
        micro_batch_size=1,
        grad_accum=4,
        padded=False,
        clipping=True,
        hardware=hardware,
        pin_memory=False,
        gpu_state_blocks=tier,
        ranks=ranks,
    )


def cli_row_plan(
    shape: dict[str, Any], hardware: Hardware, device: str = "cuda", **settings: Any
) -> ResourcePlan:
    """The plan of a bench/cli_train.py row (`cli_row_config`) on `hardware`: how the H100
    runs of docs/performance.md are reconstructed without a GPU."""
    placement = Placement(torch.device(device))
    cfg = cli_row_config(shape, **settings)
    return PlanBuilder(cfg, hardware=hardware, placement=placement).plan(layout="full")


def cli_row_config(shape: dict[str, Any], **settings: Any) -> TrainConfig:
    """The config of a bench/cli_train.py row (`megatrain train` on a random-init `shape`:
    pre-training rows of 2048, micro-batch 4, 32 rows a step, clipping 1.0) with `settings`
    (dotted keys) over those defaults."""
    values: dict[str, Any] = {
        "model.model_type": shape["model_type"],
        "model.random_init": True,
        "data.stage": "pt",
        "data.cutoff_len": 2048,
        "training.seq_len": 2048,
        "training.micro_batch_size": 4,
        "training.gradient_accumulation_steps": 8,
        "optimizer.max_grad_norm": 1.0,
        # the rows of docs/performance.md before run 59 ran without a GPU update share (0 was
        # the default then); a row with one sets it
        "optimizer.gpu_update_blocks": 0,
        **{f"model.config_overrides.{k}": v for k, v in shape.items() if k != "model_type"},
        **settings,
    }
    values["data.cutoff_len"] = values["training.seq_len"]
    return shorthand_config(None, values=values)
