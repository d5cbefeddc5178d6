"""`megatrain verify`: the engine against plain PyTorch training on the run's own config.

    megatrain verify --config FILE [--steps N] [--section.key VALUE ...]
    megatrain verify MODEL | --model-type NAME --tiny [--dtype bf16] [--device cuda] ...

The short flags are abbreviations of config keys (megatrain.verify.SHORTHANDS) applied on
verify's own defaults (small random batches, fp32); with --config they apply on the file.
Exit status 0: every step within tolerance; 1: not; 2: a usage error.
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check the engine against plain PyTorch training",
        description="Trains a few steps with the engine and with plain PyTorch (HF model, "
        "torch.optim.AdamW, clip_grad_norm_) from the same weights on the same random "
        "batches, and compares losses, gradients and weights (docs/verify.md). "
        "--section.key VALUE overrides any config key.",
    )
    src = p.add_argument_group("what to verify (one of)")
    src.add_argument("--config", help="a run's YAML file: verify its model and settings")
    src.add_argument("model", nargs="?", help="hub id or local directory of a checkpoint")
    src.add_argument("--model-type", help="a transformers model type, e.g. qwen3_moe")
    src.add_argument("--tiny", action="store_true", help="tiny random config of --model-type")
    own = p.add_argument_group("verify's own options")
    own.add_argument(
        "--steps", "--verify.steps", type=int, default=3, help="optimizer steps to compare"
    )
    own.add_argument("--json", action="store_true", help="print the per-step report as JSON")
    short = p.add_argument_group("short forms of config keys (default: verify's small setup)")
    short.add_argument("--grad-accum", type=int, help="training.gradient_accumulation_steps (2)")
    short.add_argument("--batch-size", type=int, help="training.micro_batch_size (2)")
    short.add_argument("--seq-len", type=int, help="training.seq_len and data.cutoff_len (24)")
    short.add_argument(
        "--packed", action="store_true", default=None, help="data.packing: packed rows"
    )
    short.add_argument("--dtype", choices=["fp32", "bf16"], help="model.compute_dtype (fp32)")
    short.add_argument("--device", help="training.device: auto, cpu, cuda, cuda:N (auto)")
    short.add_argument("--lr", type=float, help="optimizer.learning_rate (1e-3)")
    short.add_argument("--weight-decay", type=float, help="optimizer.weight_decay (0.1)")
    short.add_argument(
        "--max-grad-norm", type=float, help="optimizer.max_grad_norm, 0 disables clipping (1.0)"
    )
    short.add_argument("--num-slots", type=int, help="memory.num_slots (2)")
    short.add_argument("--seed", type=int, help="training.seed (0)")
    short.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model.config_overrides.KEY, e.g. output_router_logits=true",
    )
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    from megatrain.device import resolve_device
    from megatrain.model.loading import parse_config_sets
    from megatrain.threads import compute_threads, use_compute_threads
    from megatrain.verify import (
        SHORTHANDS,
        TOLERANCES,
        format_report,
        run_verify,
        verify_config,
        within,
    )

    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: verify needs at least 1 step")
    given = [x for x in (args.config, args.model, args.model_type) if x]
    if len(given) != 1:
        raise ValueError(
            "verify needs exactly one of --config FILE, MODEL (hub id or directory) or "
            "--model-type NAME (with --tiny for a tiny random model)"
        )
    cfg = verify_config(
        args.config,
        args.overrides,
        model=args.model,
        model_type=args.model_type,
        tiny=args.tiny,
        config_overrides=parse_config_sets(args.set),
        **{name: getattr(args, name) for name in SHORTHANDS},
    )
    use_compute_threads(compute_threads(cfg.training.device, cfg.training.threads))
    reports = run_verify(cfg, steps=args.steps)
    ok = within(reports)
    if args.json:
        print(json.dumps({"ok": ok, "steps": [r.__dict__ for r in reports]}))
        return 0 if ok else 1
    m = cfg.model
    name = args.config or m.name_or_path or f"{m.model_type}{' (tiny)' if m.tiny else ''}"
    mbs, grad_accum = cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps
    print(
        f"verify {name}: {m.compute_dtype} compute on {resolve_device(cfg.training.device)}, "
        f"{args.steps} "
        f"steps, {grad_accum} micro-batches of {mbs}x{cfg.seq_len} ({cfg.layout})"
    )
    print(format_report(reports, TOLERANCES[m.compute_dtype]))
    print("PASS" if ok else "FAIL: the engine differs from PyTorch beyond tolerance")
    return 0 if ok else 1
