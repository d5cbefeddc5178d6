"""The `megatrain` command: thin argument parsing over the package's entry points.

    megatrain train    --config FILE [--section.key value ...]
    megatrain verify   [MODEL | --model-type NAME --tiny] [--dtype bf16] [--device cuda]
    megatrain estimate --config FILE | --model MODEL --seq-len N --tokens-per-step N
    megatrain data     --config FILE --show N [--json]
    megatrain export   --checkpoint DIR --out DIR

Errors a user can fix (bad path, bad key, unsupported model) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch


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
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. output_router_logits=true")
    p.add_argument("--json", action="store_true", help="print the per-step report as JSON")
    p.set_defaults(func=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from megatrain.verify import TOLERANCES, VerifyConfig, format_report, run_verify, within

    if (args.model is None) == (args.model_type is None):
        raise ValueError("verify needs a MODEL (hub id or directory) or --model-type NAME")
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    cfg = VerifyConfig(
        source=args.model, model_type=args.model_type, tiny=args.tiny, steps=args.steps,
        grad_accum=args.grad_accum, batch_size=args.batch_size, seq_len=args.seq_len,
        packed=args.packed, compute_dtype=dtype, device=resolve_device(args.device),
        lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        num_slots=args.num_slots, seed=args.seed, config_overrides=_parse_sets(args.set),
    )
    reports = run_verify(cfg)
    ok = within(reports)
    if args.json:
        print(json.dumps({"ok": ok, "steps": [r.__dict__ for r in reports]}))
    else:
        name = args.model or f"{args.model_type}{' (tiny)' if args.tiny else ''}"
        print(f"verify {name}: {args.dtype} compute on {cfg.device}, {cfg.steps} steps, "
              f"{cfg.grad_accum} micro-batches of {cfg.batch_size}x{cfg.seq_len} "
              f"({'packed' if cfg.packed else 'padded'})")
        print(format_report(reports, TOLERANCES[dtype]))
        print("PASS" if ok else "FAIL: the engine differs from PyTorch beyond tolerance")
    return 0 if ok else 1


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here; "
                         "use --device cpu")
    return name


def _parse_sets(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


_REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = [_add_verify]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatrain",
        description="Full-precision training of large HF causal LMs on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in _REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"megatrain {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
