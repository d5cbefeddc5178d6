"""Entry of tests/distributed/test_distributed_grpo.py, under torchrun and alone:
`python grpo_groups.py ARGS` is `python -m megatrain ARGS` with two changes to `megatrain grpo`.

1. Each prompt group (GROUP consecutive rows of one prompt) is sampled by its own call of the
   real `generate` (recipes/grpo/rollout.py), seeded by the group's prompt tokens. Sampling one
   batch draws every row's token from one random stream and pads the prompts to the batch's
   longest, so which rows share a batch changes the completions; sampled a group at a time, a
   group's completions are the same whichever rank samples it, and two runs that split a batch
   differently can be compared after the rollout. Everything else is the production code.
2. After each generation batch, every rank writes what it trains on to
   ROWS_DIR/batch-<index>-rank<rank>.json: per sequence, its tokens (prompt + completion) and,
   on its completion tokens, the advantage, the loss weight and (grpo.beta > 0) the reference's
   log-prob of each.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

from megatrain.batch import IGNORE_INDEX
from megatrain.cli import main
from megatrain.recipes.grpo import recipe, rollout_phase
from megatrain.recipes.grpo.rollout import Rollout

GROUP = int(os.environ["GROUP"])
ROWS_DIR = Path(os.environ["ROWS_DIR"])
RANK = int(os.environ.get("RANK", "0"))
real_generate = rollout_phase.generate


def by_group(model: Any, prompts: list[list[int]], *, seed: int, **kwargs: Any) -> Rollout:
    completions, clipped, generated = [], [], 0
    for start in range(0, len(prompts), GROUP):
        group = prompts[start : start + GROUP]
        assert all(p == group[0] for p in group), "a group is one prompt's rows"
        own_seed = zlib.crc32(json.dumps(group[0]).encode())
        out = real_generate(model, group, seed=own_seed, **kwargs)
        completions += out.completions
        clipped += out.clipped
        generated += out.generated_tokens
    return Rollout(completions, clipped, generated)


real_generation = recipe.GRPOTrainer._generation


def recorded(self: recipe.GRPOTrainer, index: int) -> Any:
    gen = real_generation(self, index)
    rows = []
    for batch, inputs in zip(gen.batches, gen.inputs, strict=True):
        for r in range(batch.input_ids.shape[0]):
            ids = batch.input_ids[r][batch.attention_mask[r] == 1]
            mine = batch.labels[r] != IGNORE_INDEX
            row = {"tokens": ids.tolist()}
            for name in ("advantages", "weights", "ref_logps"):
                if name in inputs:
                    row[name] = inputs[name][r][mine].tolist()
            rows.append(row)
    (ROWS_DIR / f"batch-{index}-rank{RANK}.json").write_text(json.dumps(rows))
    return gen


rollout_phase.generate = by_group  # type: ignore[assignment]
recipe.GRPOTrainer._generation = recorded  # type: ignore[method-assign]
sys.exit(main(sys.argv[1:]))
