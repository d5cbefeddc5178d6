"""The demos learn, end to end on the CPU: examples/demo.yaml's loss falls and its export loads and
generates, and examples/grpo_demo.yaml from the demo's short SFT raises its reward. One SFT run
(the GRPO demo's warm start, 120 steps of the demo) serves both.

The SFT warm start (examples/demo.yaml, 120 steps) counts letters right about a third of the time
when sampled at the demo's temperature 1.3; 60 GRPO steps on the counting prompts with the exact
answer as reward raise that share. Measured (docs/grpo.md, "The demo"): over grpo.seed 0-2 and
1 and 2 threads the mean reward of the last 10 steps exceeded the first 10 by 0.34 to 0.54.
MIN_GAIN is well below the smallest gain seen, so a run on another CPU (other float rounding:
other samples) passes, while a policy that does not learn (gain ~0, within the +-0.1 noise of
10-step means of 64 completions) fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatrain.config import load_config
from megatrain.recipes.grpo.recipe import GRPOTrainer
from megatrain.recipes.sft import Trainer, TrainSummary

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
QUIET = ["--logging.progress_bar", "false", "--logging.report_to", "none"]
MIN_GAIN = 0.15
SFT_STEPS = 120


@dataclass
class WarmStart:
    out: Path  # the SFT run's output folder
    summary: TrainSummary
    weights: dict[str, torch.Tensor]  # the trained store's fp32 weights by parameter name


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> WarmStart:
    """The GRPO demo's warm start as its comment runs it: `megatrain train --config
    examples/demo.yaml --training.max_steps 120` (the command's Trainer, run here)."""
    out = tmp_path_factory.mktemp("sft")
    args = ["--training.max_steps", str(SFT_STEPS), "--training.output_dir", str(out), *QUIET]
    trainer = Trainer(load_config(EXAMPLES / "demo.yaml", args))
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    with trainer.store.bound(torch.float32) as ours:
        weights = {name: p.detach().clone() for name, p in ours.named_parameters()}
    return WarmStart(out, summary, weights)


def test_demo_loss_falls_and_export_generates(warm_start: WarmStart) -> None:
    summary, out = warm_start.summary, warm_start.out
    assert summary.steps == SFT_STEPS
    assert summary.losses[0] > 5.5  # ~ln(482): an untrained model
    assert sum(summary.losses[-5:]) / 5 < 3.0
    assert summary.eval_loss is not None and summary.eval_loss < 3.0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, SFT_STEPS + 1))
    assert all(r["tokens_per_s"] > 0 and "time/compute_s" in r for r in train)
    # the export is a Hugging Face model folder that loads and generates
    assert summary.export_dir is not None
    model = AutoModelForCausalLM.from_pretrained(summary.export_dir)
    tok = AutoTokenizer.from_pretrained(summary.export_dir)
    for name, p in model.named_parameters():
        assert torch.equal(p, warm_start.weights[name]), name
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "reverse: a b c"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out_ids = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out_ids.shape[1] > prompt["input_ids"].shape[1]


def test_grpo_demo_reward_rises_after_the_short_sft(warm_start: WarmStart, tmp_path: Path) -> None:
    cfg = load_config(
        EXAMPLES / "grpo_demo.yaml",
        [
            *("--model.name_or_path", str(warm_start.out / "hf_model")),
            *("--training.output_dir", str(tmp_path / "grpo"), *QUIET),
            *("--checkpoint.export_hf", "false"),
        ],
    )
    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    rewards = summary.rewards
    assert summary.steps == len(rewards) == 60
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first > MIN_GAIN, (first, last, rewards)
    logged = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").open()]
    assert [r["reward"] for r in logged] == rewards  # the numbers the demo prints are logged
