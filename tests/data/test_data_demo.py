"""The built-in demo: committed assets equal the generator's output, the tokenizer loads offline,
the answers are right, and `demo` and `demo_alpaca` are the same data in two formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from megatrain.data import DataConfig, prepare_data
from megatrain.data.demo_assets import NUM_CONVERSATIONS, UPPER_SYSTEM, generate
from megatrain.data.demo_vlm import IMAGE_DIR
from megatrain.data.demo_vlm import NUM_ROWS as NUM_VLM_ROWS
from megatrain.package_assets import demo_assets_dir, demo_tokenizer_dir


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_committed_assets_equal_a_fresh_generation(tmp_path: Path) -> None:
    generate(tmp_path)
    committed = _files(demo_assets_dir())
    images = sorted(k for k in committed if k.startswith(f"{IMAGE_DIR}/"))
    assert len(images) > NUM_VLM_ROWS and all(k.endswith(".png") for k in images)
    assert sorted(set(committed) - set(images)) == [
        "dataset_info.json",
        "demo.jsonl",
        "demo_alpaca.jsonl",
        "demo_count.jsonl",
        "demo_dpo.jsonl",
        "demo_text.txt",
        "demo_vlm.json",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "vlm/chat_template.jinja",
        "vlm/preprocessor_config.json",
        "vlm/tokenizer.json",
        "vlm/tokenizer_config.json",
    ]
    assert _files(tmp_path) == committed
    assert sum(len(b) for b in committed.values()) < 2 * 2**20
    vlm = [k for k in committed if k.startswith(("demo_vlm", "vlm/"))]
    assert sum(len(committed[k]) for k in vlm) < 2**20 / 2


def test_tokenizer_loads_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir()))
    assert len(tok) <= 512
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.eos_token_id != tok.pad_token_id
    text = "<|im_start|>user\nReverse the letters.\nH a b<|im_end|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|im_start|>", "user"]


def _expected_answer(instruction: str, query: str, upper: bool) -> str:
    if instruction == "Add the numbers.":
        a, b = query.split(" + ")
        return str(int(a) + int(b))
    letters = query.split(" ")
    if instruction == "Count the letters.":
        return str(len(letters))
    ordered = sorted(letters) if instruction == "Sort the letters." else letters[::-1]
    answer = " ".join(ordered)
    return answer.upper() if upper else answer


def test_every_demo_answer_is_correct() -> None:
    rows = [json.loads(line) for line in (demo_assets_dir() / "demo.jsonl").open()]
    assert len(rows) == NUM_CONVERSATIONS
    turns = systems = multi = 0
    for row in rows:
        messages = row["messages"]
        upper = messages[0] == {"role": "system", "content": UPPER_SYSTEM}
        systems += messages[0]["role"] == "system"
        dialog = messages[1:] if messages[0]["role"] == "system" else messages
        multi += len(dialog) > 2
        for user, assistant in zip(dialog[0::2], dialog[1::2], strict=True):
            instruction, query = user["content"].split("\n")
            assert assistant["content"] == _expected_answer(instruction, query, upper)
            turns += 1
    assert 0.3 < systems / len(rows) < 0.5 and 0.15 < multi / len(rows) < 0.35
    assert turns > len(rows) * 1.2


def test_demo_and_demo_alpaca_render_identically() -> None:
    tok: Any = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir()))
    cfg = DataConfig(max_samples=400, shuffle=False)
    openai = prepare_data(cfg, tok)
    alpaca = prepare_data(DataConfig(dataset="demo_alpaca", max_samples=400), tok)
    assert openai.stats.to_dict() == alpaca.stats.to_dict()
    assert openai.stats.kept == 400 and not openai.stats.dropped
    for a, b in zip(openai.train, alpaca.train, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.target_mask.tolist() == b.target_mask.tolist()


def test_demo_dpo_pairs_prefer_the_correct_answer() -> None:
    """demo_dpo: the chosen answer solves the task, the rejected one differs from it."""
    rows = [json.loads(line) for line in (demo_assets_dir() / "demo_dpo.jsonl").open()]
    for row in rows:
        assert row["rejected"] != row["chosen"]
        if row["instruction"] == "Add the numbers.":
            a, b = row["input"].split(" + ")
            assert row["chosen"] == str(int(a) + int(b))
        elif row["instruction"] == "Count the letters.":
            assert row["chosen"] == str(len(row["input"].split()))
        else:
            letters = row["input"].split()
            ordered = (
                sorted(letters) if row["instruction"] == "Sort the letters." else letters[::-1]
            )
            text = " ".join(ordered)
            assert row["chosen"] == (text.upper() if row.get("system") == UPPER_SYSTEM else text)
