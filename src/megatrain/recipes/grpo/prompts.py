"""Prompt data for GRPO: the data registry's rows -> chat prompts, token ids and extra columns.

Data sets are named as for `train` (`data.dataset`, `data.dataset_dir`: dataset_info.json entries
or paths) and read through the same registry and readers. A row becomes a prompt in one of two
ways:
- TRL's prompt format: a `prompt` column, a string (one user turn) or a list of
  {role, content} messages; every other column is an extra column.
- a conversation of the registry's formats (alpaca, sharegpt, OpenAI): its messages, without
  the final assistant turn, whose text becomes the extra column `answer` (unless the row has
  its own `answer`); the row's other unmapped columns are extra columns too.
The messages (the system prompt first: the row's, else data.system_prompt) are rendered with
the chat template and its generation prompt; the ids keep the last `max_prompt_length` tokens,
as TRL truncates prompts on the left. Extra columns reach the reward functions by name.

Invariant: every row read is a prompt or counted under one drop reason; no prompt left is an
error naming the data sets.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.data.formats import convert_row
from megatrain.data.pipeline import read_dataset
from megatrain.data.readers import read_rows
from megatrain.data.registry import DatasetSpec, load_registry, resolve_datasets, spec_from_entry
from megatrain.data.template import resolve_chat_template

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    prompt: str | list[dict[str, Any]]  # as the reward functions get it (TRL's `prompts`)
    prompt_ids: list[int]  # rendered with the generation prompt, left-truncated
    extras: dict[str, Any]  # extra columns, by name

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def load_prompts(
    names: list[str],
    dataset_dir: Path,
    tokenizer: Any,
    *,
    chat_template: str | None,
    system_prompt: str | None,
    max_prompt_length: int | None,
    max_samples: int | None,
    seed: int,
) -> list[Prompt]:
    """The prompts of data sets `names`, in order (see the module docstring)."""
    template = resolve_chat_template(tokenizer, chat_template)
    registry = load_registry(dataset_dir)
    prompts: list[Prompt] = []
    for name in names:
        spec, rows = _read(name, registry, dataset_dir, seed)
        dropped: Counter[str] = Counter()
        for row in rows[:max_samples]:
            item = _convert(row, spec)
            if isinstance(item, str):
                dropped[item] += 1
                continue
            shown, messages, tools, extras = item
            if system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system_prompt}, *messages]
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=False,
            )
            # grpo.max_prompt_length cuts the prompt below: transformers' "Token indices
            # sequence length is longer than ..." warning applies only without it
            verbose = max_prompt_length is None
            ids = tokenizer(text, add_special_tokens=False, verbose=verbose)["input_ids"]
            if max_prompt_length is not None:
                ids = ids[-max_prompt_length:]
            prompts.append(Prompt(shown, list(ids), extras))
        if dropped:
            logger.warning("data set %s: dropped rows %s", name, dict(dropped))
    if not prompts:
        raise ValueError(
            f"no prompt in data.dataset={names}: every row was dropped or the data is empty; a "
            "row needs a `prompt` column (text or messages) or a conversation in one of the "
            "registry's formats (see docs/grpo.md)"
        )
    return prompts


def _read(
    name: str, registry: dict[str, Any] | None, dataset_dir: Path, seed: int
) -> tuple[DatasetSpec | None, list[dict[str, Any]]]:
    """(the registry's spec, or None for a file in TRL's prompt format; the rows)."""
    if registry is not None and name in registry:
        spec = spec_from_entry(name, registry[name], dataset_dir)
        return spec, read_dataset(spec, seed=seed)
    for candidate in (Path(name).expanduser(), dataset_dir / name):
        if candidate.exists():
            rows = read_rows(candidate)
            if rows and "prompt" in rows[0]:
                return None, rows
            break
    (spec,) = resolve_datasets([name], dataset_dir)  # raises the registry's error if unknown
    return spec, read_dataset(spec, seed=seed)


def _convert(
    row: dict[str, Any], spec: DatasetSpec | None
) -> tuple[Any, list[dict[str, Any]], Any, dict[str, Any]] | str:
    """(prompt as shown to rewards, messages to render, tools, extras), or a drop reason."""
    if spec is None or (
        "prompt" in row and spec.formatting == "alpaca" and spec.response not in row
    ):
        prompt = row.get("prompt")
        extras = {k: v for k, v in row.items() if k != "prompt"}
        if isinstance(prompt, str) and prompt:
            return prompt, [{"role": "user", "content": prompt}], None, extras
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return prompt, list(prompt), None, extras
        return "malformed_prompt"
    conv = convert_row(row, spec)
    if isinstance(conv, str):
        return conv
    *messages, last = conv.messages
    if not messages:
        return "no_prompt_turn"
    used = {spec.prompt, spec.query, spec.response, spec.history, spec.messages}
    used |= {spec.system, spec.tools}
    extras = {k: v for k, v in row.items() if k not in used}
    extras.setdefault("answer", last.get("content") or "")
    head = [{"role": "system", "content": conv.system}] if conv.system else []
    return head + messages, head + messages, conv.tools, extras
