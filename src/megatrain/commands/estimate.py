"""`megatrain estimate`: host RAM, GPU peak and step time of a run, without loading weights.

    megatrain estimate --config examples/qwen2_5_7b.yaml [--section.key VALUE ...]
    megatrain estimate --model Qwen/Qwen2.5-7B --seq-len 4096 --micro-batch-size 4 --grad-accum 8
    megatrain estimate --model-type qwen3 --tiny --seq-len 256 --tokens-per-step 4096 --json
    megatrain estimate --config examples/grpo_demo.yaml --grpo   # + the rollout phase
    megatrain estimate --config examples/dpo_demo.yaml --pairs 20000   # + the DPO reference

The run is described by a config as for `train` (a YAML file, or the short flags below on the
defaults); the resource plan of megatrain.planning.builder is the one `train` checks before
loading (its RunBuilder extends that builder), so the two agree. Only the model's config is
read; the model is built on the meta device. The run is planned for a GPU unless
training.device is cpu.
`--nproc-per-node N --nnodes M` plans the torchrun job: GPU numbers per rank, host numbers per
node, the step with its collectives (planning/ranks.py); batch flags are per rank.
A preference config (data.stage dpo or kto: a `megatrain dpo` run) adds what its reference
costs (recipes/dpo/plan.py, per dpo.reference): the one-off pass over `--pairs` pairs (default
data.max_samples, else 1000) and its table, or the weights' host copy and the pass per step.
The machine is this one (`--probe` measures its rates, a few seconds), with the H100 test
host's numbers for what is not measured (on a machine without a GPU the GPU itself: a note
says so); `--gpu-gib` / `--host-gib` set the memory sizes.

Prints a table, or with `--json` one JSON object; both list every host store layout
(optimizer.state_dtype, master_dtype, grad_dtype) with this run's host RAM, the largest model
the host holds and the step with it (planning/store_table.py). Exit status 0 when the setup
fits, 1 when it does not (the reasons are printed), 2 for a usage error. torch and
transformers are imported where the command runs, not here: `megatrain --help` parses without
them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from megatrain.config import TrainConfig
from megatrain.config.sections import PLANNED_BATCH
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.data.config import PREFERENCE_STAGES
from megatrain.layouts import LAYOUTS

if TYPE_CHECKING:
    from megatrain.distributed import Placement
    from megatrain.planning.builder import PlanBuilder
    from megatrain.planning.plan import ResourcePlan
    from megatrain.recipes.dpo.plan import ReferencePlan


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="host RAM, GPU peak and step time, before a run")
    add_arguments(p)
    p.set_defaults(run=run, takes_overrides=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("the run (one of)")
    src.add_argument("--config", help="a run's YAML file (megatrain train --config)")
    src.add_argument("--model", help="hub id or local directory (only config.json is read)")
    src.add_argument("--model-type", help="a transformers model type, e.g. qwen3")
    src.add_argument("--tiny", action="store_true", help="tiny random config of --model-type")
    src.add_argument("--trust-remote-code", action="store_true")
    src.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model.config_overrides.KEY, e.g. num_hidden_layers=4",
    )
    run_ = parser.add_argument_group("short forms of config keys (default: the config's)")
    run_.add_argument("--seq-len", type=int, help="training.seq_len: tokens per row")
    run_.add_argument("--micro-batch-size", help="training.micro_batch_size: rows, or auto")
    steps = run_.add_mutually_exclusive_group()
    steps.add_argument("--grad-accum", type=int, help="training.gradient_accumulation_steps")
    steps.add_argument(
        "--tokens-per-step", type=int, help="tokens per optimizer step (grad accumulation follows)"
    )
    run_.add_argument("--dtype", choices=["bf16", "fp32"], help="model.compute_dtype")
    run_.add_argument("--num-slots", type=int, help="memory.num_slots: GPU weight slots")
    run_.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        help="rows padded (4-D masks), packed samples (data.packing), or full rows without mask",
    )
    run_.add_argument("--max-grad-norm", type=float, help="optimizer.max_grad_norm; 0: no clipping")
    run_.add_argument("--gpu-margin-gib", type=float, help="memory.gpu_margin_gib")
    run_.add_argument("--host-margin-gib", type=float, help="memory.host_margin_gib")
    ranks = parser.add_argument_group("ranks (torchrun; docs/multi_gpu.md)")
    ranks.add_argument(
        "--nproc-per-node", type=int, default=1, help="processes (GPUs) per node (default 1)"
    )
    ranks.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    hw = parser.add_argument_group("hardware")
    hw.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine's pinned copy and CPU AdamW rates, as megatrain train "
        "does before it plans (memory.probe_rates)",
    )
    hw.add_argument("--gpu-gib", type=float, help="GPU memory (default: this GPU or 80)")
    hw.add_argument("--host-gib", type=float, help="host RAM (default: this machine's)")
    parser.add_argument(
        "--longest",
        action="store_true",
        help="also search the longest row (multiple of 1024 tokens, one row per micro-batch) "
        "that fits this GPU and host with the run's memory settings",
    )
    parser.add_argument(
        "--grpo",
        action="store_true",
        help="a megatrain grpo run: add its rollout phase (the config's grpo: section)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        help="a preference run (data.stage dpo/kto): pairs (train + eval; KTO: rows) the "
        "reference covers (default data.max_samples, else 1000)",
    )
    parser.add_argument(
        "--image-share",
        type=float,
        default=0.0,
        help="a vision-language run: the share of the step's tokens that are image tokens "
        "(0-1; megatrain train takes it from the data), for the vision tower's time",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from megatrain.model.kernels import kernel_report
    from megatrain.planning import format_estimate
    from megatrain.planning.store_table import store_table
    from megatrain.recipes.grpo.plan import (
        format_rollout,
        grpo_plan,
        rollout_dict,
        training_config,
    )

    cfg = _config(args)
    if args.grpo or cfg.data.stage in PREFERENCE_STAGES:  # megatrain grpo's and dpo's defaults
        cfg = _config(args, defaults=PLANNED_BATCH)
    if args.grpo:  # the batch and rows megatrain grpo trains (and its engine runs), per rank
        from megatrain.planning.ranks import Ranks

        cfg = training_config(cfg, Ranks(args.nproc_per_node, args.nnodes).world)
    builder = _builder(cfg, args)
    if not 0.0 <= args.image_share <= 1.0:
        raise ValueError(f"--image-share {args.image_share}: give a share between 0 and 1")
    builder.image_share = args.image_share
    layout = "full" if args.layout == "full" else None
    grpo = grpo_plan(builder) if args.grpo else None
    plan = (
        grpo.training if grpo else builder.plan(tokens_per_step=args.tokens_per_step, layout=layout)
    )
    ref = _reference(cfg, plan, builder, args.pairs)
    if ref is not None:
        from megatrain.recipes.dpo.plan import with_reference

        plan = with_reference(plan, ref, builder.hardware, cfg.memory.host_margin_gib)
    est, mem = plan.estimate, cfg.memory
    layouts = store_table(builder.spec, plan.setup, builder.hardware, mem.host_margin_gib)
    problems = grpo.problems if grpo else plan.problems
    fits = not problems
    problem = "; ".join(problems) if problems else None
    longest = _longest(cfg, builder.hardware, builder.placement, layout) if args.longest else None
    if args.json:
        report = {**est.to_dict(), "fits": fits, "problem": problem}
        report["host_store_layouts"] = dataclasses.asdict(layouts)
        if grpo:
            report["grpo"] = rollout_dict(grpo)
        if ref is not None:
            report["reference"] = dataclasses.asdict(ref)
        reasons = {
            "micro_batch_reason": plan.batch_reason,
            "gpu_tier_reason": plan.tier_reason,
            "activations_reason": plan.boundary_reason,
            "mlp_tiles_reason": plan.tiles_reason,
            "gpu_update_share_reason": plan.share_reason,
            "longest_row": longest,
        }
        print(json.dumps({**report, **reasons}))
        return 0 if fits else 1
    c = cfg.checkpoint
    print(format_estimate(est, c.export_dtype if c.export_hf else None, layouts))
    for line in kernel_report(builder.spec.structure):  # as `train` prints it
        print(f"kernels: {line}")
    if grpo:
        print(format_rollout(grpo))
    if ref is not None:
        from megatrain.recipes.dpo.plan import format_reference

        print(format_reference(ref))
    _print_choices(plan)
    if args.longest:
        print(f"longest row that fits: {longest if longest else 'none'} tokens")
    print(
        f"fits: {'yes' if fits else 'no'} (margins: GPU {mem.gpu_margin_gib:g} GiB, "
        f"host {mem.host_margin_gib:g} GiB)"
    )
    if problem:
        print(problem)
    return 0 if fits else 1


def _print_choices(plan: ResourcePlan) -> None:
    """Why "auto" chose the batch, the GPU tier, the MLP tiles and the GPU update share, and
    where the layer inputs wait."""
    if plan.batch_reason:
        print(f"auto micro-batch: {plan.batch_reason}")
    if plan.tier_reason:
        print(f"auto {plan.tier_reason}")
    print(f"layer inputs: {plan.boundary_reason}")
    if plan.tiles_reason:
        print(f"auto {plan.tiles_reason}")
    if plan.share_reason:
        print(f"auto {plan.share_reason}")


def _reference(
    cfg: TrainConfig, plan: ResourcePlan, builder: PlanBuilder, pairs: int | None
) -> ReferencePlan | None:
    """What the reference of a preference run costs (None: not a preference run)."""
    if cfg.data.stage not in PREFERENCE_STAGES:
        if pairs is not None:
            raise ValueError(
                f"--pairs {pairs}: data.stage={cfg.data.stage!r} is no preference run; --pairs "
                "is for a config with data.stage: dpo or kto (megatrain dpo)"
            )
        return None
    from megatrain.recipes.dpo.plan import reference_plan

    if pairs is None:
        pairs = cfg.data.max_samples or 1000
    if pairs < 1:
        raise ValueError(f"--pairs {pairs}: give the number of preference pairs, >= 1")
    return reference_plan(
        plan,
        builder.spec,
        loss_type=cfg.dpo.loss_type,
        reference=cfg.dpo.reference,
        pairs=(pairs,),
        world_size=builder.placement.world_size,
        swap_s=builder.reference_swap_s(plan.gpu_state_blocks),
    )


def _builder(cfg: TrainConfig, args: argparse.Namespace) -> PlanBuilder:
    """The planner of the run on this machine (measured with --probe), for the GPU (unless
    training.device is cpu) and the ranks asked for."""
    import torch

    from megatrain.distributed import Placement
    from megatrain.planning import detect, probe
    from megatrain.planning.builder import PlanBuilder
    from megatrain.planning.ranks import Ranks

    ranks = Ranks(args.nproc_per_node, args.nnodes)  # ValueError for a count < 1
    threads = cfg.optimizer.threads
    hardware = (
        probe(  # what megatrain train measures before it plans (memory.probe_rates)
            optimizer_threads=threads * ranks.nproc_per_node if threads else None,
            state_dtype=cfg.optimizer.state_dtype,
            impl=cfg.optimizer.impl,
            matmul=False,
            gpu_gib=args.gpu_gib,
            host_gib=args.host_gib,
        )
        if args.probe
        else detect(gpu_gib=args.gpu_gib, host_gib=args.host_gib)
    )
    device = "cpu" if cfg.training.device == "cpu" else "cuda"
    placement = Placement(torch.device(device), 0, ranks.world, 0, ranks.nproc_per_node)
    if args.grpo:  # the GPU tier leaves the resident rollout its room, as megatrain grpo does
        from megatrain.recipes.grpo.plan import rollout_reserve

        return PlanBuilder(cfg, hardware=hardware, placement=placement, gpu_reserve=rollout_reserve)
    return PlanBuilder(cfg, hardware=hardware, placement=placement)


def _config(
    args: argparse.Namespace, defaults: dict[str, dict[str, Any]] | None = None
) -> TrainConfig:
    from megatrain.model.loading import parse_config_sets

    given = [x for x in (args.config, args.model, args.model_type) if x]
    if len(given) != 1:
        raise ValueError(
            "estimate needs exactly one of --config FILE, --model ID|PATH, --model-type NAME"
        )
    if not args.config and args.seq_len is None:
        raise ValueError("give --seq-len N (or a --config file)")
    values: dict[str, Any] = model_values(
        args.model, args.model_type, args.tiny, args.trust_remote_code, parse_config_sets(args.set)
    )
    values |= {
        "training.seq_len": args.seq_len,
        "data.cutoff_len": args.seq_len,
        "training.micro_batch_size": _micro_batch(args.micro_batch_size),
        "training.gradient_accumulation_steps": args.grad_accum,
        "model.compute_dtype": args.dtype,
        "memory.num_slots": args.num_slots,
        "data.packing": None if args.layout in (None, "full") else args.layout == "packed",
        "optimizer.max_grad_norm": args.max_grad_norm,
        "memory.gpu_margin_gib": args.gpu_margin_gib,
        "memory.host_margin_gib": args.host_margin_gib,
    }
    if args.tokens_per_step is not None:
        values["training.gradient_accumulation_steps"] = None  # follows from tokens per step
    return shorthand_config(args.config, args.overrides, values=values, defaults=defaults)


def _longest(
    cfg: TrainConfig, hardware: Any, placement: Placement, layout: str | None
) -> int | None:
    """The longest row (one per micro-batch) whose plan fits, up to 8M tokens."""
    from megatrain.planning.builder import PlanBuilder
    from megatrain.planning.long_context import longest_fitting

    def fits(seq: int) -> bool:
        run = dataclasses.replace(
            cfg,
            training=dataclasses.replace(cfg.training, seq_len=seq, micro_batch_size=1),
            data=dataclasses.replace(cfg.data, cutoff_len=seq),
        )
        return PlanBuilder(run, hardware=hardware, placement=placement).plan(layout=layout).fits

    return longest_fitting(fits, 1024, 8 << 20, 1024)


def _micro_batch(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--micro-batch-size must be an integer >= 1 or auto, got {text!r}")
    return value
