"""`megatrain data --config FILE --show N [--json]`: look at what the model will be trained on.

Prints the first N rows of the first training epoch exactly as the loader yields them (after
chat template, masking, truncation, shuffle and packing), then a summary of the preparation.

Stage dpo / kto: preference_command.py prints pairs (or labelled rows) instead.

Human form: one block per row; each sample of the row is decoded with its supervised tokens
(labels != -100) wrapped in `[[` and `]]`, and padding shown as `<pad x N>`. Stage pt rows are
cut from the document stream: one segment per row, or one per document piece with neat_packing;
the eos between documents shows as the tokenizer decodes it.
JSON form (`--json`): one object per line, {"input_ids", "labels", "position_ids",
"attention_mask"} lists of a row (attention_mask null for packed rows), then a last line
{"summary": {...}}, so the output parses line by line.

Rows with images: each sample line says how many images it holds, then one line per image: its
path, its size as the processor sees it (W x H, after data.image_max_pixels/min_pixels) and its
token count; runs of the image token show as `<|image_pad|> x N`. JSON rows add "images":
[{"path", "width", "height", "tokens"}] in the order of their tokens.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, TextIO

from megatrain.data.config import PREFERENCE_STAGES, DataConfig
from megatrain.data.loader import BatchLoader
from megatrain.data.loaders import make_loader
from megatrain.data.pipeline import PreparedData, prepare_data
from megatrain.data.preference_command import run_preference_command
from megatrain.data.pretrain import PretrainCorpus
from megatrain.data.pretrain_loader import PretrainLoader
from megatrain.data.sample import Sample
from megatrain.data.show import describe_summary, json_row, marked_text
from megatrain.data.vision import VisionProcessor


def run_data_command(
    cfg: DataConfig,
    tokenizer: Any,
    *,
    show: int,
    as_json: bool,
    seq_len: int,
    micro_batch_size: int,
    out: TextIO,
    processor: str | None = None,
) -> int:
    """Print `show` rows of epoch 0 and the data summary to `out`; the exit status.
    `processor`: the model's folder or hub id, for data sets with images."""
    if isinstance(show, bool) or not isinstance(show, int) or show < 0:
        raise ValueError(
            f"--show {show}: the number of rows to print must be 0 or more (0: the summary only)"
        )
    if cfg.stage in PREFERENCE_STAGES:
        return run_preference_command(
            cfg,
            tokenizer,
            show=show,
            as_json=as_json,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            out=out,
        )
    data = prepare_data(cfg, tokenizer, processor=processor)
    loader = make_loader(
        data.train,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        packing=cfg.packing,
        pad_token_id=data.pad_token_id,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        pad_to_multiple_of=cfg.pad_to_multiple_of,
        vision=data.vision,
    )
    shown = 0
    for batch in loader:
        for r in range(batch.input_ids.shape[0]):
            if shown == show:
                break
            row = json_row(batch, r)
            images = _row_images(loader, shown, data.vision)
            if as_json:
                out.write(json.dumps(row | ({"images": images} if images else {})) + "\n")
            else:
                text = _describe_row(row, shown, tokenizer, data.pad_token_id)
                out.write(_with_images(text, images, data.vision))
            shown += 1
        if shown == show:
            break
    summary = _summary(data, loader)
    if as_json:
        out.write(json.dumps({"summary": summary}) + "\n")
    else:
        out.write(describe_summary(summary))
    return 0


def _row_images(
    loader: BatchLoader, index: int, vision: VisionProcessor | None
) -> list[dict[str, Any]]:
    """The images of row `index` of epoch 0, in the order of their tokens."""
    if vision is None or isinstance(loader, PretrainLoader):
        return []
    picked = int(loader.epoch_order(0)[index])
    members = loader.rows[picked] if loader.rows is not None else [picked]
    images = []
    for sample in (loader.samples[i] for i in members):
        for path, tokens in zip(sample.images, sample.image_tokens, strict=True):
            width, height = vision.image_size(path)
            images.append({"path": path, "width": width, "height": height, "tokens": tokens})
    return images


def _with_images(text: str, images: list[dict[str, Any]], vision: VisionProcessor | None) -> str:
    """The row's text with image token runs compacted, and after each sample's header its image
    count and a line per image."""
    if vision is None:
        return text
    token = re.escape(vision.image_token)
    text = re.sub(f"(?:{token}){{2,}}", lambda m: _run(m.group(0), vision.image_token), text)
    out, queue = [], list(images)
    for block in re.split(r"(?m)^(?=--- sample)", text):
        runs = len(re.findall(f"{token}(?: x \\d+)?", block))
        if not block.startswith("--- sample") or not runs:
            out.append(block)
            continue
        header, _, body = block.partition("\n")
        lines = [header, f"{runs} image(s):"]
        lines += [
            f"  {image['path']}: {image['width']} x {image['height']} pixels, "
            f"{image['tokens']} tokens"
            for image in queue[:runs]
        ]
        queue = queue[runs:]
        out.append("\n".join(lines) + "\n" + body)
    return "".join(out)


def _run(run: str, token: str) -> str:
    return f"{token} x {run.count(token)}"


def _segments(row: dict[str, Any], pad_token_id: int) -> list[tuple[int, int, bool]]:
    """(start, end, is_padding) spans: samples split where positions restart, then padding."""
    ids, positions, mask = row["input_ids"], row["position_ids"], row["attention_mask"]
    if mask is not None:
        real = sum(mask)
        return [(0, real, False)] + ([(real, len(mask), True)] if real < len(mask) else [])
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    spans = [(a, b, False) for a, b in itertools.pairwise(starts)]
    tail_start = spans[-1][0]
    if len(spans) > 1 and all(x == pad_token_id for x in ids[tail_start:]):
        spans[-1] = (tail_start, len(ids), True)
    return spans


def _describe_row(row: dict[str, Any], index: int, tokenizer: Any, pad_token_id: int) -> str:
    segments = _segments(row, pad_token_id)
    samples = sum(not is_pad for _, _, is_pad in segments)  # padding is no segment of the row
    lines = [f"=== row {index}: {len(row['input_ids'])} tokens, {samples} segment(s) ==="]
    for start, end, is_pad in segments:
        if is_pad:
            lines.append(f"<pad x {end - start}>")
            continue
        ids, labels = row["input_ids"][start:end], row["labels"][start:end]
        lines.append(f"--- sample at position {start}, {end - start} tokens ---")
        lines.append(marked_text(ids, labels, tokenizer))
    return "\n".join(lines) + "\n"


def _split_summary(samples: list[Sample] | PretrainCorpus | None) -> dict[str, int] | None:
    if samples is None:
        return None
    if isinstance(samples, PretrainCorpus):  # raw text: every token is a label
        n = samples.num_tokens
        return {"documents": len(samples), "tokens": n, "supervised_tokens": n}
    images = sum(len(s.images) for s in samples)
    return {
        "samples": len(samples),
        "tokens": sum(s.num_tokens for s in samples),
        "supervised_tokens": sum(s.num_target_tokens for s in samples),
    } | ({"images": images} if images else {})


def _summary(data: PreparedData, loader: BatchLoader) -> dict[str, Any]:
    slots = loader.num_rows * loader.seq_len if loader.packing else None
    pt = loader if isinstance(loader, PretrainLoader) else None
    if pt is not None:  # rows are cut full from the stream
        real = loader.num_rows * loader.seq_len
    else:
        assert not isinstance(data.train, PretrainCorpus)
        real = sum(s.num_tokens for s in data.train)
    return {
        "train": _split_summary(data.train),
        "eval": _split_summary(data.eval),
        "preparation": data.stats.to_dict(),
        "eval_preparation": None if data.eval_stats is None else data.eval_stats.to_dict(),
        "loader": {
            "packing": loader.packing,
            "seq_len": loader.seq_len,
            "micro_batch_size": loader.micro_batch_size,
            "rows_per_epoch": loader.num_rows,
            "micro_batches_per_epoch": len(loader),
            "packed_fill": None if slots is None else round(real / slots, 4),
            "neat_packing": None if pt is None else pt.neat_packing,
            "supervised_tokens_per_epoch": None if pt is None else pt.supervised_tokens_per_epoch(),
            "tokens_dropped": None if pt is None else pt.tokens_dropped,
        },
    }
