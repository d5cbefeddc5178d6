"""Rendering and masks against the tokenizer's own chat template (ChatML demo and a Llama-3 style
template), templates that are not prefix-stable (rows or counted drops, never an exception),
truncation/drop accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_fixtures.helpers import demo_tokenizer, supervised_runs, write_rows
from megatrain.data import ChatEncoder, Conversation, DataConfig, Sample, prepare_data

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# Renders an assistant reply only while it is the last message: earlier turns get rewritten.
DROPS_PAST_REPLIES = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The generation prompt opens an empty think block that rendered replies do not have.
THINK_PROMPT = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think></think>' }}"
    "{% endif %}"
)

CONV = Conversation(
    system="Answer in upper case.",
    messages=[
        {"role": "user", "content": "Reverse the letters.\na b c"},
        {"role": "assistant", "content": "C B A"},
        {"role": "user", "content": "Count the letters.\na b"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Add the numbers.\n12 + 7"},
        {"role": "assistant", "content": "19"},
    ],
)
REPLIES = ["C B A", "2", "19"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


def _encode(tokenizer: Any, conv: Conversation = CONV, **kwargs: Any) -> Sample:
    kwargs.setdefault("cutoff_len", 4096)
    rows = ChatEncoder(tokenizer, **kwargs).encode(conv)
    assert isinstance(rows, list) and len(rows) == 1, rows  # prefix-stable: one row
    return rows[0]


def test_chatml_every_assistant_turn_supervised_and_prompt_masked(tokenizer: Any) -> None:
    sample = _encode(tokenizer)
    messages = [{"role": "system", "content": CONV.system}, *CONV.messages]
    reference = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert sample.input_ids.tolist() == reference
    decoded = [tokenizer.decode(run) for run in supervised_runs(sample)]
    assert decoded == [f"{reply}<|im_end|>\n" for reply in REPLIES]
    expected = sum(len(tokenizer(f"{r}<|im_end|>\n")["input_ids"]) for r in REPLIES)
    assert int(sample.target_mask.sum()) == expected == sample.num_target_tokens
    labels = sample.labels()
    assert (labels[~sample.target_mask] == -100).all()
    assert (labels[sample.target_mask] == sample.input_ids[sample.target_mask]).all()


def test_train_on_prompt_supervises_every_token(tokenizer: Any) -> None:
    sample = _encode(tokenizer, train_on_prompt=True)
    assert sample.target_mask.all() and (sample.labels() == sample.input_ids).all()


def test_default_system_prompt_only_where_none(tokenizer: Any) -> None:
    bare = Conversation(messages=CONV.messages[:2])
    with_default = _encode(tokenizer, bare, default_system="Be terse.")
    text = tokenizer.decode(with_default.input_ids.tolist())
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")
    own = _encode(tokenizer, CONV, default_system="Be terse.")
    assert "Be terse." not in tokenizer.decode(own.input_ids.tolist())


def test_llama3_style_template_masks_to_eot(tmp_path: Path) -> None:
    tok = demo_tokenizer()
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_tokens(specials, special_tokens=True)
    tok.bos_token = "<|begin_of_text|>"
    template_file = tmp_path / "llama3.jinja"
    template_file.write_text(LLAMA3_TEMPLATE)
    sample = _encode(tok, chat_template=str(template_file))
    messages = [{"role": "system", "content": CONV.system}, *CONV.messages]
    reference = tok.apply_chat_template(
        messages, chat_template=LLAMA3_TEMPLATE, tokenize=True, return_dict=False
    )
    assert sample.input_ids.tolist() == reference
    assert sample.input_ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    decoded = [tok.decode(run) for run in supervised_runs(sample)]
    assert decoded == [f"{reply}<|eot_id|>" for reply in REPLIES]


def test_tool_call_turn_is_supervised_as_rendered(tokenizer: Any) -> None:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 7}}}
    conv = Conversation(
        messages=[
            {"role": "user", "content": "Add 12 and 7."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "19"},
            {"role": "assistant", "content": "19"},
        ],
        tools=[{"type": "function", "function": {"name": "add"}}],
    )
    sample = _encode(tokenizer, conv)
    decoded = [tokenizer.decode(run) for run in supervised_runs(sample)]
    assert decoded == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call><|im_end|>\n',
        "19<|im_end|>\n",
    ]
    assert tokenizer.decode(sample.input_ids.tolist()).startswith("<|im_start|>system\n# Tools\n")


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        (DROPS_PAST_REPLIES, None),  # per_turn: one row per turn (tests/test_data_multiturn.py)
        (THINK_PROMPT, "generation_prompt_not_prefix"),
    ],
)
def test_template_that_is_not_prefix_stable_never_raises(
    tokenizer: Any, template: str, reason: str | None
) -> None:
    result = ChatEncoder(tokenizer, cutoff_len=4096, chat_template=template).encode(CONV)
    if reason is None:
        assert isinstance(result, list) and len(result) == len(REPLIES)
    else:
        assert result == reason


def test_tokenizer_without_chat_template_names_the_fix() -> None:
    tok = demo_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template") as err:
        ChatEncoder(tok, cutoff_len=64)
    assert "set data.chat_template" in str(err.value)
    with pytest.raises(FileNotFoundError, match="neither a Jinja template nor a file"):
        ChatEncoder(tok, cutoff_len=64, chat_template="missing.jinja")


def test_token_merge_across_turn_boundary_is_dropped(tokenizer: Any) -> None:
    # "<|im_start|>ass" + "istant" is one token "assistant": text prefix holds, tokens do not
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>ass' + m['content'] + '<|im_end|>' }}"
        "{% else %}{{ '<|im_start|>user\\n' + m['content'] + '<|im_end|>' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>ass' }}{% endif %}"
    )
    encoder = ChatEncoder(tokenizer, cutoff_len=64, chat_template=template)
    merged = Conversation(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "istant"}]
    )
    assert encoder.encode(merged) == "token_merge_across_turns"
    fine = Conversation(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " ok"}]
    )
    assert isinstance(encoder.encode(fine), list)


def test_template_exception_drops_the_sample(tokenizer: Any) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tool role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    conv = Conversation(
        [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "b"},
        ]
    )
    assert ChatEncoder(tokenizer, cutoff_len=64, chat_template=template).encode(conv) == (
        "template_error"
    )


def _long_rows() -> list[dict[str, Any]]:
    rows = []
    for n in (3, 9, 15):
        letters = " ".join("abcdefgh"[i % 8] for i in range(n))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Reverse the letters.\n{letters}"},
                    {"role": "assistant", "content": letters[::-1]},
                ]
            }
        )
    return rows


def test_overflow_truncate_and_drop_are_counted(tmp_path: Path, tokenizer: Any) -> None:
    path = write_rows(tmp_path / "long.jsonl", _long_rows())
    full = prepare_data(DataConfig(dataset=str(path), cutoff_len=4096), tokenizer)
    lengths = [s.num_tokens for s in full.train]
    cutoff = lengths[1] - 2  # the two longer samples are over
    cut = prepare_data(DataConfig(dataset=str(path), cutoff_len=cutoff), tokenizer)
    assert [s.num_tokens for s in cut.train] == [lengths[0], cutoff, cutoff]
    assert [s.truncated for s in cut.train] == [False, True, True]
    assert (cut.stats.truncated, cut.stats.dropped) == (2, {})
    for short, whole in zip(cut.train, full.train, strict=True):
        n = short.num_tokens
        assert np.array_equal(short.input_ids, whole.input_ids[:n])
        assert np.array_equal(short.target_mask, whole.target_mask[:n])
    assert cut.stats.num_tokens == lengths[0] + 2 * cutoff
    dropped = prepare_data(
        DataConfig(dataset=str(path), cutoff_len=cutoff, overflow="drop"), tokenizer
    )
    assert [s.num_tokens for s in dropped.train] == [lengths[0]]
    assert (dropped.stats.truncated, dropped.stats.dropped) == (0, {"over_cutoff_len": 2})


def test_truncation_that_removes_all_targets_drops_the_sample(tmp_path: Path, tokenizer) -> None:
    path = write_rows(tmp_path / "long.jsonl", _long_rows())
    prompt_only = 12  # every sample's prompt is longer than 12 tokens
    cfg = DataConfig(dataset=str(path), cutoff_len=prompt_only, min_target_tokens=1)
    with pytest.raises(ValueError, match="over_cutoff_len=3"):  # the cut is the reason
        prepare_data(cfg, tokenizer)
    rows = [*_long_rows(), json.loads(json.dumps(_long_rows()[0]))]
    rows[-1]["messages"][0]["content"] = "a"
    path2 = write_rows(tmp_path / "mixed.jsonl", rows)
    data = prepare_data(DataConfig(dataset=str(path2), cutoff_len=prompt_only), tokenizer)
    assert data.stats.dropped == {"over_cutoff_len": 3} and data.stats.kept == 1
    uncut = prepare_data(DataConfig(dataset=str(path)), tokenizer).train
    longest = max(s.num_tokens for s in uncut)
    few = DataConfig(dataset=str(path), min_target_tokens=longest)  # too few even uncut
    with pytest.raises(ValueError, match="too_few_target_tokens=3"):
        prepare_data(few, tokenizer)
