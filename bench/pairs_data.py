"""Preference pairs for bench/cli_train.py: a data set of `pairs` (prompt, chosen, rejected) made
of demo text, each row (the prompt and one completion through the chat template) a few tokens
under `seq` under the demo tokenizer, registered as a user registers theirs (dataset_info.json,
alpaca columns); the same pairs as SFT rows (two rows a pair: prompt + chosen, prompt +
rejected) so that `megatrain train` and `megatrain dpo` see the same rows' tokens.

The prompt is about seq/8 tokens, each completion the rest less the template's tokens and
MARGIN (the padded length, a multiple of data.pad_to_multiple_of 8, then stays within `seq`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO_TEXT = ROOT / "src" / "megatrain" / "assets" / "demo" / "demo_text.txt"
MARGIN = 8  # tokens each row stays under seq
NAME = "pairs"


def _tokenizer() -> Any:
    from megatrain.model.tokenizer import load_tokenizer

    return load_tokenizer("demo", None, trust_remote_code=False)


class _Text:
    """Demo lines joined to a given token count (the count checked on the joined text)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tok, self.rng = tokenizer, random.Random(seed)
        lines = [ln.strip() for ln in DEMO_TEXT.read_text().splitlines() if ln.strip()]
        self.lines = [(ln, len(self.count_ids(" " + ln))) for ln in lines]

    def count_ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def of(self, tokens: int) -> str:
        words, size = [], 0
        while size < tokens:
            line, n = self.rng.choice(self.lines)
            words += line.split()
            size += n
        while len(self.count_ids(" ".join(words))) > tokens:
            del words[-max(1, (len(words) // 50)) :]  # trim the end, a few words at a time
        return " ".join(words)


def _row_tokens(tok: Any, prompt: str, completion: str) -> int:
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    return len(tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])


def make_pairs(count: int, seq: int, seed: int = 0) -> tuple[list[dict[str, str]], int]:
    """`count` pairs whose rows stay within seq - MARGIN tokens, and their longest row."""
    text = _Text(_tokenizer(), seed)
    tok, limit = text.tok, seq - MARGIN
    overhead = _row_tokens(tok, "a", "b") - 2  # the template's tokens around a row
    prompt_tokens = max(1, seq // 8)
    completion_tokens = max(1, limit - prompt_tokens - overhead)
    pairs, longest = [], 0
    for _ in range(count):
        pair = {"instruction": text.of(prompt_tokens)}
        for side in ("chosen", "rejected"):
            completion = text.of(completion_tokens)
            while _row_tokens(tok, pair["instruction"], completion) > limit:
                completion = completion.rsplit(" ", 1)[0]  # boundary merges: a word less
            pair[side] = completion
            longest = max(longest, _row_tokens(tok, pair["instruction"], completion))
        pairs.append(pair)
    return pairs, longest


def write_data(folder: Path, pairs: list[dict[str, str]], *, sft: bool) -> dict[str, Any]:
    """The data set in `folder` (dataset_info.json + a JSON file): the pairs (ranking) or, with
    `sft`, their rows; returns the config's `data` entries that name it."""
    folder.mkdir(parents=True, exist_ok=True)
    if sft:
        rows = [{"instruction": p["instruction"], "output": p[s]} for p in pairs for s in
                ("chosen", "rejected")]  # fmt: skip
        columns = {"prompt": "instruction", "response": "output"}
        entry: dict[str, Any] = {"file_name": f"{NAME}_sft.json", "columns": columns}
    else:
        rows = pairs
        columns = {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}
        entry = {"file_name": f"{NAME}.json", "ranking": True, "columns": columns}
    (folder / entry["file_name"]).write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({NAME: entry}, indent=2))
    return {"dataset": NAME, "dataset_dir": str(folder)}
