"""Raw-text fixtures for the stage-pt tests: small files shaped like LLaMA-Factory's `c4_demo.jsonl`
(one `{"text": ...}` object per line) and `wiki_demo.txt` (one document per line), registered the
way its `data/dataset_info.json` registers them, and the reference tokenization of a document."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

WORDS = [
    "the", "history", "of", "science", "is", "a", "long", "record", "of", "measurement", "and",
    "argument", "about", "nature", "while", "rivers", "cities", "and", "languages", "change",
    "over", "centuries", "in", "ways", "that", "scholars", "describe",
]  # fmt: skip

REGISTRY = {
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
    "wiki_demo": {"file_name": "wiki_demo.txt", "columns": {"prompt": "text"}},
}


def random_text(rng: random.Random, min_words: int, max_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    return " ".join(words).capitalize() + "."


def write_lf_corpus(folder: Path, *, c4_docs: int = 40, wiki_docs: int = 25, seed: int = 0) -> dict:
    """Write c4_demo.jsonl, wiki_demo.txt and dataset_info.json; return the texts of each."""
    rng = random.Random(seed)
    c4 = [random_text(rng, 3, 80) for _ in range(c4_docs)]
    wiki = [random_text(rng, 10, 120) for _ in range(wiki_docs)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c4_demo.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in c4))
    (folder / "wiki_demo.txt").write_text("".join(t + "\n" for t in wiki))
    (folder / "dataset_info.json").write_text(json.dumps(REGISTRY, indent=2))
    return {"c4_demo": c4, "wiki_demo": wiki}


def reference_document(tokenizer: Any, text: str) -> list[int]:
    """A document as stage pt must store it: the tokenizer's ids, then eos."""
    return [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]


def reference_stream(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the concatenated token stream, the offsets where each document starts)."""
    docs = [reference_document(tokenizer, t) for t in texts]
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    return np.concatenate([np.array(d, dtype=np.int64) for d in docs]), np.cumsum(lens) - lens
