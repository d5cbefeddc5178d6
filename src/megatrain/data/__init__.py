"""The data pipeline: LLaMA-Factory-style data sets -> chat template -> masked, packed batches
(`data.stage: sft`), or raw text -> cached token stream -> full rows (`data.stage: pt`).

Entry points for the trainer (the only place that reads `DataConfig`):

    data = prepare_data(cfg.data, tokenizer, processor=model_dir)  # PreparedData; `processor`:
                                                      # the model's folder or hub id (images)
    data.train, data.eval                             # list[Sample] (eval: None or a list);
                                                      # stage pt: a PretrainCorpus each
    data.stats, data.eval_stats                       # DataStats: rows read, kept, dropped by
                                                      # reason, truncated, tokens, supervised
    loader = make_loader(data.train, micro_batch_size=4, seq_len=cfg.data.cutoff_len,
                         packing=cfg.data.packing, pad_token_id=data.pad_token_id,
                         shuffle=cfg.data.shuffle, seed=cfg.data.seed,
                         pad_to_multiple_of=cfg.data.pad_to_multiple_of,
                         vision=data.vision)          # data.vision: None without images
    len(loader)                                       # micro-batches per epoch (fixed)
    for batch in loader: ...                          # megatrain.batch.Batch; one epoch, then
                                                      # the epoch counter advances
    loader.state_dict() / loader.load_state_dict(s)   # resume at the exact next micro-batch

    run_data_command(cfg.data, tokenizer, show=5, as_json=False, seq_len=..., micro_batch_size=...,
                     out=sys.stdout)                  # `megatrain data --show N [--json]`

Data flow and modules:
    registry.py   dataset_info.json (LLaMA-Factory compatible) or a path -> DatasetSpec
    readers.py    json / jsonl / parquet / csv / folders / hub snapshots -> rows
    formats.py    alpaca / sharegpt / OpenAI rows -> Conversation (malformed rows: drop reason)
    template.py   Conversation -> Sample via the tokenizer's chat template; every assistant turn
                  supervised, the rest IGNORE_INDEX (unless train_on_prompt)
    vision.py     images: paths, `<image>` placeholder checks, the model processor's token counts
                  and pixel tensors (Batch.images)
    prefetch.py   the bounded prefetch thread the loader builds image micro-batches on
    pipeline.py   prepare_data: the above per data set, statistics, val split
    packing.py    best-fit-decreasing packing; packed and padded Batch construction
    loader.py     BatchLoader: seeded per-epoch shuffle, exact mid-epoch resume
  stage pt:
    corpus.py     one data file -> token ids + document lengths, via an on-disk cache (streamed)
    pretrain.py   PretrainCorpus: the documents of the data sets over the cached token files
    pretrain_loader.py  PretrainLoader: the document stream cut into rows of seq_len
  loaders.py    make_loader: a BatchLoader over samples, a PretrainLoader over a corpus
  command.py, preference_command.py  `megatrain data --show`; show.py: how both print
  demo_assets.py  the built-in synthetic data sets and tokenizer (megatrain/assets/demo)
  demo_vlm.py   the built-in image task and tiny vision-language processor (called by it)

The names above are imported on first use (`_EXPORTS`): importing the package, as the config
does for `DataConfig`, loads neither torch nor transformers, so `megatrain --help` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "run_data_command": "command",
    "DataConfig": "config",
    "Conversation": "formats",
    "convert_row": "formats",
    "BatchLoader": "loader",
    "make_loader": "loaders",
    "pack_rows": "packing",
    "PreparedData": "pipeline",
    "pad_token_id_of": "pipeline",
    "prepare_data": "pipeline",
    "PretrainCorpus": "pretrain",
    "DatasetSpec": "registry",
    "resolve_datasets": "registry",
    "DataStats": "sample",
    "Sample": "sample",
    "ChatEncoder": "template",
}
"""Each name of `__all__` -> the module of this package that defines it."""

__all__ = [
    "BatchLoader",
    "ChatEncoder",
    "Conversation",
    "DataConfig",
    "DataStats",
    "DatasetSpec",
    "PreparedData",
    "PretrainCorpus",
    "Sample",
    "convert_row",
    "make_loader",
    "pack_rows",
    "pad_token_id_of",
    "prepare_data",
    "resolve_datasets",
    "run_data_command",
]


def __getattr__(name: str) -> Any:
    """`megatrain.data.NAME`: imported from its module on first use, then cached here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # the same names, for type checkers
    from megatrain.data.command import run_data_command
    from megatrain.data.config import DataConfig
    from megatrain.data.formats import Conversation, convert_row
    from megatrain.data.loader import BatchLoader
    from megatrain.data.loaders import make_loader
    from megatrain.data.packing import pack_rows
    from megatrain.data.pipeline import PreparedData, pad_token_id_of, prepare_data
    from megatrain.data.pretrain import PretrainCorpus
    from megatrain.data.registry import DatasetSpec, resolve_datasets
    from megatrain.data.sample import DataStats, Sample
    from megatrain.data.template import ChatEncoder
