"""The config a GRPO run trains with: one generation batch as one optimizer step.

`training_config` is shared by `megatrain grpo` and `megatrain estimate --grpo` (through
recipes/grpo/plan.py), so that the engine runs the plan that was reported.
"""

from __future__ import annotations

import dataclasses

from megatrain.config import TrainConfig
from megatrain.recipes.grpo.ranks import check_world


def training_config(cfg: TrainConfig, world_size: int = 1) -> TrainConfig:
    """The config a GRPO run trains with, shared by `megatrain grpo` and `megatrain estimate
    --grpo` so that the engine runs the plan that was reported: the generation batch's
    micro-batches (each rank's share of them under `world_size` ranks, recipes/grpo/ranks.py;
    a rank count that does not divide prompts_per_step is refused) are its gradient
    accumulation, its rows max_prompt_length +
    max_completion_length tokens at most (rounded up to data.pad_to_multiple_of; as
    training.seq_len says when max_prompt_length is None) are training.seq_len, and
    compile_layers "auto" is eager (rows of every length).

    training.micro_batch_size "auto" (the default of `megatrain grpo`): the generation batch's
    rows are training.global_batch_size, so the plan picks the micro-batch among the divisors
    of the batch's sequences (planning/batch_size.py: the largest whose predicted GPU peak
    fits) and the accumulation follows; the log-prob passes run the same micro-batches."""
    t, g = cfg.training, cfg.grpo
    check_world(g.prompts_per_step, world_size)
    sequences = g.prompts_per_step * g.num_generations
    if t.micro_batch_size == "auto":
        _check_auto_batch(t.gradient_accumulation_steps, t.global_batch_size, sequences)
        training = dataclasses.replace(
            t, gradient_accumulation_steps=1, global_batch_size=sequences
        )
    else:
        assert isinstance(t.micro_batch_size, int)
        accumulation = -(-sequences // world_size // t.micro_batch_size)  # each rank's
        if t.gradient_accumulation_steps not in (1, accumulation):
            raise ValueError(
                f"training.gradient_accumulation_steps={t.gradient_accumulation_steps}: "
                f"megatrain grpo trains each generation batch (grpo.prompts_per_step x "
                f"grpo.num_generations = {sequences} sequences) as one optimizer step in "
                f"micro-batches of training.micro_batch_size={t.micro_batch_size} rows, "
                f"{accumulation} of them"
                + (f" on each of the {world_size} ranks" if world_size > 1 else "")
                + "; remove the key (or set it to that count)"
            )
        training = dataclasses.replace(t, gradient_accumulation_steps=accumulation)
    seq_len = cfg.seq_len
    if g.max_prompt_length is not None:
        multiple = max(cfg.data.pad_to_multiple_of, 1)
        seq_len = -(-(g.max_prompt_length + g.max_completion_length) // multiple) * multiple
    compile_layers = False if t.compile_layers == "auto" else t.compile_layers
    training = dataclasses.replace(training, seq_len=seq_len, compile_layers=compile_layers)
    data = dataclasses.replace(cfg.data, cutoff_len=min(cfg.data.cutoff_len, seq_len))
    return dataclasses.replace(cfg, training=training, data=data)


def _check_auto_batch(accumulation: int, global_batch: int | None, sequences: int) -> None:
    """Refuse batch keys that contradict a generation batch of `sequences` rows per step."""
    if accumulation != 1:
        raise ValueError(
            f"training.gradient_accumulation_steps={accumulation} with micro_batch_size: auto: "
            f"megatrain grpo trains each generation batch (grpo.prompts_per_step x "
            f"grpo.num_generations = {sequences} sequences) as one optimizer step and the plan "
            "picks its micro-batches; remove the key (or set training.micro_batch_size)"
        )
    if global_batch not in (None, sequences):
        raise ValueError(
            f"training.global_batch_size={global_batch}: megatrain grpo trains grpo."
            f"prompts_per_step x grpo.num_generations = {sequences} rows per optimizer step; "
            "remove the key (or change those two)"
        )
