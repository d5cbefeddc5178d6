"""Stage pt end to end: a tiny model trains on LLaMA-Factory-shaped raw text from the token cache,
and a run stopped mid-epoch and resumed gives the same losses as the straight run."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_fixtures.pt_corpus import write_lf_corpus
from megatrain.config import load_config
from megatrain.data.pretrain_loader import PretrainLoader
from megatrain.recipes.sft import Trainer
from run_helpers import crash_during_step

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"


def _trainer(tmp: Path, data: Path, *overrides: str) -> Trainer:
    cfg = load_config(
        DEMO,
        [
            "--training.output_dir", str(tmp),
            "--logging.progress_bar", "false",
            "--logging.report_to", "none",
            "--data.stage", "pt",
            "--data.dataset", "c4_demo,wiki_demo",
            "--data.dataset_dir", str(data),
            "--data.cache_dir", str(data.parent / "cache"),
            "--data.val_size", "0",
            "--data.cutoff_len", "128",
            "--training.micro_batch_size", "2",
            "--training.max_steps", "6",
            "--checkpoint.save_every", "3",
            "--checkpoint.export_hf", "false",
            *overrides,
        ],
    )  # fmt: skip
    return Trainer(cfg)


def _train(tmp: Path, data: Path, *overrides: str) -> list[float]:
    trainer = _trainer(tmp, data, *overrides)
    try:
        return trainer.train().losses
    finally:
        trainer.close()


@pytest.mark.parametrize("neat", ["false", "true"])
def test_pt_resume_mid_epoch_gives_identical_losses(tmp_path: Path, neat: str) -> None:
    data = tmp_path / "data"
    write_lf_corpus(data)
    straight_trainer = _trainer(tmp_path / "a", data, "--data.neat_packing", neat)
    assert straight_trainer.cfg.data.packing  # the demo (sft) config's, a no-op under pt
    assert isinstance(straight_trainer.loader, PretrainLoader)
    assert len(straight_trainer.loader) > 6  # the stop at step 3 is mid-epoch
    try:
        straight = straight_trainer.train().losses
    finally:
        straight_trainer.close()
    # the same run, killed during step 4 (after the step-3 checkpoint), then resumed
    crashed = _trainer(tmp_path / "b", data, "--data.neat_packing", neat)
    first = crash_during_step(crashed, 4)
    resumed = _train(
        tmp_path / "b", data, "--data.neat_packing", neat, "--checkpoint.resume_from", "auto"
    )
    assert len(straight) == 6 and len(first) == 3 and len(resumed) == 3
    assert first + resumed == straight
    assert straight[-1] < straight[0]  # it learns from the text
