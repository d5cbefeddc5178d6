"""Stage pt at corpus scale: a >= 1 GB generated text corpus tokenizes once in bounded memory, a
second prepare reads the cache without tokenizing, and a tiny model trains a few steps from it.

    python bench/pt_corpus.py [--gb 1.05] [--dir /tmp/megatrain_pt_corpus]

Runs on the CPU (not in CI). The corpus is SHARDS `.txt` files (one document per line, 1-12
demo-style lines joined per document) registered as LLaMA-Factory registers raw text
(`"columns": {"prompt": "text"}`), tokenized with the built-in demo tokenizer. Each phase runs in
a fresh Python process so its peak RSS (ru_maxrss) is its own: `tokenize` (cold cache),
`reprepare` (warm cache; counts the texts given to the tokenizer, must be 0) and `train` (5 steps
of the tiny demo Llama, micro-batch 4 x 256 tokens). Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SHARDS = 8
POOL_LINES = 50_000
DEMO_YAML = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def generate(folder: Path, total_bytes: int) -> None:
    """SHARDS text files of `total_bytes` in all: documents of 1-12 random demo-style lines."""
    from megatrain.data.demo_assets import make_conversation, to_text

    rng = random.Random(0)
    pool = np.array([to_text(make_conversation(rng)) for _ in range(POOL_LINES)], dtype=object)
    gen = np.random.default_rng(0)
    shards = folder / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    for s in range(SHARDS):
        with (shards / f"part-{s:02d}.txt").open("w", encoding="utf-8") as f:
            while f.tell() < total_bytes // SHARDS:
                picks = pool[gen.integers(0, POOL_LINES, size=(2000, 12))]
                sizes = gen.integers(1, 13, size=2000)
                docs = (" ".join(row[:n]) for row, n in zip(picks, sizes, strict=True))
                f.write("".join(doc + "\n" for doc in docs))
    info = {"corpus": {"file_name": "shards", "columns": {"prompt": "text"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))


def _data_cfg(folder: Path) -> Any:
    from megatrain.data import DataConfig

    return DataConfig(
        stage="pt", dataset="corpus", dataset_dir=str(folder), cache_dir=str(folder / "cache")
    )


class CountingTokenizer:
    """The real tokenizer, counting the texts it is asked to tokenize."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self.texts = tokenizer, 0

    def __call__(self, texts: Any, **kwargs: Any) -> Any:
        self.texts += len(texts)
        return self._tokenizer(texts, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def phase_prepare(folder: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from megatrain.data import prepare_data
    from megatrain.package_assets import demo_tokenizer_dir

    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(str(demo_tokenizer_dir())))
    start = time.perf_counter()
    data = prepare_data(_data_cfg(folder), tokenizer)
    seconds = time.perf_counter() - start
    corpus_bytes = sum(p.stat().st_size for p in (folder / "shards").iterdir())
    cache_bytes = sum(p.stat().st_size for p in (folder / "cache").rglob("*") if p.is_file())
    return {
        "seconds": round(seconds, 1),
        "corpus_gb": round(corpus_bytes / 1e9, 3),
        "cache_gb": round(cache_bytes / 1e9, 3),
        "documents": len(data.train),
        "tokens": data.train.num_tokens,  # type: ignore[union-attr]
        "texts_tokenized": tokenizer.texts,
        "mb_per_s": round(corpus_bytes / 1e6 / seconds, 1),
    }


def phase_train(folder: Path) -> dict[str, Any]:
    from megatrain.config import load_config
    from megatrain.recipes.sft import Trainer

    cfg = load_config(
        DEMO_YAML,
        [
            "--training.output_dir", str(folder / "run"),
            "--logging.progress_bar", "false",
            "--logging.report_to", "none",
            "--data.stage", "pt",
            "--data.dataset", "corpus",
            "--data.dataset_dir", str(folder),
            "--data.cache_dir", str(folder / "cache"),
            "--data.packing", "false",
            "--data.val_size", "0",
            "--training.micro_batch_size", "4",
            "--training.max_steps", "5",
            "--checkpoint.export_hf", "false",
        ],
    )  # fmt: skip
    start = time.perf_counter()
    trainer = Trainer(cfg)
    setup_s = time.perf_counter() - start
    try:
        losses = trainer.train().losses
    finally:
        trainer.close()
    return {
        "setup_seconds": round(setup_s, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "rows_per_epoch": trainer.loader.num_rows,
        "losses": [round(x, 4) for x in losses],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.05, help="corpus size in GB (1e9 bytes)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/megatrain_pt_corpus"))
    parser.add_argument("--phase", choices=["tokenize", "reprepare", "train"])
    args = parser.parse_args()
    if args.phase:  # a child process: one phase, one JSON line with its own peak RSS
        run = phase_train if args.phase == "train" else phase_prepare
        result = run(args.dir)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"phase": args.phase, **result, "peak_rss_mib": peak_kib // 1024}))
        return
    if not (args.dir / "dataset_info.json").exists():
        start = time.perf_counter()
        generate(args.dir, int(args.gb * 1e9))
        print(json.dumps({"phase": "generate", "seconds": round(time.perf_counter() - start, 1)}))
    for phase in ("tokenize", "reprepare", "train"):
        out = subprocess.run(
            [sys.executable, __file__, "--dir", str(args.dir), "--phase", phase],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
