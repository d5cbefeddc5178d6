"""GRPO steps on a preset-shaped model (random init): generation vs training time, memory.

    python bench/grpo_shape.py --preset qwen2.5-7b --prompts 8 --generations 2 --steps 3

The run is `megatrain grpo`'s own (GRPOTrainer, built by RunBuilder) on synthetic prompts of
exactly --prompt-len tokens (the demo tokenizer; the model's vocabulary is the preset's), every
completion generated to --completion-len tokens (end-of-sequence suppressed), a random reward so
the advantages are not zero. Config overrides after the options apply as in `megatrain grpo`.
Prints one line per step as soon as the step ends (flushed: a run cut short still shows its
split): generation (on the static path also prefill + capture and ms per decoding step) and
training; then one RESULT line: median step time after the first, split into generation and
training, decode tokens/s, GPU peak, host RSS, and the estimate beside each (recipes/grpo/plan.py:
the
rollout phase and the training phase). The product default decodes with a static KV cache,
a torch.compile'd forward and one CUDA graph per token (recipes/grpo/decode.py);
`--grpo.compile_decode
graphs` keeps the eager kernels in the graph, `--grpo.compile_decode false` measures
transformers' eager generate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import host_peak_rss_gib, host_rss_gib, log, preset_config, result

from megatrain.allocator import configure_allocator
from megatrain.config.shorthand import model_values, shorthand_config
from megatrain.planning.rollout import DECODE_OP_S, RolloutEstimate
from megatrain.recipes.grpo.plan import grpo_plan
from megatrain.recipes.grpo.recipe import GRPOTrainer


def random_reward(completions: list[Any], **_: Any) -> list[float]:
    """A reward that keeps the advantages non-zero (the cost of a step does not depend on it)."""
    return [random.random() for _ in completions]


def _step_line(step: int, r: dict) -> str:
    """One step's time split (metrics.jsonl's record of it)."""
    static = (
        f"; prefill + capture {r['time/prefill_capture_s']:.2f} s, "
        f"{r['time/decode_step_ms']:.2f} ms per decoding step"
        if "time/decode_step_ms" in r
        else ""
    )
    return (
        f"step {step}: generation {r['time/generation_s']:.1f} s "
        f"({r['generation_tokens_per_s']:,.0f} tokens/s{static}), training "
        f"{r['time/train_s']:.1f} s, log-probs {r['time/logprob_s']:.1f} s, step "
        f"{r['time/generation_s'] + r['time/logprob_s'] + r['time/train_s']:.1f} s, "
        f"completion length {r['completion_length']:.0f}"
        + (", STREAMED rollout" if r.get("rollout_streamed") else "")
        + (
            f"; GPU peak rollout {r['gpu_peak_gib/rollout']} GiB, training "
            f"{r['gpu_peak_gib/train']} GiB"
            if "gpu_peak_gib/train" in r
            else ""
        )
    )


def _op_s_fit(ro: RolloutEstimate, decode_ms: list[float]) -> float | None:
    """planning/rollout.py's DECODE_OP_S[mode] that would predict the measured decoding step:
    the step less the estimate's weight and KV reads, over its ops (static decoding only)."""
    if ro.decode not in DECODE_OP_S or not decode_ms:
        return None
    reads_s = ro.decode_token_s - ro.decode_ops * DECODE_OP_S[ro.decode]
    return (statistics.median(decode_ms) / 1e3 - reads_s) / ro.decode_ops


def _prompts(folder: Path, count: int) -> Path:
    """Prompts longer than any --prompt-len: max_prompt_length keeps exactly the last tokens."""
    rng = random.Random(0)
    path = folder / "prompts.jsonl"
    with path.open("w") as f:
        for _ in range(count):
            text = "Count the letters.\n" + " ".join(rng.choice("abcdefgh") for _ in range(4096))
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(epilog="Arguments after the options are config overrides")
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--prompts", type=int, default=8, help="grpo.prompts_per_step")
    ap.add_argument("--generations", type=int, default=2, help="grpo.num_generations")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--completion-len", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4, help="training.micro_batch_size (rows)")
    ap.add_argument("--steps", type=int, default=3)
    a, overrides = ap.parse_known_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = dict(preset_config(a.preset).to_diff_dict())
    preset = {k: v for k, v in preset.items() if k not in ("model_type", "transformers_version")}
    folder = Path(tempfile.mkdtemp(prefix="grpo_shape_"))
    values = model_values(model_type="qwen2", config_overrides=preset) | {
        "model.tokenizer": "demo",
        "model.attn_implementation": "sdpa",
        "model.compute_dtype": "bf16" if device == "cuda" else "fp32",
        "data.dataset": str(_prompts(folder, a.prompts * (a.steps + 1))),
        "training.device": device,
        "training.output_dir": str(folder / "out"),
        "training.micro_batch_size": a.micro,
        "training.seq_len": a.prompt_len + a.completion_len,
        "data.cutoff_len": a.prompt_len + a.completion_len,
        "training.max_steps": a.steps,
        # chosen around the resident rollout (recipes/grpo/plan.py)
        "memory.gpu_state_blocks": "auto",
        "checkpoint.save_every": 0,
        "checkpoint.export_hf": False,
        "logging.progress_bar": False,
        "logging.report_to": "none",
        "optimizer.learning_rate": 1e-6,
        "grpo.prompts_per_step": a.prompts,
        "grpo.num_generations": a.generations,
        "grpo.max_prompt_length": a.prompt_len,
        "grpo.max_completion_length": a.completion_len,
        "grpo.reward_funcs": (f"{Path(__file__).resolve()}:random_reward",),
    }
    cfg = shorthand_config(None, overrides, values=values)
    t0 = time.perf_counter()
    configure_allocator()  # as the megatrain command does
    trainer = GRPOTrainer(cfg)
    trainer.save = lambda: None  # type: ignore[assignment,method-assign,return-value]
    trainer.min_completion_tokens = a.completion_len  # every completion at full length
    plan = grpo_plan(trainer.builder)
    log(f"built in {time.perf_counter() - t0:.1f} s; host RSS {host_rss_gib()} GiB")
    ro = plan.rollout
    log(
        f"decoding: {plan.decode_reason if not ro.streamed else 'streamed layers'}; predicted "
        f"{1e3 * ro.decode_token_s:.1f} ms per decoding step, rollout {ro.rollout_s:.1f} s"
    )
    train_step = trainer._train_step

    def train_and_report(*args: Any) -> dict:
        record = train_step(*args)
        log(_step_line(trainer.step, record))  # flushed: a run cut short keeps its finished steps
        return record

    trainer._train_step = train_and_report  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").open()]
    steps = rows[1:] or rows  # the first step compiles kernels and faults in the host states
    gen = statistics.median(r["time/generation_s"] for r in steps)
    train = statistics.median(r["time/train_s"] for r in steps)
    decode_ms = [r["time/decode_step_ms"] for r in steps if "time/decode_step_ms" in r]
    result(
        system="megatrain-grpo",
        preset=a.preset,
        prompts=a.prompts,
        generations=a.generations,
        prompt_len=a.prompt_len,
        completion_len=a.completion_len,
        micro=a.micro,
        overrides=" ".join(overrides),
        streamed_generation=ro.streamed,
        step_s=round(gen + train, 2),
        generation_s=round(gen, 2),
        train_s=round(train, 2),
        decode_tokens_per_s=round(statistics.median(r["generation_tokens_per_s"] for r in steps)),
        decode=ro.decode,
        decode_step_ms=round(statistics.median(decode_ms), 2) if decode_ms else None,
        est_decode_step_ms=round(1e3 * ro.decode_token_s, 2),
        op_s_fit=_op_s_fit(ro, decode_ms),
        completion_length=steps[-1]["completion_length"],
        gpu_peak_rollout_gib=max((r.get("gpu_peak_gib/rollout", 0) for r in rows), default=None),
        gpu_peak_train_gib=max((r.get("gpu_peak_gib/train", 0) for r in rows), default=None),
        est_rollout_phase_gpu_gib=round(
            (plan.training.estimate.gpu.persistent_bytes + ro.gpu_peak_bytes) / 2**30, 2
        ),
        host_rss_gib=host_rss_gib(),
        host_peak_rss_gib=host_peak_rss_gib(),
        est_step_s=round(plan.step_s, 2),
        est_generation_s=round(ro.rollout_s, 2),
        est_train_s=round(plan.training.estimate.time.step_s, 2),
        est_rollout_gpu_gib=round(ro.gpu_peak_bytes / 2**30, 2),
        est_kv_cache_gib=round(ro.kv_cache_bytes / 2**30, 2),
        est_train_gpu_gib=round(plan.training.estimate.gpu.peak_bytes / 2**30, 2),
        est_host_gib=round(plan.training.estimate.host.total_bytes / 2**30, 2),
    )


if __name__ == "__main__":
    main()
