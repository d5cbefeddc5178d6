"""The `megatrain` command: thin argument parsing over the package's entry points.

    megatrain train    --config FILE [--section.key value ...]
    megatrain verify   [MODEL | --model-type NAME --tiny] [--dtype bf16] [--device cuda]
    megatrain estimate --config FILE | --model MODEL --seq-len N --tokens-per-step N
    megatrain data     --config FILE --show N [--json]
    megatrain export   --checkpoint DIR --out DIR

Errors a user can fix (bad path, bad key, unsupported model, disk full) print one paragraph and
exit 2; Ctrl-C prints where the last checkpoint is and exits 130. MEGATRAIN_DEBUG=1 shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

from megatrain.device import resolve_device
from megatrain.model.loading import parse_config_sets
from megatrain.resources.disk import DiskFullError


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check the engine against plain PyTorch training")
    p.add_argument("model", nargs="?", help="hub id or local directory")
    p.add_argument("--model-type", help="a transformers model type, e.g. qwen3_moe")
    p.add_argument("--tiny", action="store_true", help="tiny random config of --model-type")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--packed", action="store_true", help="packed rows instead of padded ones")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--num-slots", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. output_router_logits=true",
    )
    p.add_argument("--json", action="store_true", help="print the per-step report as JSON")
    p.set_defaults(func=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from megatrain.verify import TOLERANCES, VerifyConfig, format_report, run_verify, within

    if (args.model is None) == (args.model_type is None):
        raise ValueError("verify needs a MODEL (hub id or directory) or --model-type NAME")
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    cfg = VerifyConfig(
        source=args.model,
        model_type=args.model_type,
        tiny=args.tiny,
        steps=args.steps,
        grad_accum=args.grad_accum,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        packed=args.packed,
        compute_dtype=dtype,
        device=resolve_device(args.device),
        lr=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        num_slots=args.num_slots,
        seed=args.seed,
        config_overrides=parse_config_sets(args.set),
    )
    reports = run_verify(cfg)
    ok = within(reports)
    if args.json:
        print(json.dumps({"ok": ok, "steps": [r.__dict__ for r in reports]}))
    else:
        name = args.model or f"{args.model_type}{' (tiny)' if args.tiny else ''}"
        print(
            f"verify {name}: {args.dtype} compute on {cfg.device}, {cfg.steps} steps, "
            f"{cfg.grad_accum} micro-batches of {cfg.batch_size}x{cfg.seq_len} "
            f"({'packed' if cfg.packed else 'padded'})"
        )
        print(format_report(reports, TOLERANCES[dtype]))
        print("PASS" if ok else "FAIL: the engine differs from PyTorch beyond tolerance")
    return 0 if ok else 1


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from a YAML config",
        description="Any --section.key VALUE after the options overrides the "
        "config, e.g. --optimizer.learning_rate 2e-5",
    )
    p.add_argument("--config", help="YAML config file (see examples/)")
    p.set_defaults(func=_run_train, takes_overrides=True)


def _run_train(args: argparse.Namespace) -> int:
    from megatrain.config import load_config
    from megatrain.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    first, last = summary.losses[:1], summary.losses[-1:]
    print(
        f"done: {summary.steps} steps"
        + (f", loss {first[0]:.4f} -> {last[0]:.4f}" if first else "")
        + (f", eval loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else "")
        + (f"; checkpoint {summary.checkpoint}" if summary.checkpoint else "")
        + (f"; Hugging Face model {summary.export_dir}" if summary.export_dir else "")
    )
    return 0


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="show processed samples and data statistics")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--show", type=int, default=3, help="samples to print")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    p.set_defaults(func=_run_data, takes_overrides=True)


def _run_data(args: argparse.Namespace) -> int:
    from megatrain.config import load_config
    from megatrain.data import run_data_command
    from megatrain.trainer import load_tokenizer

    cfg = load_config(args.config, args.overrides)
    mbs = cfg.training.micro_batch_size
    return run_data_command(
        cfg.data,
        load_tokenizer(cfg),
        show=args.show,
        as_json=args.json,
        seq_len=cfg.training.seq_len or cfg.data.cutoff_len,
        micro_batch_size=mbs if isinstance(mbs, int) else 1,
        out=sys.stdout,
    )


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder")
    p.add_argument("--checkpoint", required=True, help="a checkpoints/step-N directory")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="export into a non-empty folder that is not a previous export (keeps its files)",
    )
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatrain.checkpoint import export_hf, load_checkpoint
    from megatrain.config import load_config
    from megatrain.model.loading import load_causal_lm
    from megatrain.model.structure import discover
    from megatrain.store.host import HostStore
    from megatrain.trainer import load_tokenizer

    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.yaml").is_file():
        raise FileNotFoundError(f"{ckpt} has no config.yaml; give a checkpoints/step-N folder")
    cfg = load_config(ckpt / "config.yaml")
    m = cfg.model
    model = load_causal_lm(
        m.name_or_path,
        model_type=m.model_type,
        tiny=m.tiny,
        random_init=True,
        trust_remote_code=m.trust_remote_code,
        config_overrides=dict(m.config_overrides) or None,
    )
    store = HostStore(discover(model), compute_dtype=torch.float32)
    load_checkpoint(ckpt, store)
    out = export_hf(
        store, args.out, dtype=args.dtype, tokenizer=load_tokenizer(cfg), overwrite=args.overwrite
    )
    print(f"exported {ckpt} to {out}")
    return 0


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    from megatrain.estimate_cmd import add_estimate_arguments, run_estimate

    p = sub.add_parser("estimate", help="host RAM, GPU peak and step time, before a run")
    add_estimate_arguments(p)
    p.set_defaults(func=run_estimate)


_REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_train,
    _add_verify,
    _add_estimate,
    _add_data,
    _add_export,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatrain", description="Full-precision training of large HF causal LMs on one GPU."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    debug = os.environ.get("MEGATRAIN_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args))
    except (ValueError, OSError) as e:  # OSError: its message names the file (disk full, ...)
        if debug:
            raise
        print(f"megatrain {args.command}: error: {e}", file=sys.stderr)
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, DiskFullError)):
            print("(MEGATRAIN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # the trainer's says where the last checkpoint is
        if debug:
            raise
        print(f"megatrain {args.command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
