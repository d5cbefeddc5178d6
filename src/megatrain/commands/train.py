"""`megatrain train --config FILE [--section.key VALUE ...]`: SFT (`data.stage: sft`) or
continued pre-training on raw text (`data.stage: pt`) from a YAML config (recipes/sft.py)."""

from __future__ import annotations

import argparse

from megatrain.commands.done_line import done_line
from megatrain.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from a YAML config",
        description="Any --section.key VALUE after the options overrides the "
        "config, e.g. --optimizer.learning_rate 2e-5; `megatrain config --list [SECTION]` "
        "lists every key with its type, default and meaning",
    )
    p.add_argument("--config", help="YAML config file (see examples/)")
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # config errors before torch loads
    from megatrain.recipes.sft import Trainer
    from megatrain.threads import use_compute_threads

    use_compute_threads(cfg.training.device)  # on the CPU: the cores not busy elsewhere
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    resumed_at = summary.steps - len(summary.losses)  # the losses are of this process's steps
    print(
        done_line(
            summary.steps,
            resumed_at,
            losses=summary.losses,
            eval_loss=summary.eval_loss,
            checkpoint=summary.checkpoint,
            export_dir=summary.export_dir,
        )
    )
    return 0
