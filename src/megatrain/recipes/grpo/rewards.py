"""Reward functions: built-ins for verifiable answers, and user functions by reference.

Every reward function has TRL's signature: called with keyword lists of equal length,

    fn(prompts=[...], completions=[...], completion_ids=[...], **extra_columns) -> list[float]

where `prompts` are the data set's prompts (text, or a message list in conversational data),
`completions` the generated texts (conversational data: [{"role": "assistant", "content": text}]
per completion, as TRL passes them) and each extra column (e.g. `answer`) is a list with one
entry per completion. An entry may be None where the function does not apply (it is then left
out of that completion's reward, as in TRL).

Built-ins: "math_answer" (the completion's final answer, from the last \\boxed{...} else the last
number, equals `answer`: its \\boxed{} content, else its text after "####" (GSM8K), else all of
it; numbers compare by value), "exact_answer" (the stripped completion equals the stripped
`answer`), "answer_similarity" (partial credit: difflib's similarity ratio of the two, for
string answers), "format" (the completion matches a regular expression). User functions:
"path/to/file.py:name" (path relative to the working directory) or "package.module:name".

Invariant: a reward that raises, returns something other than a list of numbers of the right
length, or cannot be found stops the run with a ValueError / FileNotFoundError naming it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain.recipes.grpo.prompts import Prompt

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def completion_text(completion: Any) -> str:
    """The text of a completion in either of TRL's forms (string, or assistant message list)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def final_answer(text: str) -> str | None:
    """The final answer of a text: the last \\boxed{} content, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _value(answer: str) -> float | None:
    text = answer.replace(",", "").replace("$", "").strip()
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(predicted: str, reference: str) -> bool:
    """Numbers by value (1,000 == 1000.0, 1/2 == 0.5), anything else as whitespace-free text."""
    a, b = _value(predicted), _value(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return "".join(predicted.split()) == "".join(reference.split())


def math_answer(completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """1.0 where the completion's final answer equals the reference answer, else 0.0."""
    out: list[float | None] = []
    for completion, ref in zip(completions, answer, strict=True):
        if ref is None:
            out.append(None)
            continue
        ref_text = str(ref)
        target = last_boxed(ref_text) or ref_text.split("####")[-1]
        got = final_answer(completion_text(completion))
        out.append(float(got is not None and same_answer(got, target)))
    return out


def exact_answer(completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """1.0 where the stripped completion equals the stripped reference answer, else 0.0."""
    return [
        None if ref is None else float(completion_text(c).strip() == str(ref).strip())
        for c, ref in zip(completions, answer, strict=True)
    ]


def answer_similarity(completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """Partial credit in [0, 1]: difflib's similarity ratio of stripped completion and answer."""
    return [
        None
        if ref is None
        else difflib.SequenceMatcher(None, completion_text(c).strip(), str(ref).strip()).ratio()
        for c, ref in zip(completions, answer, strict=True)
    ]


def format_reward(pattern: str) -> Callable[..., list[float | None]]:
    """1.0 where the completion matches `pattern` (DOTALL, from its start), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)

    def matches_format(completions: list[Any], **_: Any) -> list[float | None]:
        return [float(regex.match(completion_text(c)) is not None) for c in completions]

    return matches_format


@dataclass
class RewardFunction:
    name: str  # as written in grpo.reward_funcs
    fn: Callable[..., Any]

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        extras: dict[str, list[Any]],
    ) -> list[float]:
        """The rewards of these completions (NaN where the function returned None)."""
        try:
            values = self.fn(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **extras
            )
        except Exception as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            said = f"raised {type(e).__name__}: {e} (at {frame.filename}:{frame.lineno})"
            if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
                said += (  # the call itself failed: its signature, not its body
                    "; it is called with keyword lists prompts, completions, completion_ids "
                    f"and the extra columns {sorted(extras)}: accept **kwargs for those it "
                    "does not use"
                )
            raise ValueError(f"reward function {self.name!r} (grpo.reward_funcs) {said}") from e
        return self._check(values, len(completions))

    def _check(self, values: Any, expected: int) -> list[float]:
        if not isinstance(values, Sequence) or isinstance(values, str):
            raise ValueError(
                f"reward function {self.name!r} (grpo.reward_funcs) returned "
                f"{type(values).__name__}, not a list of floats (one per completion)"
            )
        if len(values) != expected:
            raise ValueError(
                f"reward function {self.name!r} (grpo.reward_funcs) returned {len(values)} "
                f"rewards for {expected} completions; return one float per completion"
            )
        out = []
        for v in values:
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(
                    f"reward function {self.name!r} (grpo.reward_funcs) returned {v!r} "
                    f"({type(v).__name__}); each reward must be a number or None"
                )
            out.append(math.nan if v is None else float(v))
        return out


def load_reward(name: str, *, format_pattern: str) -> RewardFunction:
    """A built-in by name, or a user function given as "file.py:name" / "module:name"."""
    builtins: dict[str, Callable[..., Any]] = {
        "math_answer": math_answer,
        "exact_answer": exact_answer,
        "answer_similarity": answer_similarity,
        "format": format_reward(format_pattern),
    }
    if name in builtins:
        return RewardFunction(name, builtins[name])
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(
            f"grpo.reward_funcs: {name!r} is neither a built-in ({', '.join(builtins)}) nor "
            "a user function written as path/to/file.py:function or package.module:function"
        )
    module = _load_file(name, Path(where)) if where.endswith(".py") else _import(name, where)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(
            f"grpo.reward_funcs: {name!r}: {where} has no function {attr!r}"
            + (f" ({attr} is a {type(fn).__name__})" if fn is not None else "")
        )
    return RewardFunction(name, fn)


def _load_file(name: str, path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(
            f"grpo.reward_funcs: {name!r}: no file {path} (relative to the working directory "
            f"{Path.cwd()}); give the path of the Python file that defines the function"
        )
    spec = importlib.util.spec_from_file_location(f"megatrain_reward_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import(name: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(
            f"grpo.reward_funcs: {name!r}: cannot import module {module!r} ({e}); install it "
            "or give the function's file as path/to/file.py:function"
        ) from e


def score(
    rewards: list[RewardFunction],
    prompts: list[Prompt],
    texts: list[str],
    completions: list[list[int]],
) -> torch.Tensor:
    """Every reward function's score of every completion (`texts`, their decoded tokens
    `completions`), float64 [N, F] (NaN: None)."""
    shown = [
        [{"role": "assistant", "content": t}] if p.conversational else t
        for p, t in zip(prompts, texts, strict=True)
    ]
    keys = sorted({k for p in prompts for k in p.extras})
    extras = {k: [p.extras.get(k) for p in prompts] for k in keys}
    columns = [fn([p.prompt for p in prompts], shown, completions, extras) for fn in rewards]
    return torch.tensor(columns, dtype=torch.float64).T
