"""Preference rows (data.stage dpo / kto): conversion, rendering and truncation of one row.

A DPO row (registry `ranking: true`) is a prompt and two completions: alpaca's prompt columns
(instruction, input, history, system) with `chosen`/`rejected` text columns, or sharegpt/openai
prompt turns (`messages`, ending on a user or tool turn) with `chosen`/`rejected` each one
assistant turn (an object in the row's tags, or plain text). A KTO row is an SFT row (its last
assistant turn is the completion) with a boolean `kto_tag`: true for a desirable completion.
Each completion is converted as the SFT row prompt + completion would be (formats.py), so every
SFT check and drop reason applies unchanged.

Rendering: prompt = render(system + prompt turns, add_generation_prompt=True), full =
render(system + prompt turns + completion); the completion's tokens are tokens(full) after
tokens(prompt), supervised; earlier assistant turns of a multi-turn prompt are context only, as
TRL and LLaMA-Factory train them. Truncation as TRL/LLaMA-Factory: the prompt is kept whole and
each completion cut to `cutoff_len - len(prompt)` tokens (overflow: drop drops the row instead);
a row whose completions keep fewer than max(1, min_target_tokens) tokens is dropped as
"over_cutoff_len". Every drop is one reason of formats.DROP_REASONS or template.py, counted.

Invariant: both rows of a pair start with the same prompt tokens, and each row's supervised
tokens are exactly its completion's (`Sample.target_mask`), so a sequence's log-prob is the sum
over its supervised tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np

from megatrain.data.formats import (
    MALFORMED_ROW,
    MISSING_COLUMN,
    Conversation,
    _Drop,
    _json_list,
    convert_row,
)
from megatrain.data.registry import DatasetSpec
from megatrain.data.sample import Sample
from megatrain.data.template import (
    OVER_CUTOFF,
    PROMPT_NOT_PREFIX,
    TEMPLATE_ERROR,
    TOKEN_MERGE,
    TOO_FEW_TARGETS,
    ChatEncoder,
)

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


@dataclass(frozen=True, eq=False)
class PairSample:
    """One preference pair: both rows hold the same prompt tokens, then their completion."""

    chosen: Sample
    rejected: Sample

    @property
    def samples(self) -> list[Sample]:
        return [self.chosen, self.rejected]


@dataclass(frozen=True, eq=False)
class KTOSample:
    """One KTO row: prompt + completion, and whether the completion is desirable."""

    sample: Sample
    desirable: bool

    @property
    def samples(self) -> list[Sample]:
        return [self.sample]


def convert_pair(row: dict[str, Any], spec: DatasetSpec) -> tuple[Conversation, Conversation] | str:
    """(prompt + chosen, prompt + rejected) as conversations, or the reason the row is dropped."""
    assert spec.ranking and spec.chosen and spec.rejected
    convs = []
    for column in (spec.chosen, spec.rejected):
        if column not in row:
            return MISSING_COLUMN
        conv = convert_row(_with_completion(row, spec, row[column]), spec)
        if isinstance(conv, str):
            return conv
        convs.append(conv)
    return convs[0], convs[1]


def _with_completion(row: dict[str, Any], spec: DatasetSpec, completion: Any) -> dict[str, Any]:
    """The SFT row the prompt of `row` followed by `completion` would be."""
    if spec.formatting == "alpaca":
        assert spec.response is not None
        return {**row, spec.response: completion}
    assert spec.messages is not None
    try:
        turns = _json_list(row, spec.messages)
    except _Drop as drop:
        return {spec.messages: drop.reason}  # malformed: convert_row drops it as such
    if isinstance(completion, str):
        completion = {spec.role_tag: spec.assistant_tag, spec.content_tag: completion}
    return {**row, spec.messages: [*turns, completion]}


def convert_kto(row: dict[str, Any], spec: DatasetSpec) -> tuple[Conversation, bool] | str:
    """(prompt + completion, desirable) or the reason the row is dropped."""
    assert spec.kto_tag is not None
    if spec.kto_tag not in row:
        return MISSING_COLUMN
    label = row[spec.kto_tag]
    if isinstance(label, str) and label.strip().lower() in (*_TRUE, *_FALSE):
        label = label.strip().lower() in _TRUE  # csv stores booleans as text
    if not isinstance(label, bool):
        return MALFORMED_ROW
    conv = convert_row(row, spec)
    return conv if isinstance(conv, str) else (conv, label)


def encode_completions(encoder: ChatEncoder, convs: list[Conversation]) -> list[Sample] | str:
    """One row per conversation (all share the prompt: every turn but the last), truncated as
    the module docstring says; or the reason they are dropped together."""
    prompt_messages = encoder.messages(convs[0])[:-1]
    try:
        texts = [encoder.render(prompt_messages, convs[0].tools, True)]
        texts += [encoder.render(encoder.messages(c), c.tools, False) for c in convs]
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat template syntax error, line {err.lineno}: {err}") from err
    except jinja2.TemplateError:
        return TEMPLATE_ERROR
    if not all(full.startswith(texts[0]) for full in texts[1:]):
        return PROMPT_NOT_PREFIX
    ids = encoder.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    prompt = ids[0]
    if any(full[: len(prompt)] != prompt for full in ids[1:]):
        return TOKEN_MERGE
    completions = [full[len(prompt) :] for full in ids[1:]]
    budget = encoder.cutoff_len - len(prompt)
    over = any(len(c) > budget for c in completions)
    needed = max(1, encoder.min_target_tokens)
    if min(len(c) for c in completions) < needed:
        return TOO_FEW_TARGETS
    if over and (encoder.overflow == "drop" or budget < needed):
        encoder.note_over_cutoff(len(prompt) + max(len(c) for c in completions))
        return OVER_CUTOFF
    rows = []
    for c in completions:
        kept = c[: max(budget, 0)]
        mask = np.zeros(len(prompt) + len(kept), dtype=np.bool_)
        mask[len(prompt) :] = True
        row_ids = np.asarray(prompt + kept, dtype=np.int32)
        rows.append(Sample(row_ids, mask, truncated=len(kept) < len(c)))
    return rows


def encode_pair(encoder: ChatEncoder, pair: tuple[Conversation, Conversation]) -> PairSample | str:
    rows = encode_completions(encoder, list(pair))
    return rows if isinstance(rows, str) else PairSample(rows[0], rows[1])


def encode_kto(encoder: ChatEncoder, row: tuple[Conversation, bool]) -> KTOSample | str:
    conv, desirable = row
    rows = encode_completions(encoder, [conv])
    return rows if isinstance(rows, str) else KTOSample(rows[0], desirable)


def check_stage(spec: DatasetSpec, stage: str) -> None:
    """ValueError naming the data set when its rows do not fit `data.stage`."""
    kind = "preference pairs (ranking: true)" if spec.ranking else None
    kind = kind or ("KTO rows (columns.kto_tag)" if spec.kto_tag else "conversations")
    wanted = {"dpo": spec.ranking, "kto": spec.kto_tag is not None}.get(
        stage, not spec.ranking and spec.kto_tag is None
    )
    if not wanted:
        fit = "dpo" if spec.ranking else "kto" if spec.kto_tag else "sft"
        raise ValueError(
            f"data set {spec.name!r} holds {kind}, which data.stage: {stage} does not train on; "
            f"set data.stage: {fit}, or register the data set for {stage} (dpo: ranking: true "
            "with columns chosen and rejected; kto: a kto_tag column)"
        )
