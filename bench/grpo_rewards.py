"""A reward for benchmark GRPO runs (bench/cli_train.py --command grpo --random-reward): random,
so the advantages are not zero; the cost of a step does not depend on the reward."""

from __future__ import annotations

import random
from typing import Any


def random_reward(completions: list[Any], **_: Any) -> list[float]:
    return [random.random() for _ in completions]
