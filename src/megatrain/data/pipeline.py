"""The recipe of the data pipeline: `DataConfig` + tokenizer -> train/eval `Sample`s + statistics.

Per data set, in order: read the rows (local or hub), apply the registry's `num_samples` (a seeded
draw, with repetition when it exceeds the rows, as LLaMA-Factory does), keep the first
`max_samples`, convert each row (formats.py) and render it (template.py). Data sets are then
concatenated in the order given. The evaluation set is `eval_dataset` processed the same way, or
a seeded random `val_size` split of the processed training samples.

Stage pt (raw text) takes the same steps through pretrain.py instead: the data sets become one
`PretrainCorpus` (documents over cached token files) and `val_size` splits whole documents.

Images (an `images` column): each row's paths are resolved and its `<image>` placeholders
counted (data/vision.py, errors name the data set and row); the model's processor is loaded from
`processor` (the model's folder or hub id) at the first row with images, so text data never needs
one, and `PreparedData.vision` hands it to the loader.

Invariant: every row read is either kept or counted under exactly one drop reason, so
`stats.rows_read == stats.kept + stats.num_dropped`; nothing is dropped silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.data.config import PREFERENCE_STAGES, DataConfig
from megatrain.data.corpus import EMPTY_TEXT
from megatrain.data.formats import MISSING_COLUMN, Conversation, convert_row
from megatrain.data.preference import check_stage
from megatrain.data.pretrain import PretrainCorpus, load_corpus, split_corpus
from megatrain.data.readers import download_hub_dataset, iter_rows, read_rows
from megatrain.data.registry import DatasetSpec, resolve_datasets, sft_format_of
from megatrain.data.sample import DataStats, Sample, held_out_mask
from megatrain.data.template import IMAGE_OVER_CUTOFF, OVER_CUTOFF, TOO_FEW_TARGETS, ChatEncoder
from megatrain.data.vision import (
    VisionProcessor,
    check_placeholders,
    load_vision,
    resolve_image_paths,
)
from megatrain.package_assets import demo_assets_dir

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    train: list[Sample] | PretrainCorpus  # a PretrainCorpus for stage pt
    eval: list[Sample] | PretrainCorpus | None
    stats: DataStats  # the training data sets, before any val_size split
    eval_stats: DataStats | None  # the eval_dataset data sets, when given
    pad_token_id: int
    vision: VisionProcessor | None = None  # the model's image processing, when rows have images


def prepare_data(cfg: DataConfig, tokenizer: Any, *, processor: str | None = None) -> PreparedData:
    """Read, convert, render and split the data sets of `cfg` with `tokenizer`; `processor`: the
    model's folder or hub id, whose processor turns images into tokens (data with images)."""
    cfg.validate()
    dataset_dir = Path(cfg.dataset_dir).expanduser() if cfg.dataset_dir else demo_assets_dir()
    if cfg.dataset_dir and not dataset_dir.is_dir():
        raise FileNotFoundError(
            f"data.dataset_dir={cfg.dataset_dir!r}: no such folder; point it at the folder that "
            "holds dataset_info.json, or leave it unset for the built-in demo data"
        )
    if cfg.stage == "pt":
        return _prepare_pretrain(cfg, tokenizer, dataset_dir)
    if cfg.stage in PREFERENCE_STAGES:
        raise ValueError(
            f"data.stage: {cfg.stage} is preference data, which `megatrain train` does not train "
            "on (it trains sft and pt); `megatrain data --show N` renders it as trained"
        )
    encoder = ChatEncoder(
        tokenizer,
        cutoff_len=cfg.cutoff_len,
        overflow=cfg.overflow,
        train_on_prompt=cfg.train_on_prompt,
        min_target_tokens=cfg.min_target_tokens,
        default_system=cfg.system_prompt,
        chat_template=cfg.chat_template,
        multi_turn=cfg.multi_turn,
    )
    specs = resolve_datasets(cfg.dataset_names(), dataset_dir)
    for spec in specs:
        check_stage(spec, cfg.stage)
    options: dict[str, Any] = dict(max_samples=cfg.max_samples, seed=cfg.seed)
    options["vision"] = lambda: load_vision(
        processor, tokenizer, min_pixels=cfg.image_min_pixels, max_pixels=cfg.image_max_pixels
    )
    train, stats = load_samples(specs, encoder, **options)
    eval_samples: list[Sample] | None = None
    eval_stats: DataStats | None = None
    if cfg.eval_dataset_names():
        eval_specs = resolve_datasets(cfg.eval_dataset_names(), dataset_dir)
        eval_samples, eval_stats = load_samples(eval_specs, encoder, **options)
    if not train:
        raise nothing_left("training sample", cfg, stats, specs)
    if not cfg.eval_dataset_names() and cfg.val_size > 0:
        train, eval_samples = split_validation(train, val_size=cfg.val_size, seed=cfg.seed)
    pad_id = pad_token_id_of(tokenizer)
    return PreparedData(train, eval_samples, stats, eval_stats, pad_id, encoder.vision)


def _prepare_pretrain(cfg: DataConfig, tokenizer: Any, dataset_dir: Path) -> PreparedData:
    options: dict[str, Any] = dict(
        max_samples=cfg.max_samples,
        seed=cfg.seed,
        neat_packing=cfg.neat_packing,
        cache_dir=cfg.cache_dir,
    )
    specs = resolve_datasets(cfg.dataset_names(), dataset_dir, stage="pt")
    for spec in specs:
        if spec.images:
            raise ValueError(
                f"data set {spec.name!r} has an images column, which data.stage: pt (raw text) "
                "does not read; train it with data.stage: sft, or remove it from data.dataset"
            )
    train, stats = load_corpus(specs, tokenizer, **options)
    if not len(train):
        raise nothing_left("document", cfg, stats, specs, text_column=True)
    eval_corpus: PretrainCorpus | None = None
    eval_stats: DataStats | None = None
    if cfg.eval_dataset_names():
        eval_specs = resolve_datasets(cfg.eval_dataset_names(), dataset_dir, stage="pt")
        eval_corpus, eval_stats = load_corpus(eval_specs, tokenizer, **options)
    elif cfg.val_size > 0:
        train, eval_corpus = split_corpus(train, val_size=cfg.val_size, seed=cfg.seed)
    return PreparedData(train, eval_corpus, stats, eval_stats, pad_token_id_of(tokenizer))


def load_samples(
    specs: list[DatasetSpec],
    encoder: ChatEncoder,
    *,
    max_samples: int | None,
    seed: int,
    vision: Callable[[], VisionProcessor] | None = None,
) -> tuple[list[Sample], DataStats]:
    """The samples of `specs`, concatenated, and the statistics of all their rows. `vision`
    loads the model's processor, called at the first row with images (text data needs none)."""
    samples: list[Sample] = []
    total = DataStats()
    for spec in specs:
        stats = DataStats()
        rows = read_dataset(spec, seed=seed)[:max_samples]
        for index, row in enumerate(rows):
            stats.rows_read += 1
            conv = convert_row(row, spec)
            if spec.images and not isinstance(conv, str):
                _attach_images(conv, spec, index + 1, encoder, vision)
            result = conv if isinstance(conv, str) else encoder.encode(conv)
            if isinstance(result, str):
                stats.drop(result, row=index + 1)
            else:
                for n, sample in enumerate(result):  # several: data.multi_turn per_turn
                    stats.keep(sample, extra_row=n > 0)
                samples += result
        if rows and not stats.kept and stats.dropped.get(MISSING_COLUMN) == stats.rows_read:
            _refuse_raw_text(spec, rows[0])
        hint = over_cutoff_hint(stats, encoder, encoder.take_longest_over_cutoff())
        if stats.dropped.get(IMAGE_OVER_CUTOFF):
            hint += (
                f"; {stats.dropped[IMAGE_OVER_CUTOFF]} rows were dropped because their image "
                f"tokens do not fit data.cutoff_len={encoder.cutoff_len} (an image is never cut): "
                "raise data.cutoff_len or lower data.image_max_pixels"
            )
        hint += f"; first dropped: {stats.first_drop}" if stats.first_drop else ""
        log = logger.warning if stats.dropped else logger.info
        log("data set %s (%s): %s%s", spec.name, spec.path, stats.describe(), hint)
        total.add(stats)
    return samples, total


def _attach_images(
    conv: Conversation,
    spec: DatasetSpec,
    row: int,
    encoder: ChatEncoder,
    vision: Callable[[], VisionProcessor] | None,
) -> None:
    """Resolve the row's images and check its placeholders (errors name the data set and the
    row, 1-based);
    the encoder's processor is loaded at the first image."""
    paths = resolve_image_paths(
        conv.images, dataset=spec.name, row=row, media_dir=Path(spec.media_dir)
    )
    texts = [m["content"] for m in conv.messages if isinstance(m.get("content"), str)]
    check_placeholders(texts, len(paths), dataset=spec.name, row=row)
    conv.images = paths
    if paths and encoder.vision is None:
        if vision is None:
            raise ValueError(
                f"data set {spec.name!r} has images, but no model processor was given to turn "
                "them into tokens; train a vision-language model"
            )
        encoder.vision = vision()


_DROP_FIXES = {
    OVER_CUTOFF: "raise data.cutoff_len (the warning above gives the length that keeps them)",
    TOO_FEW_TARGETS: "raise data.cutoff_len or lower data.min_target_tokens",
    IMAGE_OVER_CUTOFF: "raise data.cutoff_len or lower data.image_max_pixels",
    EMPTY_TEXT: "the rows' text is blank",
}
"""Drop reason -> what to change; any other reason is the rows' format: `_FORMAT_FIX`."""
_FORMAT_FIX = "check the rows' format and the columns named in dataset_info.json"
_TEXT_COLUMN_FIX = (
    'name the text column in dataset_info.json as `"columns": {"prompt": "<column>"}`'
)


def nothing_left(
    what: str,
    cfg: DataConfig,
    stats: DataStats,
    specs: list[DatasetSpec],
    *,
    text_column: bool = False,
) -> ValueError:
    """The error for data that leaves no `what` to train on: empty files, or every row dropped
    (with the fix for each reason, once: the warning above has the counts per data set).
    `text_column`: raw text (data.stage: pt), whose rows need one text column."""
    where = f"data.dataset={cfg.dataset!r}"
    if not stats.rows_read:
        files = ", ".join(str(spec.path) for spec in specs)
        return ValueError(
            f"no {what} is left from {where}: the data is empty ({files} holds no rows); "
            "point data.dataset at the data"
        )
    table = {**_DROP_FIXES, **({MISSING_COLUMN: _TEXT_COLUMN_FIX} if text_column else {})}
    fixes = dict.fromkeys(table.get(reason, _FORMAT_FIX) for reason in sorted(stats.dropped))
    if OVER_CUTOFF in stats.dropped and cfg.overflow == "drop":
        fixes[f"{_DROP_FIXES[OVER_CUTOFF]}, or set data.overflow: truncate"] = None
        del fixes[_DROP_FIXES[OVER_CUTOFF]]
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(stats.dropped.items()))
    return ValueError(
        f"no {what} is left from {where}: all {stats.rows_read} rows were dropped ({reasons}); "
        + "; ".join(fixes)
    )


def over_cutoff_hint(stats: DataStats, encoder: ChatEncoder, longest: int) -> str:
    """Why rows were dropped as not fitting data.cutoff_len, and the value that keeps them."""
    count = stats.dropped.get(OVER_CUTOFF, 0)
    if not count:
        return ""
    cutoff = f"data.cutoff_len={encoder.cutoff_len}"
    why = (
        f"are longer than {cutoff} (overflow: drop)"
        if encoder.overflow == "drop"
        else f"keep fewer than data.min_target_tokens={encoder.min_target_tokens} supervised "
        f"tokens when truncated to {cutoff}"
    )
    return (
        f"; {count} of the {stats.rows_read} rows were dropped because they do not fit: they "
        f"{why}; raise data.cutoff_len ({longest} keeps every such row whole)"
    )


def _refuse_raw_text(spec: DatasetSpec, first: dict[str, Any]) -> None:
    """Every row lacked a column: say so if the rows are raw text, i.e. pre-training data."""
    if sft_format_of(first) is None and isinstance(first.get(spec.text), str):
        raise ValueError(
            f"data set {spec.name!r} ({spec.path}): no row is a conversation; the rows hold raw "
            f"text in column {spec.text!r} (keys {sorted(first)}), which looks like pre-training "
            "data: set data.stage: pt to train on it (data.stage is sft)"
        )


def read_dataset(spec: DatasetSpec, *, seed: int) -> list[dict[str, Any]]:
    """The raw rows of one data set, after the registry's `num_samples`."""
    if spec.load_from == "hf_hub":
        files = download_hub_dataset(
            spec.path,
            name=spec.name,
            revision=spec.revision,
            folder=spec.folder,
            subset=spec.subset,
            split=spec.split,
        )
        rows = [row for file in files for row in iter_rows(file)]
    else:
        rows = read_rows(Path(spec.path))
    if spec.num_samples is None:
        return rows
    rng = np.random.default_rng(seed)
    picked = rng.permutation(len(rows))[: spec.num_samples]
    extra = spec.num_samples - len(picked)
    if extra > 0:
        picked = np.concatenate([picked, rng.choice(len(rows), extra)])
    return [rows[i] for i in picked]


def split_validation(
    samples: list[Sample], *, val_size: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """(train, eval): a seeded random draw of `val_size` (fraction or count); order is kept."""
    held_out = held_out_mask(len(samples), val_size=val_size, seed=seed, unit="samples")
    train = [s for s, h in zip(samples, held_out, strict=True) if not h]
    return train, [s for s, h in zip(samples, held_out, strict=True) if h]


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad token id, else its eos id (padding is never attended nor supervised)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        "the tokenizer has neither a pad token nor an eos token; set one (e.g. "
        "tokenizer.pad_token = '<pad>' after adding it) so batches can be padded"
    )
