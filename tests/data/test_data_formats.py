"""Converters: alpaca, sharegpt (custom tags) and OpenAI rows to the canonical conversation, and
malformed rows dropped with a counted reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from data_fixtures.helpers import demo_tokenizer, write_rows
from megatrain.data import Conversation, DataConfig, DatasetSpec, convert_row, prepare_data
from megatrain.data.registry import OPENAI_DEFAULTS

ALPACA = DatasetSpec(name="a", load_from="file", path="-", history="history", system="system")
SHAREGPT = DatasetSpec(name="s", load_from="file", path="-", formatting="sharegpt", system="sys")
OPENAI = dataclasses.replace(SHAREGPT, formatting="openai", **OPENAI_DEFAULTS)


def _conv(row: dict[str, Any], spec: DatasetSpec) -> Conversation:
    conv = convert_row(row, spec)
    assert isinstance(conv, Conversation), conv
    return conv


def test_alpaca_joins_instruction_and_input_and_expands_history() -> None:
    row = {
        "instruction": "Sort the letters.",
        "input": "c a b",
        "output": "a b c",
        "system": "Be brief.",
        "history": [["Hi", "Hello!"], ["Count: a b", "2"]],
    }
    conv = _conv(row, ALPACA)
    assert conv.system == "Be brief."
    assert conv.messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count: a b"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Sort the letters.\nc a b"},
        {"role": "assistant", "content": "a b c"},
    ]
    no_input = _conv({"instruction": "Say hi.", "input": "", "output": "hi"}, ALPACA)
    assert no_input.messages[0] == {"role": "user", "content": "Say hi."}
    assert no_input.system is None


def test_sharegpt_custom_tags_system_turn_observation_and_function_call() -> None:
    spec = dataclasses.replace(
        SHAREGPT,
        messages="dialog",
        role_tag="speaker",
        content_tag="text",
        user_tag="me",
        assistant_tag="bot",
        observation_tag="obs",
        function_tag="call",
        system_tag="rules",
    )
    call = {"name": "weather", "arguments": {"city": "Oslo"}}
    row = {
        "sys": "column system, overridden",
        "dialog": [
            {"speaker": "rules", "text": "Use tools."},
            {"speaker": "me", "text": "Weather in Oslo?"},
            {"speaker": "call", "text": json.dumps(call)},
            {"speaker": "obs", "text": "12 C"},
            {"speaker": "bot", "text": "It is 12 C."},
        ],
    }
    conv = _conv(row, spec)
    assert conv.system == "Use tools."
    assert conv.messages == [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": "12 C"},
        {"role": "assistant", "content": "It is 12 C."},
    ]
    plain = {"sys": "From the column.", "dialog": row["dialog"][1:2] + row["dialog"][4:]}
    assert _conv(plain, spec).system == "From the column."


def test_openai_messages_with_tool_calls_and_consecutive_tool_results() -> None:
    row = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Add 2 and 3, then 4 and 5."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}},
                    {"type": "function", "function": {"name": "add", "arguments": '{"a": 4}'}},
                ],
            },
            {"role": "tool", "content": "5"},
            {"role": "tool", "content": "9"},
            {"role": "assistant", "content": "5 and 9."},
        ]
    }
    conv = _conv(row, OPENAI)
    assert conv.system == "S"
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "tool", "assistant"]
    assert conv.messages[1]["tool_calls"][1] == {
        "type": "function",
        "function": {"name": "add", "arguments": {"a": 4}},
    }


def test_tools_column_parsed_from_json_text() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    spec = dataclasses.replace(ALPACA, tools="tools")
    conv = _conv({"instruction": "i", "output": "o", "tools": json.dumps(tools)}, spec)
    assert conv.tools == tools


def _openai(*turns: tuple[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


@pytest.mark.parametrize(
    ("row", "spec", "reason"),
    [
        ({"input": "x", "output": "y"}, ALPACA, "missing_column"),
        ({"instruction": "x"}, ALPACA, "missing_column"),
        ({"instruction": "x", "output": None}, ALPACA, "missing_column"),
        ({"instruction": "", "input": "", "output": "y"}, ALPACA, "empty_content"),
        ({"instruction": "x", "output": "   "}, ALPACA, "empty_content"),
        ({"instruction": "x", "output": 3}, ALPACA, "malformed_row"),
        ({"instruction": "x", "output": "y", "history": [["only one"]]}, ALPACA, "malformed_row"),
        ({"instruction": "x", "output": "y", "system": ["s"]}, ALPACA, "malformed_row"),
        ({"conversation": []}, SHAREGPT, "missing_column"),
        ({"conversations": "not json"}, SHAREGPT, "malformed_row"),
        ({"conversations": [{"value": "no role"}]}, SHAREGPT, "malformed_row"),
        ({"conversations": []}, SHAREGPT, "empty_conversation"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, SHAREGPT, "unknown_role"),
        (_openai(("assistant", "a"), ("user", "u")), OPENAI, "bad_role_order"),
        (_openai(("user", "u"), ("user", "u2"), ("assistant", "a")), OPENAI, "bad_role_order"),
        (_openai(("user", "u"), ("assistant", "a"), ("assistant", "b")), OPENAI, "bad_role_order"),
        (_openai(("user", "u"), ("system", "s"), ("assistant", "a")), OPENAI, "bad_role_order"),
        (
            _openai(("user", "u"), ("assistant", "a"), ("user", "v")),
            OPENAI,
            "last_turn_not_assistant",
        ),
        (_openai(("user", "u"), ("assistant", "")), OPENAI, "empty_content"),
        (_openai(("user", "u"), ("assistant", None)), OPENAI, "missing_column"),
    ],
)
def test_malformed_rows_return_their_reason(row: dict, spec: DatasetSpec, reason: str) -> None:
    assert convert_row(row, spec) == reason


def test_pipeline_counts_every_dropped_row_by_reason(tmp_path: Path) -> None:
    good = _openai(("user", "Reverse the letters.\na b"), ("assistant", "b a"))
    rows = [
        good,
        _openai(("assistant", "a"), ("user", "u")),
        _openai(("user", "u"), ("assistant", "a"), ("user", "v")),
        _openai(("user", "u"), ("assistant", "a"), ("user", "v")),
        _openai(("user", ""), ("assistant", "a")),
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"text": "no messages column"},
        good,
    ]
    path = write_rows(tmp_path / "mixed.jsonl", rows)
    data = prepare_data(DataConfig(dataset=str(path)), demo_tokenizer())
    assert data.stats.dropped == {
        "bad_role_order": 1,
        "last_turn_not_assistant": 2,
        "empty_content": 1,
        "unknown_role": 1,
        "missing_column": 1,
    }
    assert (data.stats.rows_read, data.stats.kept, len(data.train)) == (8, 2, 2)
