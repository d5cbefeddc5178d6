"""Prompts from the data registry, built-in and user rewards, group advantages (TRL's formula)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, tokenization_utils_base

from megatrain.package_assets import demo_assets_dir, demo_tokenizer_dir
from megatrain.recipes.grpo.advantages import group_advantages
from megatrain.recipes.grpo.prompts import load_prompts
from megatrain.recipes.grpo.rewards import load_reward, math_answer


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(demo_tokenizer_dir()))


def _load(names: list[str], tokenizer, **kw):
    args = dict(chat_template=None, system_prompt=None, max_prompt_length=None, max_samples=None)
    return load_prompts(names, demo_assets_dir(), tokenizer, seed=0, **(args | kw))


def test_demo_conversations_become_prompts_with_answers(tokenizer) -> None:
    prompts = _load(["demo"], tokenizer, max_samples=3)
    first = prompts[0]
    assert first.prompt == [{"role": "user", "content": "Reverse the letters.\na b b"}]
    assert first.extras == {"answer": "b b a"}
    text = tokenizer.apply_chat_template(first.prompt, add_generation_prompt=True, tokenize=False)
    assert first.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(first.prompt_ids).endswith("<|im_start|>assistant\n")
    assert prompts[2].prompt[0] == {"role": "system", "content": "Answer in upper case."}


def test_trl_prompt_files_keep_extra_columns_and_truncate_left(tokenizer, tmp_path) -> None:
    rows = [{"prompt": "What is 2 + 3?", "answer": "5", "level": 1}, {"prompt": ""}]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (full,) = _load([str(path)], tokenizer)
    (short,) = _load([str(path)], tokenizer, max_prompt_length=4)
    assert full.prompt == "What is 2 + 3?" and full.extras == {"answer": "5", "level": 1}
    assert short.prompt_ids == full.prompt_ids[-4:]


def test_a_prompt_over_the_tokenizers_limit_is_cut_without_its_warning(
    tmp_path, monkeypatch
) -> None:
    """grpo.max_prompt_length cuts a prompt longer than the tokenizer's model_max_length: no
    "Token indices sequence length is longer than ..." warning from transformers (a fresh
    tokenizer: it gives that warning once per instance)."""
    fresh = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir()))
    warned: list[str] = []
    monkeypatch.setattr(
        tokenization_utils_base.logger, "warning", lambda msg, *a, **k: warned.append(msg)
    )
    path = tmp_path / "long.jsonl"
    text = " ".join(["word"] * (fresh.model_max_length + 50))
    path.write_text(json.dumps({"prompt": text}) + "\n")
    (long,) = _load([str(path)], fresh, max_prompt_length=16)
    assert len(long.prompt_ids) == 16
    assert not [m for m in warned if "sequence length is longer" in m]


def test_math_answer_extracts_boxed_and_last_numbers() -> None:
    completions = [
        "so the result is \\boxed{\\frac{1}{2}}.",
        "The total is 1,234.",
        "First 3, then 71, finally 72",
        "It is 7",
        "no number",
        [{"role": "assistant", "content": "x = 0.5"}],
    ]
    answers = ["\\frac{1}{2}", "1234", "She has #### 72", "8", "3", "1/2", None]
    scores = math_answer([*completions, "5"], answers)
    assert scores[:6] == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0] and scores[6] is None


def test_format_and_module_rewards() -> None:
    fmt = load_reward("format", format_pattern=r"<answer>\d+</answer>$")
    nan = math.nan
    assert fmt(["p", "p"], ["<answer>12</answer>", "12"], [[1], [2]], {}) == [1.0, 0.0]
    exact = load_reward("megatrain.recipes.grpo.rewards:exact_answer", format_pattern="")
    got = exact(["p"] * 3, [" a b ", "a c", "x"], [[1]] * 3, {"answer": ["a b", "a b", None]})
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2]) and nan != nan
    similar = load_reward("answer_similarity", format_pattern="")
    got = similar(["p"] * 3, ["c b a", "c a", "zz"], [[1]] * 3, {"answer": ["c b a"] * 3})
    assert got == [1.0, 2 * 3 / (3 + 5), 0.0]  # 2 x matching characters / total characters


def _user_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return f"{path}:score"


def test_user_file_reward_gets_trl_keywords(tmp_path) -> None:
    name = _user_file(
        tmp_path,
        "def score(prompts, completions, completion_ids, level, **kwargs):\n"
        "    return [len(c) * l + len(i) for c, l, i in zip(completions, level, completion_ids)]\n",
    )
    fn = load_reward(name, format_pattern="")
    assert fn(["p", "q"], ["ab", "abc"], [[1], [1, 2]], {"level": [1, 10]}) == [3.0, 32.0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def score(completions, **kw):\n    return 1 / 0\n", "raised ZeroDivisionError"),
        ("def score(completions, **kw):\n    return [1.0]\n", "returned 1 rewards for 2"),
        ("def score(completions, **kw):\n    return ['1', '2']\n", "must be a number or None"),
    ],
)
def test_bad_user_rewards_stop_with_their_name(tmp_path, body: str, message: str) -> None:
    fn = load_reward(_user_file(tmp_path, body), format_pattern="")
    with pytest.raises(ValueError, match=f"reward function '.*my_rewards.py:score'.*{message}"):
        fn(["p", "q"], ["a", "b"], [[1], [2]], {})


def test_missing_reward_names_the_entry(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.py:score"):
        load_reward(str(tmp_path / "nope.py") + ":score", format_pattern="")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward("megatrain.recipes.grpo.rewards:missing", format_pattern="")
    with pytest.raises(ValueError, match="neither a built-in"):
        load_reward("accuracy", format_pattern="")


def test_group_advantages_follow_trl() -> None:
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, math.nan]])
    rewards = torch.cat([rewards, torch.tensor([[math.nan, math.nan]])])
    weights = torch.tensor([1.0, 0.5])
    out = group_advantages(rewards, weights, num_generations=2, scaling="group")
    # group 1: rewards 1, 0: mean 0.5, Bessel std sqrt(0.5); group 2: equal; group 3: 2, NaN
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert out.advantages == pytest.approx([a, -a, 0.0, 0.0, 0.0, 0.0], rel=1e-12)
    assert out.rewards[:5] == [1.0, 0.0, 1.5, 1.5, 2.0] and math.isnan(out.rewards[5])
    none = group_advantages(rewards[:4], weights, num_generations=2, scaling="none")
    assert none.advantages == [0.5, -0.5, 0.0, 0.0]
    batch = group_advantages(rewards[:4], weights, num_generations=2, scaling="batch")
    std = torch.tensor([1.0, 0.0, 1.5, 1.5], dtype=torch.float64).std().item()
    assert batch.advantages == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0, 0])


def test_only_a_signature_error_gets_the_kwargs_hint(tmp_path) -> None:
    own = load_reward(
        _user_file(tmp_path, "def score(completions, **kw):\n    1 / 0\n"), format_pattern=""
    )
    with pytest.raises(ValueError) as err:
        own(["p"], ["a"], [[1]], {"level": [1]})
    assert "raised ZeroDivisionError: division by zero (at " in str(err.value)
    assert "**kwargs" not in str(err.value)
    strict = tmp_path / "strict"
    strict.mkdir()
    narrow = load_reward(
        _user_file(strict, "def score(completions):\n    return [1.0]\n"), format_pattern=""
    )
    with pytest.raises(ValueError) as err:
        narrow(["p"], ["a"], [[1]], {"level": [1]})
    assert "unexpected keyword argument 'prompts'" in str(err.value)
    assert str(err.value).endswith(
        "it is called with keyword lists prompts, completions, completion_ids and the extra "
        "columns ['level']: accept **kwargs for those it does not use"
    )
