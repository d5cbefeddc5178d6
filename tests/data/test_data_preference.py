"""Preference data (data.stage dpo / kto): rows as LLaMA-Factory registers them, rendered by the
tokenizer's own chat template, truncated as TRL does (prompt kept, completions cut), batched two
rows per pair.

The reference of every rendering is `tokenizer.apply_chat_template(..., tokenize=True)` on the
message list written out by hand: prompt tokens = the prompt turns with the generation prompt,
each row = the prompt turns + its completion; supervised = the row's tokens after the prompt's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data_fixtures.helpers import demo_tokenizer, write_rows
from megatrain.batch import IGNORE_INDEX
from megatrain.cli import main
from megatrain.data import DataConfig, prepare_data
from megatrain.data.preference import PairSample
from megatrain.data.preference_data import PairLoader, kto_pairs, prepare_preference

SYSTEM = "You answer briefly."
HISTORY = [["Hi.", "Hello."]]
SHAREGPT_PAIR = {
    "conversations": [
        {"from": "system", "value": SYSTEM},
        {"from": "human", "value": "Name a colour."},
        {"from": "gpt", "value": "Blue."},
        {"from": "human", "value": "Another one?"},
    ],
    "chosen": {"from": "gpt", "value": "Red, like a ripe tomato."},
    "rejected": {"from": "gpt", "value": "No."},
}
ALPACA_PAIR = {
    "instruction": "Add the numbers.",
    "input": "2 3",
    "chosen": "5",
    "rejected": "23, the digits side by side",
    "system": SYSTEM,
    "history": HISTORY,
}
REGISTRY = {
    "pairs_sharegpt": {
        "file_name": "pairs_sharegpt.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
    "pairs_alpaca": {
        "file_name": "pairs_alpaca.jsonl",
        "ranking": True,
        "columns": {
            **{"prompt": "instruction", "query": "input", "chosen": "chosen"},
            **{"rejected": "rejected", "system": "system", "history": "history"},
        },
    },
    "kto_openai": {
        "file_name": "kto.csv",
        "formatting": "openai",
        "columns": {"messages": "messages", "kto_tag": "label"},
    },
}
PROMPT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
ALPACA_PROMPT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Add the numbers.\n2 3"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_rows(tmp_path / "pairs_sharegpt.json", [SHAREGPT_PAIR, {**SHAREGPT_PAIR, "chosen": 3}])
    write_rows(tmp_path / "pairs_alpaca.jsonl", [ALPACA_PAIR, {**ALPACA_PAIR, "chosen": ""}])
    kto = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]
    rows = [{"messages": json.dumps(kto), "label": label} for label in ("true", "False", "maybe")]
    write_rows(tmp_path / "kto.csv", rows)
    (tmp_path / "dataset_info.json").write_text(json.dumps(REGISTRY))
    return tmp_path


def _ids(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) else out)


def _expected(tokenizer: Any, prompt: list[dict[str, str]], answer: str) -> tuple[list, int]:
    prompt_ids = _ids(tokenizer, prompt, True)
    full = _ids(tokenizer, [*prompt, {"role": "assistant", "content": answer}], False)
    assert full[: len(prompt_ids)] == prompt_ids
    return full, len(prompt_ids)


@pytest.mark.parametrize(
    ("name", "prompt", "answers"),
    [
        ("pairs_sharegpt", PROMPT, ("Red, like a ripe tomato.", "No.")),
        ("pairs_alpaca", ALPACA_PROMPT, ("5", "23, the digits side by side")),
    ],
)
def test_pairs_render_as_the_chat_template_does(
    name: str, prompt: list, answers: tuple[str, str], folder: Path, tokenizer: Any
) -> None:
    data = prepare_preference(
        DataConfig(dataset=name, dataset_dir=str(folder), stage="dpo"), tokenizer
    )
    # the second row's chosen is not a turn (sharegpt) or empty (alpaca): dropped, counted
    assert (data.stats.rows_read, data.stats.kept, data.stats.num_dropped) == (2, 1, 1)
    (pair,) = data.train
    assert isinstance(pair, PairSample)
    for sample, answer in zip(pair.samples, answers, strict=True):
        full, start = _expected(tokenizer, prompt, answer)
        assert sample.input_ids.tolist() == full
        assert sample.target_mask.tolist() == [False] * start + [True] * (len(full) - start)
    assert data.stats.num_tokens == sum(s.num_tokens for s in pair.samples)


def test_kto_rows_read_their_label(folder: Path, tokenizer: Any) -> None:
    data = prepare_preference(
        DataConfig(dataset="kto_openai", dataset_dir=str(folder), stage="kto"), tokenizer
    )
    assert [r.desirable for r in data.train] == [True, False]  # type: ignore[union-attr]
    assert data.stats.dropped == {"malformed_row": 1}  # "maybe" is no boolean


def test_truncation_keeps_the_prompt_and_cuts_the_completions(folder: Path, tokenizer: Any) -> None:
    full_chosen, start = _expected(tokenizer, PROMPT, "Red, like a ripe tomato.")
    full_rejected, _ = _expected(tokenizer, PROMPT, "No.")
    cutoff = start + 3
    assert len(full_rejected) > cutoff  # both completions are cut
    cfg = DataConfig(
        dataset="pairs_sharegpt", dataset_dir=str(folder), stage="dpo", cutoff_len=cutoff
    )
    data = prepare_preference(cfg, tokenizer)
    (pair,) = data.train
    assert pair.chosen.input_ids.tolist() == full_chosen[:cutoff]  # type: ignore[union-attr]
    assert pair.rejected.input_ids.tolist() == full_rejected[:cutoff]  # type: ignore[union-attr]
    assert data.stats.truncated == 1 and pair.chosen.num_target_tokens == 3  # type: ignore[union-attr]
    # no completion token fits: the pair is dropped as over cutoff_len, not trained on a prompt
    cfg = DataConfig(
        dataset="pairs_sharegpt", dataset_dir=str(folder), stage="dpo", cutoff_len=start
    )
    with pytest.raises(ValueError, match="over_cutoff_len=1"):
        prepare_preference(cfg, tokenizer)
    cfg = DataConfig(**{**cfg.__dict__, "cutoff_len": cutoff, "overflow": "drop"})
    with pytest.raises(ValueError, match="over_cutoff_len=1"):
        prepare_preference(cfg, tokenizer)


def test_a_micro_batch_holds_whole_pairs(tmp_path: Path, tokenizer: Any) -> None:
    rows = []
    for i in range(5):
        rows.append({**ALPACA_PAIR, "chosen": f"{i} " * (i + 1), "rejected": f"no {i}"})
    write_rows(tmp_path / "pairs_alpaca.jsonl", rows)
    (tmp_path / "dataset_info.json").write_text(json.dumps(REGISTRY))
    cfg = DataConfig(dataset="pairs_alpaca", dataset_dir=str(tmp_path), stage="dpo")
    pairs = prepare_preference(cfg, tokenizer).train
    loader = PairLoader(
        pairs,  # type: ignore[arg-type]
        micro_batch_size=2,
        seq_len=256,
        pad_token_id=0,
        pad_to_multiple_of=8,
        shuffle=True,
        seed=1,
    )
    seen = []
    for batch in loader:
        assert batch.input_ids.shape[0] in (2, 4) and batch.input_ids.shape[1] % 8 == 0
        for k in range(batch.input_ids.shape[0] // 2):
            chosen, rejected = batch.input_ids[2 * k], batch.input_ids[2 * k + 1]
            match = [i for i, p in enumerate(pairs) if _row_is(p.chosen, chosen)]  # type: ignore[union-attr]
            assert len(match) == 1 and _row_is(pairs[match[0]].rejected, rejected)  # type: ignore[union-attr]
            labels = batch.labels[2 * k]
            assert int((labels != IGNORE_INDEX).sum()) == int(
                pairs[match[0]].chosen.target_mask.sum()
            )  # type: ignore[union-attr]
            seen.append(match[0])
    assert sorted(seen) == list(range(5)) and seen != list(range(5))  # every pair, shuffled
    assert len(loader) == 3 and loader.state_dict()["epoch"] == 1


def _row_is(sample: Any, ids: Any) -> bool:
    n = sample.num_tokens
    return bool(np.array_equal(ids[:n].numpy(), sample.input_ids)) and bool((ids[n:] == 0).all())


def test_stages_and_data_must_match(folder: Path, tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"holds preference pairs .* set data.stage: dpo"):
        prepare_data(DataConfig(dataset="pairs_alpaca", dataset_dir=str(folder)), tokenizer)
    with pytest.raises(ValueError, match=r"holds KTO rows .* set data.stage: kto"):
        cfg = DataConfig(dataset="kto_openai", dataset_dir=str(folder), stage="dpo")
        prepare_preference(cfg, tokenizer)
    with pytest.raises(ValueError, match=r"data.packing=True does not apply to data.stage: dpo"):
        DataConfig(dataset="pairs_alpaca", stage="dpo", packing=True).validate()


def test_data_show_renders_prompt_chosen_and_rejected(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
    argv = ["--data.dataset", "pairs_sharegpt", "--data.dataset_dir", str(folder)]
    argv += ["--data.stage", "dpo", "--data.packing", "false", "--data.val_size", "0"]
    assert main(["data", "--config", str(demo), *argv, "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== pair 0 (stage dpo) ===\n--- prompt, ")
    assert out.count("Name a colour.") == 1  # the prompt once, for both rows
    assert "[[Red, like a ripe tomato.<|im_end|>\n]]<pad x " in out
    assert "--- rejected, " in out and "[[No.<|im_end|>\n]]" in out
    assert "train: 1 pairs," in out and "1 pairs = 1 micro-batches per epoch" in out
    assert "\nstage dpo\n" not in out and ">\n=== summary ===\n" in out  # no stray line
    assert main(["data", "--config", str(demo), *argv, "--show", "1", "--json"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["stage"] == "dpo" and set(first) == {"stage", "chosen", "rejected"}
    chosen, rejected = first["chosen"], first["rejected"]
    start = chosen["labels"].index(next(x for x in chosen["labels"] if x != IGNORE_INDEX))
    assert chosen["input_ids"][:start] == rejected["input_ids"][:start]


def test_kto_rows_pair_with_their_kl_rows(tmp_path: Path, tokenizer: Any) -> None:
    rows = []
    for i, (label, answer) in enumerate([(True, "zero"), (False, "A"), (True, "AA")]):
        turns = [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": answer}]
        rows.append({"messages": turns, "label": label})
    write_rows(tmp_path / "kto.json", rows)
    (tmp_path / "dataset_info.json").write_text(
        json.dumps({"k": REGISTRY["kto_openai"] | {"file_name": "kto.json"}})
    )
    cfg = DataConfig(dataset="k", dataset_dir=str(tmp_path), stage="kto", cutoff_len=64)
    data = prepare_preference(cfg, tokenizer)
    pairs, desirable = kto_pairs(data.train, cutoff_len=64)  # type: ignore[arg-type]
    assert desirable.tolist() == [True, False, True]
    for i, pair in enumerate(pairs):
        prompt = [{"role": "user", "content": f"Q{i}"}]
        answer = rows[i - 1]["messages"][1]["content"]  # the previous row's completion
        full, start = _expected(tokenizer, prompt, answer)
        assert pair.rejected.input_ids.tolist() == full
        assert pair.rejected.target_mask.tolist() == [False] * start + [True] * (len(full) - start)
        assert pair.chosen is data.train[i].sample  # type: ignore[union-attr]
    short, _ = kto_pairs(data.train, cutoff_len=pairs[1].rejected.num_tokens - 2)  # type: ignore[arg-type]
    assert (
        short[1].rejected.truncated
        and short[1].rejected.num_tokens == pairs[1].rejected.num_tokens - 2
    )


def test_a_dropped_pair_is_located(
    folder: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = DataConfig(dataset="pairs_alpaca", dataset_dir=str(folder), stage="dpo", val_size=0)
    assert len(prepare_preference(cfg, tokenizer).train) == 1
    (line,) = [r.getMessage() for r in caplog.records if "pairs_alpaca.jsonl" in r.getMessage()]
    assert line.startswith(f"data set pairs_alpaca ({folder / 'pairs_alpaca.jsonl'}): rows 2")
    assert line.endswith("; first dropped: row 2 (empty_content)")
