"""`megatrain grpo --config FILE [--section.key VALUE ...]`: GRPO with verifiable rewards.

Under torchrun (`torchrun --nproc-per-node N -m megatrain grpo ...`) the ranks share each
generation batch's prompts and train data-parallel (recipes/grpo/ranks.py, docs/grpo.md)."""

from __future__ import annotations

import argparse

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
