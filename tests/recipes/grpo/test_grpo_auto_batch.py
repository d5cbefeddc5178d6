"""`training.micro_batch_size: auto` under `megatrain grpo` (its default) and the planned GRPO
step: the plan picks the micro-batch among the divisors of the generation batch (the largest
whose predicted GPU peak fits), a run with it equals the run with that size set by hand bit for
bit (only the batching is decided elsewhere), and the log-prob passes are in the plan:
`megatrain estimate --grpo` prints and reports them, the step adds them up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_grpo_command import DEMO, TINY, _reward_file
from test_grpo_plan import GRPO, MODEL, N, _builder

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.planning import Hardware
from megatrain.planning.hardware import GIB
from megatrain.recipes.grpo.plan import grpo_plan, training_config

AUTO = ("--training.micro_batch_size", "auto")
NO_SHARE = ("--optimizer.gpu_update_blocks", "0")
HW = Hardware(gpu_bytes=80 * GIB, host_bytes=512 * GIB)


def test_auto_picks_the_largest_divisor_of_the_generation_batch_that_fits() -> None:
    """The GPU update share is off here: its "auto" takes what memory is left, so a GPU 1 byte
    short would keep the 12 rows by taking a smaller share."""
    cfg = training_config(load_config(None, [*MODEL, *GRPO, *AUTO]))
    assert cfg.training.global_batch_size == N and cfg.training.gradient_accumulation_steps == 1
    assert training_config(cfg) == cfg
    plan = _builder(HW, *AUTO, *NO_SHARE).plan()
    assert (plan.micro_batch_size, plan.grad_accum) == (12, 1)  # the whole batch fits
    peaks = {
        b: _builder(HW, "--training.micro_batch_size", str(b), *NO_SHARE).plan() for b in (6, 12)
    }
    assert peaks[12].engine == plan.engine  # the hand-set plan of the size auto picked
    # a GPU 1 byte short of 12 rows' peak (margin 2 GiB): the next divisor down, 6 x 2
    short = Hardware(
        gpu_bytes=peaks[12].estimate.gpu.peak_bytes + 2 * GIB - 1, host_bytes=HW.host_bytes
    )
    tight = _builder(short, *AUTO, *NO_SHARE).plan()
    assert (tight.micro_batch_size, tight.grad_accum) == (6, 2)
    assert tight.estimate.gpu.peak_bytes == peaks[6].estimate.gpu.peak_bytes
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3 with micro_batch_size"):
        training_config(
            load_config(None, [*MODEL, *GRPO, *AUTO, "--training.gradient_accumulation_steps", "3"])
        )
    with pytest.raises(ValueError, match=r"global_batch_size=8: megatrain grpo trains .* 12 rows"):
        training_config(
            load_config(None, [*MODEL, *GRPO, *AUTO, "--training.global_batch_size", "8"])
        )


def test_the_plan_has_the_logprob_passes_and_the_whole_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """beta > 0: the reference's pass, num_iterations > 1: the old policy's, each the forward-
    only replay of the training micro-batches; the reference's adds the GPU tier's swap (bf16:
    the tier's reference weights over the host link)."""
    tier = ("--memory.gpu_state_blocks", "2")  # two decoder layers
    both = ("--grpo.beta", "0.04", "--grpo.num_iterations", "2", *tier)
    b = _builder(HW, *both)
    plan = grpo_plan(b)
    forward_s = plan.training.estimate.time.forward_s
    swap_s = 2 * b.spec.layers[0].params * 2 / (HW.h2d_gbps * 1e9)
    assert [(p.name, p.forward_s, p.swap_s) for p in plan.logprobs] == [
        ("old policy", forward_s, 0.0),
        ("reference", forward_s, pytest.approx(swap_s, rel=1e-12)),
    ]
    train_s = plan.training.estimate.time.step_s
    assert plan.step_s == pytest.approx(
        plan.rollout.rollout_s + 2 * forward_s + swap_s + 2 * train_s
    )
    args = ["estimate", "--model-type", "qwen2", "--seq-len", "64", "--gpu-gib", "80"]
    assert main([*args, "--grpo", "--json", *MODEL[2:], *GRPO, *both]) == 0
    report = json.loads(capsys.readouterr().out)["grpo"]
    assert [p["name"] for p in report["logprob_passes"]] == ["old policy", "reference"]
    assert report["step_s"] == pytest.approx(plan.step_s, rel=1e-12)
    assert main([*args, "--grpo", *MODEL[2:], *GRPO, *both]) == 0
    out = capsys.readouterr().out
    assert "GRPO log-prob passes (forward only, no layer input kept; the training " in out
    assert "micro-batches: 3 x 4 rows)" in out
    assert f"  old policy (grpo.num_iterations 2): forward {forward_s:.2f} s\n" in out
    assert f"  reference (grpo.beta 0.04): forward {forward_s:.2f} s + GPU-tier swap" in out
    assert "training 2 x " in out and " per generation batch" in out
    assert main([*args, "--grpo", *MODEL[2:], *GRPO]) == 0  # beta 0, one iteration
    out = capsys.readouterr().out
    assert "  old policy: not run (grpo.num_iterations 1: " in out
    assert "  reference: not run (grpo.beta 0: no KL term)" in out
    assert "+ log-prob passes 0.0 s +" in out


def test_estimate_grpo_defaults_to_the_planned_micro_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    unset = _without(GRPO, "--training.micro_batch_size")
    args = ["estimate", "--model-type", "qwen2", "--seq-len", "64", "--gpu-gib", "80", "--json"]
    assert main([*args, "--grpo", *MODEL[2:], *unset]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["micro_batch_size"] == N and report["settings"]["grad_accum"] == 1
    assert report["micro_batch_reason"].startswith("micro_batch_size 12 x grad_accum 1")
    assert main([*args, *MODEL[2:], *unset]) == 0  # not a GRPO run: train's default, 1
    assert json.loads(capsys.readouterr().out)["settings"]["micro_batch_size"] == 1


def _without(args: list[str], key: str) -> list[str]:
    """`args` without `key` and its value."""
    i = args.index(key)
    return args[:i] + args[i + 2 :]


def _run(out: Path, reward: str, *extra: str) -> list[dict]:
    """`megatrain grpo` on the demo config and TINY without their micro-batch size, two steps;
    the train records."""
    config = yaml.safe_load(DEMO.read_text())
    del config["training"]["micro_batch_size"]
    (out.parent / "grpo.yaml").write_text(yaml.safe_dump(config))
    args = [*_without(TINY, "--training.micro_batch_size"), "--training.max_steps", "2"]
    out_args = ["--training.output_dir", str(out), "--grpo.reward_funcs", f"[{reward}]"]
    assert main(["grpo", "--config", str(out.parent / "grpo.yaml"), *args, *out_args, *extra]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def test_auto_run_equals_the_hand_set_run_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the key (megatrain grpo's default) the plan takes the whole
    generation batch of 2 x 3 = 6 sequences (the CPU plan fits any); hand-set 6 is the same
    run. The plan printed at the start names the choice and the log-prob passes."""
    reward = _reward_file(tmp_path)
    beta = ("--grpo.beta", "0.1")
    auto = _run(tmp_path / "auto", reward, *beta)  # the command's default
    printed = capsys.readouterr().out
    assert "micro_batch_size auto: micro_batch_size 6 x grad_accum 1" in printed
    assert "  reference (grpo.beta 0.1): forward " in printed
    hand = _run(tmp_path / "hand", reward, *beta, "--training.micro_batch_size", "6")
    assert len(auto) == len(hand) == 2
    for a, h in zip(auto, hand, strict=True):
        for key in ("loss", "grad_norm", "reward", "kl", "completion_length"):
            assert a[key] == h[key], key
    saved = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())
    assert saved["training"]["micro_batch_size"] == "auto"
