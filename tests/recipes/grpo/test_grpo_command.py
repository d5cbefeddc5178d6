"""`megatrain grpo` end to end on a tiny random model: exact resume, metrics, user errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.recipes.grpo.recipe import GRPOTrainer

DEMO = Path(__file__).resolve().parents[3] / "examples" / "grpo_demo.yaml"
TINY = [
    *("--model.name_or_path", "null", "--model.model_type", "llama", "--model.tiny", "true"),
    *("--model.tokenizer", "demo", "--model.config_overrides.vocab_size", "512"),
    *("--grpo.num_generations", "3", "--grpo.prompts_per_step", "2"),
    *("--grpo.max_completion_length", "5", "--training.micro_batch_size", "4"),
    *("--logging.progress_bar", "false", "--logging.report_to", "none"),
    *("--checkpoint.export_hf", "false", "--optimizer.learning_rate", "1e-2"),
]


def _reward_file(tmp: Path) -> str:
    path = tmp / "rewards.py"
    path.write_text(
        "def short(completions, completion_ids, **kwargs):\n"
        "    return [-float(len(ids)) + 0.1 * ids[0] for ids in completion_ids]\n"
    )
    return f"{path}:short"


def _run(out: Path, reward: str, *extra: str) -> list[dict]:
    cfg = load_config(
        DEMO,
        [*TINY, "--training.output_dir", str(out), "--grpo.reward_funcs", f"[{reward}]", *extra],
    )
    trainer = GRPOTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_resume_repeats_rollouts_and_losses_exactly(tmp_path: Path) -> None:
    reward = _reward_file(tmp_path)
    common = ["--grpo.num_iterations", "2", "--grpo.beta", "0.5", "--checkpoint.save_every", "2"]
    straight = _run(tmp_path / "a", reward, *common, "--training.max_steps", "4")
    _run(tmp_path / "b", reward, *common, "--training.max_steps", "2")
    resumed = _run(
        tmp_path / "b",
        reward,
        *common,
        "--training.max_steps",
        "4",
        "--checkpoint.resume_from",
        "auto",
    )
    keys = ("loss", "reward", "completion_length", "kl", "entropy", "grad_norm")
    assert [[r[k] for k in keys] for r in straight] == [[r[k] for k in keys] for r in resumed]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 3, 4 appended after 1, 2
    assert straight[1]["kl"] > 0 and straight[0]["grad_norm"] > 0  # the objective did work
    assert 0 < straight[0]["entropy"] < math.log(512)  # vocab_size 512: at most uniform's


def test_uneven_ranks_and_bad_rewards_stop_with_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def score(completions, **kwargs):\n    return [1.0]\n")
    out = tmp_path / "o"
    args = ["grpo", "--config", str(DEMO), *TINY, "--training.output_dir", str(out)]
    assert main([*args, "--grpo.reward_funcs", f"[{bad}:score]", "--training.max_steps", "1"]) == 2
    assert f"reward function '{bad}:score'" in capsys.readouterr().err
    # rank 0 of a 2-process torchrun job: 3 prompts a batch do not split, refused before
    # anything starts (no process group: the check reads torchrun's environment only)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    other = tmp_path / "other"
    assert main([*args, "--grpo.prompts_per_step", "3", "--training.output_dir", str(other)]) == 2
    err = capsys.readouterr().err
    assert "grpo.prompts_per_step=3 prompts per generation batch do not split over 2 " in err
    assert "set grpo.prompts_per_step to a multiple of 2 (e.g. 4), or run 1 or 3 processes" in err
    assert err.count("\n") == 1 and "Traceback" not in err  # one paragraph
    assert not other.exists()


def test_a_failed_start_leaves_the_folder_to_the_corrected_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    args = ["grpo", "--config", str(DEMO), *TINY, "--training.output_dir", str(out)]
    args += ["--training.max_steps", "1"]
    assert main([*args, "--data.dataset", "demo_cuont"]) == 2  # refused before the claim
    assert "'demo_cuont'" in capsys.readouterr().err and not out.exists()
    bad = tmp_path / "bad.py"  # fails in the first step, after the claim: config.yaml is left
    bad.write_text("def score(completions, **kwargs):\n    return [1.0]\n")
    assert main([*args, "--grpo.reward_funcs", f"[{bad}:score]"]) == 2
    assert main([*args, "--grpo.reward_funcs", f"[{_reward_file(tmp_path)}]"]) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").open()] == [1]


def test_out_of_memory_in_a_grpo_step_steps_down_and_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """megatrain grpo shares the trainer's recovery (megatrain/recipes/oom.py): an out-of-memory in
    step 2's backward is undone and the step run again on the smaller tier (on the CPU the
    tier runs its device code; optimizer.impl torch makes tier and host updates equal), so
    the losses are those of a run planned without the tier."""
    import torch

    from megatrain.engine.engine import StreamingEngine

    reward = _reward_file(tmp_path)
    common = ["--optimizer.impl", "torch", "--training.max_steps", "3"]
    expected = _run(tmp_path / "small", reward, *common, "--memory.gpu_state_blocks", "0")
    real, calls = StreamingEngine._backward_layer, {"n": 0}

    def backward_layer(self, i, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:  # step 2's backward (3 layers a step), its second layer
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(StreamingEngine, "_backward_layer", backward_layer)
    records = _run(tmp_path / "tier", reward, *common, "--memory.gpu_state_blocks", "3")
    (down,) = [r for r in records if r["kind"] == "plan_step_down"]
    assert down["step"] == 2 and down["gpu_state_blocks"] == [3, 0]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses == [r["loss"] for r in expected if r["kind"] == "train"]


def test_save_final_false_writes_no_final_checkpoint(tmp_path: Path) -> None:
    """As megatrain train: checkpoint.save_final: false leaves only the periodic checkpoints
    (none here: save_every beyond the run)."""
    reward = _reward_file(tmp_path)
    flags = ["--checkpoint.save_final", "false", "--checkpoint.save_every", "100"]
    _run(tmp_path / "run", reward, *flags, "--training.max_steps", "2")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_min_completion_length_reaches_the_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpo.min_completion_length is what each rollout holds the end token back for (the
    samplers' own tests check the holding: tests/recipes/grpo/test_grpo_decode.py)."""
    import megatrain.recipes.grpo.rollout_phase as recipe  # where the rollout samples

    asked: list[int] = []
    real = recipe.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs["min_new_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(recipe, "generate", generate)
    reward = _reward_file(tmp_path)
    records = _run(
        tmp_path / "run", reward, "--grpo.min_completion_length", "5", "--training.max_steps", "2"
    )
    assert asked == [5, 5]
    assert [r["completion_length"] for r in records if r["kind"] == "train"] == [5.0, 5.0]


def test_min_completion_length_above_the_maximum_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"grpo.min_completion_length=6 is above"):
        load_config(DEMO, [*TINY, "--grpo.min_completion_length", "6"])


def test_int8_rollout_trains_with_truncated_importance_weights(tmp_path: Path) -> None:
    """grpo.rollout_weights int8 on the CPU: the rollout's linear weights are int8, the loss
    weights each token by the truncated ratio (on by default for a compact rollout). The tiny
    model's int8 drift is of order 1e-3 nats a token (test_grpo_compact_rollout.py), so the
    mean weight is 1 within 0.1 (exp(+-0.1)), and not exactly 1."""
    reward = _reward_file(tmp_path)
    rows = _run(
        tmp_path / "int8", reward, "--grpo.rollout_weights", "int8", "--training.max_steps", "2"
    )
    assert [r["rollout_compact"] for r in rows] == [1, 1]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["importance_capped_share"] == 0.0
        assert math.exp(-0.1) < r["importance_ratio"] < math.exp(0.1)
        assert r["importance_ratio"] != 1.0
    plain = _run(tmp_path / "bf16", reward, "--training.max_steps", "1")
    assert plain[0]["rollout_compact"] == 0 and "importance_ratio" not in plain[0]
