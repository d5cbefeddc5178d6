"""Recipes: what a command runs, from config to finished run.

base.py     Recipe: the lifecycle every recipe shares (output folder, plan + fit, disk check,
            build, resume, save / export / close, Ctrl-C) and the hooks a recipe fills in
sft.py      Trainer(Recipe): supervised fine-tuning and pre-training (`megatrain train`)
grpo/       GRPOTrainer(Recipe) and its parts (`megatrain grpo`)
builder.py  RunBuilder: config -> tokenizer, data, model, store, engine, loader, metrics
oom.py      a step that ran out of GPU memory: undone, the plan stepped down, run again
step_down.py  the undo and the smaller plan, shared by oom.py and rank_failures.py (several
            ranks step down together)
records.py  the plan report and the per-step metrics record
"""
