"""Loss curves per optimizer state dtype (issue 13): the same fine-tuning run with fp32, bf16 and
int8 AdamW states, side by side.

    python bench/quality.py --out /tmp/quality [--steps 300] [--dtypes fp32,bf16,int8] [--gpus 4]

The job: a ~1.04B-parameter Llama-architecture model (hidden 2048, MLP 5632, 23 layers, 16/4
heads, the built-in 512-token demo tokenizer), random init, SFT on a scaled-up demo data set
(CONVERSATIONS freshly generated demo conversations: reverse / sort / count letters, add
numbers, system prompts, multi-turn; about one epoch in 300 steps, so the curve is learning, not
memorising), 8 rows of 1024 packed tokens per step, bf16 compute, AdamW lr 3e-4 cosine with 5%
warm-up, clipping 1.0, eval every 50 steps on 2% held out. Every block's states live on the host
(`memory.gpu_state_blocks: 0`): the GPU tier keeps fp32 states, which would hide the dtype.

Each dtype runs `megatrain train` in its own process, one after the other, with the same seed and
data. Prints one RESULT line per dtype (final train loss averaged over the last 20 steps, the
eval losses, relative to fp32) and writes `curves.csv` (step, loss per dtype) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from common import result

from megatrain.data.demo_assets import make_conversation, to_openai
from megatrain.package_assets import demo_assets_dir

ROOT = Path(__file__).resolve().parents[1]
DEMO_YAML = ROOT / "examples" / "demo.yaml"
CONVERSATIONS = 80_000
MODEL = {
    "vocab_size": 512,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def write_data(folder: Path, conversations: int, seed: int) -> None:
    """A demo-style sharegpt data set registered as `quality` in folder/dataset_info.json."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(folder / "quality.jsonl", "w") as f:
        for _ in range(conversations):
            f.write(json.dumps(to_openai(make_conversation(rng))) + "\n")
    info = json.loads((demo_assets_dir() / "dataset_info.json").read_text())["demo"]
    info["file_name"] = "quality.jsonl"
    (folder / "dataset_info.json").write_text(json.dumps({"quality": info}, indent=1))


BF16_MASTER_INT4 = ["--optimizer.master_dtype", "bf16", "--optimizer.state_dtype", "int4"]
RUNS = {
    "fp32": [],
    "fp32_seed1": ["--training.seed", "1"],  # the noise floor: another init and data order
    "bf16": ["--optimizer.state_dtype", "bf16"],
    "int8": ["--optimizer.state_dtype", "int8"],
    "int4": ["--optimizer.state_dtype", "int4"],
    "bf16m_int4": BF16_MASTER_INT4,
    "bf16m_int4_int8g": [*BF16_MASTER_INT4, "--optimizer.grad_dtype", "int8"],
    "bf16m_int4_noclip": [*BF16_MASTER_INT4, "--optimizer.max_grad_norm", "0"],
}
"""The runs --dtypes names: optimizer settings on top of the job (issue 41's combinations:
bf16 master + int4 states with int8 held gradients and clipping, and without clipping)."""


def overrides(out: Path, data: Path, steps: int, run: str, smoke: bool) -> list[str]:
    model = [] if smoke else [f"--model.config_overrides.{k}={v}" for k, v in MODEL.items()]
    return [
        *model,
        *("--model.compute_dtype", "bf16"),
        *("--data.dataset", "quality", "--data.dataset_dir", str(data)),
        *("--data.cutoff_len", "1024", "--data.val_size", "0.02"),
        *("--training.output_dir", str(out), "--training.max_steps", str(steps)),
        *("--training.micro_batch_size", "8", "--training.eval_every", "50"),
        *("--optimizer.learning_rate", "3e-4"),
        *("--optimizer.max_grad_norm", "1.0", "--memory.gpu_state_blocks", "0"),
        *("--logging.progress_bar", "false", "--logging.report_to", "none"),
        *("--logging.log_every", "25", "--checkpoint.export_dtype", "bf16"),
        *("--checkpoint.save_final", "false"),
        *RUNS[run],  # last: wins over the job's own keys (max_grad_norm)
    ]


def read_metrics(out: Path) -> tuple[dict[int, float], dict[int, float], list[float]]:
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    step_s: list[float] = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            losses[rec["step"]] = rec["loss"]
        if rec.get("eval_loss") is not None:
            evals[rec["step"]] = rec["eval_loss"]
        if rec.get("step_s"):
            step_s.append(rec["step_s"])
    return losses, evals, step_s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--conversations", type=int, default=CONVERSATIONS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=Path("/tmp/megatrain_quality_data"))
    ap.add_argument("--device", default="", help="training.device (default: the config's)")
    ap.add_argument("--smoke", action="store_true", help="the demo's tiny model (a CPU check)")
    ap.add_argument(
        "--gpus", type=int, default=1, help="runs at once, run i on GPU i %% gpus (its own cores)"
    )
    a = ap.parse_args()
    data = a.data
    a.out.mkdir(parents=True, exist_ok=True)
    write_data(data, a.conversations, a.seed)
    curves: dict[str, dict[int, float]] = {}
    runs = a.dtypes.split(",")
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"--dtypes: unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    cores = max(1, (os.cpu_count() or 2) // a.gpus)
    for wave in range(0, len(runs), a.gpus):
        started = []
        for i, run in enumerate(runs[wave : wave + a.gpus]):
            out = a.out / run
            argv = [sys.executable, "-m", "megatrain", "train", "--config", str(DEMO_YAML)]
            argv += overrides(out, data, a.steps, run, a.smoke)
            if a.device:
                argv += ["--training.device", a.device]
            env = dict(os.environ)
            if a.gpus > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
                argv += ["--optimizer.threads", str(max(1, cores - 2))]
            log = open(a.out / f"{run}.log", "w")  # noqa: SIM115 (closed below)
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            started.append((run, out, proc, log, time.perf_counter()))
        for run, out, proc, log, t0 in started:
            rc = proc.wait()
            log.close()
            wall = time.perf_counter() - t0
            if not (out / "metrics.jsonl").exists():
                print(f"{run}: no metrics (rc {rc}); see {a.out / f'{run}.log'}", flush=True)
                continue
            losses, evals, step_s = read_metrics(out)
            curves[run] = losses
            last = [losses[s] for s in sorted(losses)[-20:]]
            step_s.sort()
            result(
                bench="quality",
                state_dtype=run,
                rc=rc,
                steps=len(losses),
                wall_s=round(wall, 1),
                median_step_s=round(step_s[len(step_s) // 2], 3) if step_s else None,
                first_loss=round(losses[min(losses)], 4),
                last20_loss=round(sum(last) / len(last), 4),
                eval_loss={s: round(v, 4) for s, v in sorted(evals.items())},
            )
    steps = sorted(set().union(*(c.keys() for c in curves.values()))) if curves else []
    with open(a.out / "curves.csv", "w") as f:
        f.write(",".join(["step", *curves]) + "\n")
        for s in steps:
            f.write(",".join([str(s), *(str(c.get(s, "")) for c in curves.values())]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
