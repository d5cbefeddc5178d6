"""`megatrain dpo --config FILE [--section.key VALUE ...]`: preference training (DPO and its
variants, ORPO/SimPO without a reference, KTO) on data.stage dpo / kto (recipes/dpo/recipe.py).

data.stage defaults to dpo here (a TRL DPO file sets no stage); `--print-config` as for train."""

from __future__ import annotations

import argparse

from megatrain.commands.done_line import done_line
from megatrain.commands.train import add_print_config, print_config
from megatrain.config import load_config
from megatrain.config.dpo import check_preference_run
from megatrain.config.sections import PLANNED_BATCH


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dpo",
        help="preference training (DPO, IPO, ORPO, SimPO, KTO) from a YAML config",
        description="The config's dpo: section sets the loss (docs/preference.md); any "
        "--section.key VALUE after the options overrides the config (`megatrain config "
        "--list [SECTION]` lists the keys)",
    )
    p.add_argument("--config", help="YAML config file (see examples/dpo_demo.yaml)")
    add_print_config(p)
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    base = {"data": {"stage": "dpo"}, **PLANNED_BATCH}  # the plan picks the micro-batch
    cfg = load_config(args.config, args.overrides, base=base)  # config errors before torch loads
    if args.print_config:
        return print_config(cfg, args)
    check_preference_run(cfg.data.stage, cfg.training.micro_batch_size)
    from megatrain.recipes.dpo.recipe import DPOTrainer

    trainer = DPOTrainer(cfg)
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
            means={"rewards/accuracies": summary.accuracies},
            eval_loss=summary.eval_loss,
            checkpoint=summary.checkpoint,
            export_dir=summary.export_dir,
        )
    )
    return 0
