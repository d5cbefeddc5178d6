"""`megatrain dpo --config FILE [--section.key VALUE ...]`: preference training (DPO and its
variants, ORPO/SimPO without a reference, KTO) on data.stage dpo / kto (recipes/dpo/recipe.py).

data.stage defaults to dpo here (a TRL DPO file sets no stage); `--print-config` as for train."""

from __future__ import annotations

import argparse

from megatrain.commands.train import add_print_config, print_config
from megatrain.config import load_config
from megatrain.config.dpo import check_preference_run
from megatrain.config.sections import PLANNED_BATCH


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dpo",
        help="preference training (DPO, IPO, ORPO, SimPO, KTO) from a YAML config",
        description="The config's dpo: section sets the loss (docs/preference.md); any "
        "--section.key VALUE after the options overrides the config",
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
    losses, acc = summary.losses, summary.accuracies
    resumed_at = summary.steps - len(losses)  # 0 for a fresh run
    line = f"done: {summary.steps} steps" + (
        f" (resumed at step {resumed_at})" if resumed_at else ""
    )
    if losses:
        line += f", loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    if acc:
        head, tail = acc[: min(10, len(acc))], acc[-min(10, len(acc)) :]
        line += (
            f", rewards/accuracies {sum(head) / len(head):.3f} (first {len(head)} steps) -> "
            f"{sum(tail) / len(tail):.3f} (last {len(tail)})"
        )
    if summary.eval_loss is not None:
        line += f", eval loss {summary.eval_loss:.4f}"
    print(
        line
        + (f"; checkpoint {summary.checkpoint}" if summary.checkpoint else "")
        + (f"; Hugging Face model {summary.export_dir}" if summary.export_dir else "")
    )
    return 0
