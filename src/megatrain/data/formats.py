"""Converters: one row of an alpaca, sharegpt or OpenAI data set to a canonical `Conversation`.

Canonical form, ready for a Hugging Face chat template: an optional system prompt, optional tool
schemas, and messages `{"role": "user" | "assistant" | "tool", "content": str}`. A function call
(sharegpt's `function_call` turn, or an OpenAI assistant message with `tool_calls`) is an
assistant message carrying `tool_calls` in the HF form `[{"type": "function", "function":
{"name", "arguments"}}]`; an observation is a `tool` message.

Invariants of a returned conversation: it opens with a user (or tool) turn; prompt turns
(user/tool) and assistant turns alternate, except that consecutive tool results are allowed; it
ends with an assistant turn; every content is non-empty (an assistant turn with tool calls may
have empty content). A row that breaks any of this is not repaired: the converter returns the
drop reason (one of DROP_REASONS), which the pipeline counts.

Alpaca follows LLaMA-Factory: the user turn is `instruction + "\n" + input` (either may be
empty), `history` pairs [user, assistant] become earlier turns (and are supervised too).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from megatrain.data.registry import DatasetSpec

MISSING_COLUMN = "missing_column"
MALFORMED_ROW = "malformed_row"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONVERSATION = "empty_conversation"
BAD_ROLE_ORDER = "bad_role_order"
LAST_TURN_NOT_ASSISTANT = "last_turn_not_assistant"
EMPTY_CONTENT = "empty_content"
# Assistant-message keys holding reasoning, passed through to the chat template as they are.
REASONING_KEYS = ("reasoning_content", "thinking")
DROP_REASONS = (
    MISSING_COLUMN,
    MALFORMED_ROW,
    UNKNOWN_ROLE,
    EMPTY_CONVERSATION,
    BAD_ROLE_ORDER,
    LAST_TURN_NOT_ASSISTANT,
    EMPTY_CONTENT,
)
PROMPT_ROLES = ("user", "tool")


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    system: str | None = None
    tools: list[Any] | None = None
    # the row's `images` column as written (paths, unresolved); the pipeline resolves and checks
    # them (data/vision.py), then holds absolute paths here
    images: list[Any] = field(default_factory=list)


class _Drop(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def convert_row(row: dict[str, Any], spec: DatasetSpec) -> Conversation | str:
    """The row as a Conversation, or the reason it is dropped."""
    try:
        conv = _alpaca(row, spec) if spec.formatting == "alpaca" else _sharegpt(row, spec)
        _check_turns(conv.messages)
        conv.images = _json_list(row, spec.images) if spec.images else []
    except _Drop as drop:
        return drop.reason
    return conv


def _alpaca(row: dict[str, Any], spec: DatasetSpec) -> Conversation:
    messages: list[dict[str, Any]] = []
    for pair in _json_list(row, spec.history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise _Drop(MALFORMED_ROW)
        messages += [_text("user", pair[0]), _text("assistant", pair[1])]
    if spec.prompt not in row or spec.response not in row:
        raise _Drop(MISSING_COLUMN)
    parts = [row.get(spec.prompt), row.get(spec.query) if spec.query else None]
    if not all(p is None or isinstance(p, str) for p in parts):
        raise _Drop(MALFORMED_ROW)
    messages.append(_text("user", "\n".join(p for p in parts if p)))
    messages.append(_text("assistant", row[spec.response]))
    return Conversation(messages, _system(row, spec.system), _tools(row, spec.tools))


def _sharegpt(row: dict[str, Any], spec: DatasetSpec) -> Conversation:
    if spec.messages not in row:
        raise _Drop(MISSING_COLUMN)
    turns = _json_list(row, spec.messages)
    if not all(isinstance(t, dict) and spec.role_tag in t for t in turns):
        raise _Drop(MALFORMED_ROW)
    system = _system(row, spec.system)
    if turns and turns[0][spec.role_tag] == spec.system_tag:
        system = _system(turns[0], spec.content_tag)  # overrides the system column
        turns = turns[1:]
    roles = {
        spec.user_tag: "user",
        spec.assistant_tag: "assistant",
        spec.observation_tag: "tool",
        spec.function_tag: "function_call",
    }
    messages = []
    for turn in turns:
        role = roles.get(turn[spec.role_tag])
        if role is None:
            is_system = turn[spec.role_tag] == spec.system_tag
            raise _Drop(BAD_ROLE_ORDER if is_system else UNKNOWN_ROLE)
        if role == "assistant" and turn.get("tool_calls"):
            messages.append(_openai_tool_calls(turn, spec.content_tag))
        elif role == "function_call":
            messages.append(_function_call(turn.get(spec.content_tag)))
        else:
            message = _text(role, turn.get(spec.content_tag))
            if role == "assistant":  # reasoning the chat template renders (Qwen3, gpt-oss)
                message.update({k: turn[k] for k in REASONING_KEYS if isinstance(turn.get(k), str)})
            messages.append(message)
    return Conversation(messages, system, _tools(row, spec.tools))


def _text(role: str, content: Any) -> dict[str, Any]:
    if not isinstance(content, str):
        raise _Drop(MISSING_COLUMN if content is None else MALFORMED_ROW)
    if not content.strip():
        raise _Drop(EMPTY_CONTENT)
    return {"role": role, "content": content}


def _function_call(content: Any) -> dict[str, Any]:
    """LLaMA-Factory's function turn: JSON of one call {name, arguments} or a list of them."""
    try:
        calls = json.loads(content) if isinstance(content, str) else None
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if not (isinstance(calls, list) and calls and all(_is_call(c) for c in calls)):
        raise _Drop(MALFORMED_ROW)
    return {"role": "assistant", "content": "", "tool_calls": [_hf_call(c) for c in calls]}


def _openai_tool_calls(turn: dict[str, Any], content_tag: str) -> dict[str, Any]:
    calls = turn["tool_calls"]
    content = turn.get(content_tag) or ""
    if not (isinstance(calls, list) and isinstance(content, str)):
        raise _Drop(MALFORMED_ROW)
    functions = [
        c["function"] for c in calls if isinstance(c, dict) and _is_call(c.get("function"))
    ]
    if len(functions) != len(calls):
        raise _Drop(MALFORMED_ROW)
    return {"role": "assistant", "content": content, "tool_calls": [_hf_call(f) for f in functions]}


def _is_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str)


def _hf_call(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI sends arguments as JSON text; templates want objects
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise _Drop(MALFORMED_ROW) from err
    return {"type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _json_list(row: dict[str, Any], column: str | None) -> list[Any]:
    """A list-valued column; JSON text is parsed (csv stores lists as text); absent/None -> []."""
    value = row.get(column) if column else None
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise _Drop(MALFORMED_ROW) from err
    if not isinstance(value, (list, tuple)):
        raise _Drop(MALFORMED_ROW)
    return list(value)


def _system(row: dict[str, Any], column: str | None) -> str | None:
    value = row.get(column) if column else None
    if value is not None and not isinstance(value, str):
        raise _Drop(MALFORMED_ROW)
    return value or None


def _tools(row: dict[str, Any], column: str | None) -> list[Any] | None:
    tools = _json_list(row, column)
    return tools or None


def _check_turns(messages: list[dict[str, Any]]) -> None:
    if not messages:
        raise _Drop(EMPTY_CONVERSATION)
    if messages[0]["role"] not in PROMPT_ROLES:
        raise _Drop(BAD_ROLE_ORDER)
    for prev, cur in itertools.pairwise(messages):
        same_side = (prev["role"] in PROMPT_ROLES) == (cur["role"] in PROMPT_ROLES)
        if same_side and not (prev["role"] == cur["role"] == "tool"):
            raise _Drop(BAD_ROLE_ORDER)
    if messages[-1]["role"] != "assistant":
        raise _Drop(LAST_TURN_NOT_ASSISTANT)
