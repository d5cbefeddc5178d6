"""`megatrain grpo --config FILE [--section.key VALUE ...]`: GRPO with verifiable rewards."""

from __future__ import annotations

import argparse
import os

from megatrain.config import load_config
from megatrain.config.sections import PLANNED_BATCH


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "grpo",
        help="reinforcement learning with verifiable rewards (GRPO) from a YAML config",
        description="The config's grpo: section sets rollouts, rewards and the objective "
        "(docs/grpo.md); any --section.key VALUE after the options overrides the config",
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
    r = summary.rewards
    head, tail = r[: min(10, len(r))], r[-min(10, len(r)) :]
    print(
        f"done: {summary.steps} steps"
        + (
            f", mean reward {sum(head) / len(head):.3f} (first {len(head)} steps) -> "
            f"{sum(tail) / len(tail):.3f} (last {len(tail)})"
            if r
            else ""
        )
        + (f"; checkpoint {summary.checkpoint}" if summary.checkpoint else "")
        + (f"; Hugging Face model {summary.export_dir}" if summary.export_dir else "")
    )
    return 0
