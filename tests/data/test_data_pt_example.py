"""examples/qwen2_5_7b_cpt.yaml: a continued-pre-training run on a base model with long rows whose
data section prepares as it stands (the built-in demo text) into full rows of its cutoff_len."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from data_fixtures.helpers import demo_tokenizer
from megatrain.config import load_config
from megatrain.data import make_loader, prepare_data
from megatrain.data.pretrain import PretrainCorpus

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen2_5_7b_cpt.yaml"


def test_cpt_example_is_pretraining_with_long_rows(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-7B"  # a base model, not -Instruct
    assert cfg.data.stage == "pt" and cfg.data.layout() == "full"
    assert cfg.data.cutoff_len >= 8192 and "dataset_dir" in EXAMPLE.read_text()
    data_cfg = replace(cfg.data, cache_dir=str(tmp_path), cutoff_len=1024)  # the demo text is small
    tokenizer = demo_tokenizer()
    data = prepare_data(data_cfg, tokenizer)
    assert isinstance(data.train, PretrainCorpus) and isinstance(data.eval, PretrainCorpus)
    assert len(data.train) + len(data.eval) == data.stats.kept == 3000
    loader = make_loader(
        data.train, micro_batch_size=1, seq_len=1024, packing=False, pad_token_id=0
    )
    batch = next(iter(loader))
    assert tuple(batch.input_ids.shape) == (1, 1024) and batch.attention_mask is None
    assert batch.num_target_tokens == 1023
