"""`megatrain train --config FILE [--section.key VALUE ...]`: SFT (`data.stage: sft`) or
continued pre-training on raw text (`data.stage: pt`) from a YAML config (recipes/sft.py)."""

from __future__ import annotations

import argparse

from megatrain.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from a YAML config",
        description="Any --section.key VALUE after the options overrides the "
        "config, e.g. --optimizer.learning_rate 2e-5 (docs/configuration.md lists every key)",
    )
    p.add_argument("--config", help="YAML config file (see examples/)")
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # config errors before torch loads
    from megatrain.recipes.sft import Trainer

    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    losses = summary.losses  # of this process's steps: after a resume, those after the checkpoint
    resumed_at = summary.steps - len(losses)  # 0 for a fresh run
    loss = ""
    if losses:
        where = f" at step {resumed_at + 1}" if resumed_at else ""
        loss = f", loss {losses[0]:.4f}{where} -> {losses[-1]:.4f}"
    print(
        f"done: {summary.steps} steps"
        + (f" (resumed at step {resumed_at})" if resumed_at else "")
        + loss
        + (f", eval loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else "")
        + (f"; checkpoint {summary.checkpoint}" if summary.checkpoint else "")
        + (f"; Hugging Face model {summary.export_dir}" if summary.export_dir else "")
    )
    return 0
