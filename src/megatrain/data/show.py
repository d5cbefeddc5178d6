"""How `megatrain data --show` prints: a row's JSON form, decoded text with its supervised runs
marked, and the summary. Shared by command.py (stages sft, pt) and preference_command.py (dpo,
kto), which it imports neither of."""

from __future__ import annotations

from typing import Any

from megatrain.batch import IGNORE_INDEX, Batch

OPEN_MARK, CLOSE_MARK = "[[", "]]"
LEGEND = (
    f"marks: {OPEN_MARK} {CLOSE_MARK} around the supervised tokens (the loss is taken on them; "
    "the rest is context), <pad x N> for padding (neither attended to nor supervised)"
)


def json_row(batch: Batch, r: int) -> dict[str, Any]:
    """Row `r` of `batch` as the JSON form prints it (lists; attention_mask None when packed)."""
    assert batch.position_ids is not None
    mask = batch.attention_mask
    return {
        "input_ids": batch.input_ids[r].tolist(),
        "labels": batch.labels[r].tolist(),
        "position_ids": batch.position_ids[r].tolist(),
        "attention_mask": None if mask is None else mask[r].tolist(),
    }


def marked_text(ids: list[int], labels: list[int], tokenizer: Any) -> str:
    """Decoded text, supervised runs wrapped in OPEN_MARK ... CLOSE_MARK."""
    parts, run_start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] != IGNORE_INDEX) != (labels[run_start] != IGNORE_INDEX):
            text = tokenizer.decode(ids[run_start:i])
            supervised = labels[run_start] != IGNORE_INDEX
            parts.append(f"{OPEN_MARK}{text}{CLOSE_MARK}" if supervised else text)
            run_start = i
    return "".join(parts)


def describe_summary(summary: dict[str, Any]) -> str:
    """The human form of the command's summary (its JSON form is `summary` itself)."""
    lines = ["=== summary ==="]
    for split in ("train", "eval"):
        part = summary[split]
        if part is not None:
            unit = next(iter(part))  # documents, samples, pairs or rows
            lines.append(
                f"{split}: {part[unit]} {unit}, {part['tokens']} tokens, "
                f"{part['supervised_tokens']} supervised tokens"
                + (f", {part['images']} images" if part.get("images") else "")
            )
    for key in ("preparation", "eval_preparation"):
        prep = summary[key]
        if prep is not None:
            dropped = sum(prep["dropped"].values())
            reasons = ", ".join(f"{k}={v}" for k, v in prep["dropped"].items()) or "none"
            lines.append(
                f"{key.replace('_', ' ')}: {prep['rows_read']} rows read, {prep['kept']} kept, "
                f"{dropped} dropped ({reasons}), {prep['truncated']} truncated"
            )
    ld = summary["loader"]
    fill = "" if ld["packed_fill"] is None else f", rows {ld['packed_fill']:.1%} filled"
    layout = f"packing={ld['packing']}"
    if ld["tokens_dropped"] is not None:
        layout = f"stage pt, neat_packing={ld['neat_packing']}"
        fill = (
            f", {ld['supervised_tokens_per_epoch']} supervised tokens per epoch, "
            f"{ld['tokens_dropped']} tokens after the last full row not trained on"
        )
    lines.append(
        f"loader: {layout}, seq_len {ld['seq_len']}, micro-batch "
        f"{ld['micro_batch_size']}, {ld['rows_per_epoch']} {ld.get('unit', 'rows')} = "
        f"{ld['micro_batches_per_epoch']} micro-batches per epoch{fill}"
    )
    return "\n".join([*lines, LEGEND]) + "\n"
