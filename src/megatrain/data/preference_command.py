"""`megatrain data --show N` for data.stage dpo / kto: the first N pairs (or KTO rows) of epoch 0.

Human form: one block per pair, headed by the stage; the prompt decoded once (it is the same
tokens in both rows), then the chosen and the rejected completion each decoded with its
supervised tokens in `[[` `]]` and its padding in the micro-batch as `<pad x N>`. KTO: one block
per row, its label named. JSON form (`--json`): one object per line, {"stage", "chosen",
"rejected"} (dpo) or {"stage", "desirable", "row"} (kto), each row as the sft form writes it
(input_ids, labels, position_ids, attention_mask), then {"summary": {...}}.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TextIO

from megatrain.batch import IGNORE_INDEX
from megatrain.data.config import DataConfig
from megatrain.data.loader import BatchLoader
from megatrain.data.loaders import make_loader
from megatrain.data.preference import KTOSample, PairSample
from megatrain.data.preference_data import PairLoader, PreferenceData, prepare_preference
from megatrain.data.show import describe_summary, json_row, marked_text


def run_preference_command(
    cfg: DataConfig,
    tokenizer: Any,
    *,
    show: int,
    as_json: bool,
    seq_len: int,
    micro_batch_size: int,
    out: TextIO,
) -> int:
    """Print `show` pairs (rows for kto) of epoch 0 and the data summary to `out`."""
    data = prepare_preference(cfg, tokenizer)
    # micro_batch_size counts rows, as `megatrain dpo` reads it: half of them are pairs (dpo), or
    # labelled rows (kto; the other half their KL rows)
    options: dict[str, Any] = dict(
        micro_batch_size=max(1, micro_batch_size // 2),
        seq_len=seq_len,
        pad_token_id=data.pad_token_id,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
    )
    loader: BatchLoader
    if data.stage == "dpo":
        loader = PairLoader([p for p in data.train if isinstance(p, PairSample)], **options)
    else:
        rows = [r.sample for r in data.train if isinstance(r, KTOSample)]
        loader = make_loader(rows, packing=False, **options)
    for index, item in enumerate(_items(data, loader)):
        if index == show:
            break
        if as_json:
            out.write(json.dumps({"stage": data.stage, **item}) + "\n")
        else:
            out.write(_describe(item, index, data.stage, tokenizer))
    summary = _summary(data, loader)
    if as_json:
        out.write(json.dumps({"summary": summary}) + "\n")
    else:
        out.write(describe_summary(summary))
    return 0


def _items(data: PreferenceData, loader: BatchLoader) -> Iterator[dict[str, Any]]:
    """Epoch 0's pairs ({"chosen", "rejected"}) or KTO rows ({"desirable", "row"}), in order."""
    order = iter(loader.epoch_order(loader.epoch))
    for batch in loader:
        if data.stage == "dpo":
            for k in range(batch.input_ids.shape[0] // 2):
                yield {"chosen": json_row(batch, 2 * k), "rejected": json_row(batch, 2 * k + 1)}
            continue
        for r in range(batch.input_ids.shape[0]):
            kto = data.train[int(next(order))]
            assert isinstance(kto, KTOSample)
            yield {"desirable": kto.desirable, "row": json_row(batch, r)}


def _describe(item: dict[str, Any], index: int, stage: str, tokenizer: Any) -> str:
    rows = [("chosen", item["chosen"]), ("rejected", item["rejected"])] if stage == "dpo" else []
    if stage == "kto":
        label = "desirable" if item["desirable"] else "undesirable"
        rows = [(f"completion ({label})", item["row"])]
    first = rows[0][1]
    start = next(i for i, x in enumerate(first["labels"]) if x != IGNORE_INDEX)
    head = f"=== {'pair' if stage == 'dpo' else 'row'} {index} (stage {stage}) ==="
    lines = [head, f"--- prompt, {start} tokens ---", tokenizer.decode(first["input_ids"][:start])]
    for name, row in rows:
        real = sum(row["attention_mask"])
        ids, labels = row["input_ids"][start:real], row["labels"][start:real]
        supervised = sum(x != IGNORE_INDEX for x in labels)
        lines.append(f"--- {name}, {real - start} tokens, {supervised} supervised ---")
        pad = len(row["input_ids"]) - real
        lines.append(marked_text(ids, labels, tokenizer) + (f"<pad x {pad}>" if pad else ""))
    return "\n".join(lines) + "\n"


def _summary(data: PreferenceData, loader: BatchLoader) -> dict[str, Any]:
    def split(items: list[Any] | None) -> dict[str, int] | None:
        if items is None:
            return None
        samples = [s for item in items for s in item.samples]
        return {
            ("pairs" if data.stage == "dpo" else "rows"): len(items),
            "tokens": sum(s.num_tokens for s in samples),
            "supervised_tokens": sum(s.num_target_tokens for s in samples),
        }

    return {
        "stage": data.stage,
        "train": split(data.train),
        "eval": split(data.eval),
        "preparation": data.stats.to_dict(),
        "eval_preparation": None if data.eval_stats is None else data.eval_stats.to_dict(),
        "loader": {
            "packing": False,
            "unit": "pairs" if data.stage == "dpo" else "rows",
            "seq_len": loader.seq_len,
            "micro_batch_size": loader.micro_batch_size,
            "rows_per_epoch": loader.num_rows,
            "micro_batches_per_epoch": len(loader),
            "packed_fill": None,
            "tokens_dropped": None,
        },
    }
