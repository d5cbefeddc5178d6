"""`megatrain grpo --config FILE [--section.key VALUE ...]`: GRPO with verifiable rewards."""

from __future__ import annotations

import argparse
import os

from megatrain.commands.done_line import done_line
from megatrain.config import load_config
from megatrain.config.sections import PLANNED_BATCH


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "grpo",
        help="reinforcement learning with verifiable rewards (GRPO) from a YAML config",
        description="The config's grpo: section sets rollouts, rewards and the objective "
        "(docs/grpo.md); any --section.key VALUE after the options overrides the config "
        "(`megatrain config --list [SECTION]` lists the keys)",
    )
    p.add_argument("--config", help="YAML config file (see examples/grpo_demo.yaml)")
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(
            f"megatrain grpo was started as {world} processes (torchrun, WORLD_SIZE={world}); "
            "GRPO runs in one process on one GPU for now: start it without torchrun, "
            "`megatrain grpo --config FILE`"
        )

    # config errors before torch loads; the plan picks the micro-batch unless the file does
    cfg = load_config(args.config, args.overrides, base=PLANNED_BATCH)
    from megatrain.recipes.grpo.recipe import GRPOTrainer

    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    resumed_at = summary.steps - len(summary.rewards)  # a reward per step of this process
    print(
        done_line(
            summary.steps,
            resumed_at,
            means={"mean reward": summary.rewards},
            checkpoint=summary.checkpoint,
            export_dir=summary.export_dir,
        )
    )
    return 0
