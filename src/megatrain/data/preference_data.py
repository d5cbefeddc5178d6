"""The preference data pipeline (data.stage dpo / kto): data sets -> pairs or KTO rows -> batches.

Per data set, as pipeline.py does for sft: read the rows, apply `num_samples` and `max_samples`,
convert and render each row (preference.py); a data set whose rows are not of the stage's kind
is refused by name before any row is read. The evaluation set is `eval_dataset` or a seeded
`val_size` split of the pairs (rows for KTO), never separating the two rows of a pair.

Batches (`PairLoader`): a micro-batch of P pairs is one padded `Batch` of 2P rows, row 2k the
chosen and row 2k + 1 the rejected completion of pair k, so every layer streams once per pair
and the loss pairs rows by index. The shuffle permutes pairs, never rows. KTO rows ride the
same loader (`kto_pairs`): row 2k a labelled row, row 2k + 1 its KL row (TRL's KL data set).

Invariant, as for sft: every row read is kept or counted under exactly one drop reason
(`stats.rows_read == stats.kept + stats.num_dropped`); a kept pair counts once in `kept`, its
two rows' tokens in the token counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.batch import Batch
from megatrain.data.config import DataConfig
from megatrain.data.loader import BatchLoader
from megatrain.data.packing import padded_batch
from megatrain.data.pipeline import (
    nothing_left,
    over_cutoff_hint,
    pad_token_id_of,
    read_dataset,
)
from megatrain.data.preference import (
    KTOSample,
    PairSample,
    check_stage,
    convert_kto,
    convert_pair,
    encode_kto,
    encode_pair,
)
from megatrain.data.registry import DatasetSpec, resolve_datasets
from megatrain.data.sample import DataStats, Sample, held_out_mask
from megatrain.data.template import ChatEncoder
from megatrain.package_assets import demo_assets_dir

logger = logging.getLogger(__name__)

PreferenceRow = PairSample | KTOSample


@dataclass
class PreferenceData:
    train: list[PreferenceRow]  # PairSample for dpo, KTOSample for kto
    eval: list[PreferenceRow] | None
    stats: DataStats
    eval_stats: DataStats | None
    pad_token_id: int
    stage: str


def prepare_preference(cfg: DataConfig, tokenizer: Any) -> PreferenceData:
    """Read, convert, render and split the preference data sets of `cfg` with `tokenizer`."""
    cfg.validate()
    dataset_dir = Path(cfg.dataset_dir).expanduser() if cfg.dataset_dir else demo_assets_dir()
    encoder = ChatEncoder(
        tokenizer,
        cutoff_len=cfg.cutoff_len,
        overflow=cfg.overflow,
        min_target_tokens=cfg.min_target_tokens,
        default_system=cfg.system_prompt,
        chat_template=cfg.chat_template,
    )
    options: dict[str, Any] = dict(stage=cfg.stage, max_samples=cfg.max_samples, seed=cfg.seed)
    specs = resolve_datasets(cfg.dataset_names(), dataset_dir)
    train, stats = load_preference(specs, encoder, **options)
    eval_rows: list[PreferenceRow] | None = None
    eval_stats: DataStats | None = None
    if cfg.eval_dataset_names():
        eval_specs = resolve_datasets(cfg.eval_dataset_names(), dataset_dir)
        eval_rows, eval_stats = load_preference(eval_specs, encoder, **options)
    if not train:
        raise nothing_left(f"training {'pair' if cfg.stage == 'dpo' else 'row'}", cfg, stats, specs)
    if not cfg.eval_dataset_names() and cfg.val_size > 0:
        held_out = held_out_mask(len(train), val_size=cfg.val_size, seed=cfg.seed, unit="rows")
        eval_rows = [r for r, h in zip(train, held_out, strict=True) if h]
        train = [r for r, h in zip(train, held_out, strict=True) if not h]
    pad = pad_token_id_of(tokenizer)
    return PreferenceData(train, eval_rows, stats, eval_stats, pad, cfg.stage)


def load_preference(
    specs: list[DatasetSpec],
    encoder: ChatEncoder,
    *,
    stage: str,
    max_samples: int | None,
    seed: int,
) -> tuple[list[PreferenceRow], DataStats]:
    """The pairs (dpo) or KTO rows (kto) of `specs`, concatenated, and their statistics."""
    for spec in specs:
        check_stage(spec, stage)
    out: list[PreferenceRow] = []
    total = DataStats()
    for spec in specs:
        stats = DataStats()
        for row in read_dataset(spec, seed=seed)[:max_samples]:
            stats.rows_read += 1
            kept = _encode_row(row, spec, encoder, stage)
            if isinstance(kept, str):
                stats.drop(kept, row=stats.rows_read)
                continue
            stats.keep_group(kept.samples)
            out.append(kept)
        hint = over_cutoff_hint(stats, encoder, encoder.take_longest_over_cutoff())
        hint += f"; first dropped: {stats.first_drop}" if stats.first_drop else ""
        log = logger.warning if stats.dropped else logger.info
        log("data set %s (%s): %s%s", spec.name, spec.path, stats.describe(), hint)
        total.add(stats)
    return out, total


def _encode_row(
    row: dict[str, Any], spec: DatasetSpec, encoder: ChatEncoder, stage: str
) -> PreferenceRow | str:
    if stage == "dpo":
        pair = convert_pair(row, spec)
        return pair if isinstance(pair, str) else encode_pair(encoder, pair)
    labelled = convert_kto(row, spec)
    return labelled if isinstance(labelled, str) else encode_kto(encoder, labelled)


def kto_pairs(rows: list[KTOSample], *, cutoff_len: int) -> tuple[list[PairSample], np.ndarray]:
    """KTO rows as PairLoader pairs (row i, its KL row) and the rows' labels (bool [N]).

    Row i's KL row is its prompt followed by row i - 1's completion (cyclically), cut to
    `cutoff_len`: TRL's KL data set (completions shifted by one), fixed here once so that its
    reference log-probs can be precomputed like a pair's."""
    out = []
    for i, row in enumerate(rows):
        other = rows[i - 1].sample
        prompt_len = int(np.argmax(row.sample.target_mask))
        completion = other.input_ids[int(np.argmax(other.target_mask)) :]
        ids = np.concatenate([row.sample.input_ids[:prompt_len], completion])[:cutoff_len]
        mask = np.arange(len(ids)) >= prompt_len
        kl_row = Sample(ids, mask, truncated=len(ids) < prompt_len + len(completion))
        out.append(PairSample(row.sample, kl_row))
    return out, np.array([r.desirable for r in rows], dtype=np.bool_)


class PairLoader(BatchLoader):
    """BatchLoader of preference pairs: `micro_batch_size` pairs per micro-batch, 2 rows each
    (chosen at even rows, rejected at odd rows); epochs, shuffle and resume as BatchLoader's."""

    def __init__(
        self,
        pairs: list[PairSample],
        *,
        micro_batch_size: int,
        seq_len: int,
        pad_token_id: int,
        pad_to_multiple_of: int,
        shuffle: bool,
        seed: int,
    ) -> None:
        if not pairs:
            raise ValueError("no preference pairs to load; see the data statistics")
        longest = max(max(p.chosen.num_tokens, p.rejected.num_tokens) for p in pairs)
        if longest > seq_len:
            raise ValueError(
                f"a pair has a row of {longest} tokens, more than seq_len={seq_len}; set "
                "data.cutoff_len <= seq_len"
            )
        rows = [s for p in pairs for s in (p.chosen, p.rejected)]
        super().__init__(
            rows,
            rows=None,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
            shuffle=shuffle,
            seed=seed,
        )

    @property
    def num_rows(self) -> int:
        """Pairs per epoch (the unit that is shuffled and counted in micro_batch_size)."""
        return len(self.samples) // 2

    def _make_batch(self, picked: np.ndarray) -> Batch:
        rows = [self.samples[2 * int(i) + side] for i in picked for side in (0, 1)]
        return padded_batch(
            rows,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            max_len=self.seq_len,
        )

    def batch_of(self, pairs: np.ndarray) -> Batch:
        """The micro-batch of the given pair indices (rows 2k, 2k + 1: pair pairs[k])."""
        return self._make_batch(pairs)

    def pairs_of(self, epoch: int, step: int) -> np.ndarray:
        """The pair indices of micro-batch `step` of `epoch`, in row order (the batch's rows 2k
        and 2k + 1 are pair [k]'s): how a step finds its pairs' precomputed reference."""
        b = self.micro_batch_size
        return self.epoch_order(epoch)[step * b : (step + 1) * b]

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "pairs": True}
