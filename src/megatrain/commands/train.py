"""`megatrain train --config FILE [--section.key VALUE ...] [--print-config]`: SFT (`data.stage:
sft`) or continued pre-training on raw text (`data.stage: pt`) from a YAML config (recipes/sft.py).

FILE may be a LLaMA-Factory / TRL training file (config/llamafactory.py); `--print-config` prints
the MegaTrain config it reads (non-default keys) and exits. Preference data (stage dpo, kto) is
refused before anything loads, naming `megatrain dpo`: each command runs one kind of training."""

from __future__ import annotations

import argparse

from megatrain.commands.done_line import done_line
from megatrain.config import TrainConfig, config_yaml, load_config
from megatrain.data.config import PREFERENCE_STAGES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from a YAML config",
        description="Any --section.key VALUE after the options overrides the "
        "config, e.g. --optimizer.learning_rate 2e-5; `megatrain config --list [SECTION]` "
        "lists every key with its type, default and meaning",
    )
    p.add_argument("--config", help="YAML config file (see examples/), or LLaMA-Factory's / TRL's")
    add_print_config(p)
    p.set_defaults(run=run, takes_overrides=True)


def add_print_config(p: argparse.ArgumentParser) -> None:
    """The `--print-config` flag of the commands that train from a config."""
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the MegaTrain config the file and overrides give (its keys that differ from "
        "the defaults, as YAML sections: a LLaMA-Factory / TRL file converted) and exit",
    )


def print_config(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """`--print-config`: the MegaTrain YAML of the run, headed by how to run it."""
    print(
        f"# The MegaTrain config of {args.config} (keys at their defaults left out):\n"
        f"#   megatrain {args.command} --config <this file>\n"
        + config_yaml(cfg, changed_only=True),
        end="",
    )
    return 0


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # config errors before torch loads
    if args.print_config:
        return print_config(cfg, args)
    if cfg.data.stage in PREFERENCE_STAGES:
        raise ValueError(
            f"data.stage={cfg.data.stage!r} is preference training, which runs with megatrain dpo "
            f"(same config and overrides): megatrain dpo --config {args.config}"
        )
    from megatrain.recipes.sft import Trainer

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
