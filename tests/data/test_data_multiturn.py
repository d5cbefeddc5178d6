"""Multi-turn data with chat templates that are not prefix-stable: every assistant turn is
supervised with exactly the tokens the template renders for it (`data.multi_turn`), and a
conversation that cannot be masked is dropped and counted, never an abort of the run.

The templates mimic the real ones' shape: QWEN3_LIKE drops the <think> block of replies before
the last user message and always opens one for the last reply (Qwen3's hybrid thinking);
GPT_OSS_LIKE renders the analysis channel only for the last reply, which ends with <|return|>
instead of <|end|>; R1_LIKE strips reasoning from every reply but opens <think> in the
generation prompt (DeepSeek-R1), so no reply can be masked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from data_fixtures.helpers import demo_tokenizer, supervised_runs, write_rows
from megatrain.data import ChatEncoder, Conversation, DataConfig, prepare_data

QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined else '' %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + m.content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + m.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GPT_OSS_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if loop.last and m.thinking is defined %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content }}"
    "{{- '<|return|>' if loop.last else '<|end|>' }}"
    "{%- else %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
R1_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|Assistant|>' + m.content.split('</think>')[-1] + '<|eos|>' }}"
    "{%- else %}{{- '<|User|>' + m.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|Assistant|><think>\\n' }}{%- endif %}"
)
SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
SPECIALS += ["<|Assistant|>", "<|User|>", "<|eos|>"]

REPLIES = ["C B A", "2", "19"]
THOUGHTS = ["reverse them", "two letters", "12 + 7 = 19"]
CONV = Conversation(
    messages=[
        {"role": "user", "content": "Reverse: a b c"},
        {"role": "assistant", "content": "C B A", "reasoning_content": "reverse them"},
        {"role": "user", "content": "Count: a b"},
        {"role": "assistant", "content": "2", "reasoning_content": "two letters"},
        {"role": "user", "content": "Add: 12 + 7"},
        {"role": "assistant", "content": "19", "reasoning_content": "12 + 7 = 19"},
    ]
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = demo_tokenizer()
    tok.add_tokens(SPECIALS, special_tokens=True)
    return tok


def _rendered(tok: Any, template: str, messages: list[dict[str, Any]]) -> list[int]:
    ids = tok.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=False
    )
    return list(ids)


def test_qwen3_like_per_turn_trains_each_turn_with_its_thinking(tokenizer: Any) -> None:
    rows = ChatEncoder(tokenizer, cutoff_len=4096, chat_template=QWEN3_LIKE).encode(CONV)
    assert isinstance(rows, list) and len(rows) == 3  # each reply rendered differently later
    for k, row in enumerate(rows):
        # the row is the template's own rendering of the conversation ending at reply k ...
        assert row.input_ids.tolist() == _rendered(
            tokenizer, QWEN3_LIKE, CONV.messages[: 2 * k + 2]
        )
        # ... supervising exactly that reply, with the think block the template gives it
        runs = [tokenizer.decode(run) for run in supervised_runs(row)]
        assert runs == [f"<think>\n{THOUGHTS[k]}\n</think>\n\n{REPLIES[k]}<|im_end|>\n"]
        # earlier replies are context, as the template renders history (no think block)
        history = tokenizer.decode(row.input_ids.tolist())
        for j in range(k):
            assert f"<|im_start|>assistant\n{REPLIES[j]}<|im_end|>" in history


def test_qwen3_like_final_trains_the_whole_rendering_once(tokenizer: Any) -> None:
    encoder = ChatEncoder(tokenizer, cutoff_len=4096, chat_template=QWEN3_LIKE, multi_turn="final")
    rows = encoder.encode(CONV)
    assert isinstance(rows, list) and len(rows) == 1
    (row,) = rows
    assert row.input_ids.tolist() == _rendered(tokenizer, QWEN3_LIKE, CONV.messages)
    runs = [tokenizer.decode(run) for run in supervised_runs(row)]
    # earlier replies appear re-rendered (no think block): context, not targets
    assert runs == [f"<think>\n{THOUGHTS[2]}\n</think>\n\n19<|im_end|>\n"]


def test_qwen3_like_without_reasoning_merges_turns_it_renders_unchanged(tokenizer: Any) -> None:
    # A tool turn between replies: the reply before it stays after the last user message, so the
    # template renders it the same in the final conversation and one row holds both replies.
    conv = Conversation(
        messages=[
            {"role": "user", "content": "Add 12 and 7."},
            {"role": "assistant", "content": "calling add", "reasoning_content": "use the tool"},
            {"role": "tool", "content": "19"},
            {"role": "assistant", "content": "19", "reasoning_content": "the tool said 19"},
        ]
    )
    rows = ChatEncoder(tokenizer, cutoff_len=4096, chat_template=QWEN3_LIKE).encode(conv)
    assert isinstance(rows, list) and len(rows) == 1
    runs = [tokenizer.decode(run) for run in supervised_runs(rows[0])]
    assert runs == [
        "<think>\nuse the tool\n</think>\n\ncalling add<|im_end|>\n",
        "<think>\nthe tool said 19\n</think>\n\n19<|im_end|>\n",
    ]


def test_gpt_oss_like_per_turn_supervises_analysis_and_return(tokenizer: Any) -> None:
    conv = Conversation(
        messages=[
            {k.replace("reasoning_content", "thinking"): v for k, v in m.items()}
            for m in CONV.messages
        ]
    )
    rows = ChatEncoder(tokenizer, cutoff_len=4096, chat_template=GPT_OSS_LIKE).encode(conv)
    assert isinstance(rows, list) and len(rows) == 3
    for k, row in enumerate(rows):
        assert row.input_ids.tolist() == _rendered(
            tokenizer, GPT_OSS_LIKE, conv.messages[: 2 * k + 2]
        )
        runs = [tokenizer.decode(run) for run in supervised_runs(row)]
        assert runs == [
            f"<|channel|>analysis<|message|>{THOUGHTS[k]}<|end|><|start|>assistant"
            f"<|channel|>final<|message|>{REPLIES[k]}<|return|>"
        ]


def test_r1_like_rows_are_dropped_and_counted_not_raised(tmp_path: Path, tokenizer: Any) -> None:
    # The generation prompt opens <think> that no rendered reply has: no reply can be masked.
    # Mixed with a file of another data set, the run goes on and counts the drops.
    rows = [{"messages": CONV.messages[:2]}, {"messages": CONV.messages}]
    path = write_rows(tmp_path / "r1.jsonl", rows)
    encoder = ChatEncoder(tokenizer, cutoff_len=4096, chat_template=R1_LIKE)
    assert encoder.encode(CONV) == "generation_prompt_not_prefix"
    with pytest.raises(ValueError, match="generation_prompt_not_prefix=2"):
        prepare_data(DataConfig(dataset=str(path), chat_template=R1_LIKE), tokenizer)


@pytest.mark.parametrize(("multi_turn", "extra"), [("per_turn", 2), ("final", 0)])
def test_pipeline_trains_multi_turn_rows_and_counts_them(
    tmp_path: Path, tokenizer: Any, multi_turn: str, extra: int
) -> None:
    rows = [{"messages": CONV.messages}, {"messages": CONV.messages[:2]}]
    path = write_rows(tmp_path / "chat.jsonl", rows)
    cfg = DataConfig(dataset=str(path), chat_template=QWEN3_LIKE, multi_turn=multi_turn)
    data = prepare_data(cfg, tokenizer)
    assert data.stats.rows_read == data.stats.kept + data.stats.num_dropped == 2
    assert data.stats.extra_rows == extra and len(data.train) == 2 + extra
    assert data.stats.num_target_tokens == sum(s.num_target_tokens for s in data.train)
    # the rows' reasoning_content reached the template: the last reply is trained with it
    supervised = [tokenizer.decode(run) for s in data.train for run in supervised_runs(s)]
    assert f"<think>\n{THOUGHTS[2]}\n</think>\n\n19<|im_end|>\n" in supervised


def test_multi_turn_option_is_validated() -> None:
    with pytest.raises(ValueError, match=r"data\.multi_turn='last'.*per_turn"):
        DataConfig(multi_turn="last").validate()
