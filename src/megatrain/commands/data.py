"""`megatrain data --config FILE [--show N] [--json] [--section.key VALUE ...]`: processed rows
and data statistics."""

from __future__ import annotations

import argparse
import sys

from megatrain.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="show processed rows and data statistics")
    p.add_argument("--config", help="YAML config file")
    p.add_argument(
        "--show", type=int, default=3, help="rows to print (>= 0; packed rows hold several samples)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # config errors before torch loads
    from megatrain.data import run_data_command
    from megatrain.model.tokenizer import processor_source
    from megatrain.recipes.builder import RunBuilder

    builder = RunBuilder(cfg)
    mbs = cfg.training.micro_batch_size
    return run_data_command(
        cfg.data,
        builder.tokenizer(),
        show=args.show,
        as_json=args.json,
        seq_len=cfg.seq_len,
        micro_batch_size=mbs if isinstance(mbs, int) else 1,
        out=sys.stdout,
        processor=processor_source(cfg.model.tokenizer, cfg.model.name_or_path),
    )
