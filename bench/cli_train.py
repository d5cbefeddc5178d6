"""`megatrain train` as a user runs it, on a preset shape: the product's own figures.

    python bench/cli_train.py --name dense64k --preset llama3.1-8b --seq 2048 --rows 32 \
        --micro 4 --steps 10 [--layers N] [--nproc 2] [-- --section.key VALUE ...]

`--rows` are per rank (`--nproc N`: torchrun, each rank's micro-batches are its own).

`--command dpo`: preference pairs instead of the corpus (bench/pairs_data.py: demo text, each
row a few tokens under `--seq`), `--rows/2` pairs per rank per step for the steps and a few
more, data.stage dpo, the dpo section's defaults (sigmoid, reference precomputed). `--command
train --sft-of-pairs`: the same pairs as SFT rows (two a pair, padded, one sample per row), so
its step trains on the same rows' tokens as a DPO step on `--rows/2` pairs.

`--command grpo`: the grpo keys as overrides; with `--prompt-tokens P`, generated prompts of
exactly P tokens (longer ones, left-truncated by grpo.max_prompt_length), completions of --seq
minus P tokens all at full length (grpo.min_completion_length), a random reward
(bench/grpo_rewards.py) so the advantages are not zero. The RESULT adds the rollout's figures
(time/generation_s, decode_step_ms, the GPU peak per phase, decoding tokens/s) beside the
run's printed rollout estimate, and `op_us_fit`: the time per op that would have predicted the
measured decoding step (planning/rollout.py DECODE_OP_S).

`--images SHARE` (train): a Qwen2.5-VL preset (bench/vlm_data.py) on generated image rows in
LLaMA-Factory's mllm format, packed sft, one sample of `--seq` tokens a row with about SHARE of
them image tokens (`--image-side` pixels, 448: 256 tokens an image); `--images 0`: the same rows
with text in the images' place (same tokens per step). The processor is demo_vlm's, copied with
its pixel limits raised to the images'. The RESULT adds images_per_step (from the data: rows per
step x images per row; metrics.jsonl counts no images) and images_per_s.

Writes what a user would have: a model folder holding only the shape's config.json
(`model.random_init: true`), a pre-training text corpus (the demo's lines, repeated), and a YAML
config with the default settings except the shape, the batch and the run length (clipping on, as by
default; no checkpoint within the run: `save_every` beyond it). Then runs `python -m megatrain
train --config FILE` in a fresh process with the environment as it is (no allocator or other
variable set here), its output into $OUT/<name>/train.log, and reads $OUT/<name>/run/metrics.jsonl:
the median step time over the steps after the first `--warmup` (2: compiling, warm-up), tokens/s of
the job and per GPU, MFU and model TFLOPS per GPU, the time per phase (time/*), the GPU allocator's
peak (reserved: what the card must hold) and host RSS (and, one process, its peak RSS with the
loading: host_peak_rss_gib), any step-down of the plan, beside the
prediction the run printed; for dpo, the reference pass (its "reference_pass" record: seconds,
tokens/s); under torchrun (`--nproc`), the node's memory in use while the steps run
(node_job_in_steps_gib: every rank's host memory, the node's use less what it held before the
command; metrics.jsonl has rank 0's RSS only); the command's wall time and its part outside the
steps (outside_steps_s: start, data, plan, model init and store, exit). One RESULT line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from common import log, preset_values, result
from node_memory import NodeMemory
from pairs_data import make_pairs, write_data
from vlm_data import VLM_PRESETS, vlm_config, write_processor, write_vlm_data

ROOT = Path(__file__).resolve().parents[1]
DEMO_TEXT = ROOT / "src" / "megatrain" / "assets" / "demo" / "demo_text.txt"
PREDICTED = re.compile(
    r"resources: host ([\d.]+) GiB, GPU peak ([\d.]+) GiB, step ([\d.]+) s \(predicted\)"
)
# megatrain grpo's estimate of one generation batch (recipes/grpo/plan.py format_logprobs)
PREDICTED_GRPO = re.compile(
    r"GRPO step: rollout ([\d.]+) s \+ log-prob passes ([\d.]+) s \+ training "
    r"(?:\d+ x )?([\d.]+) s = ([\d.]+) s"
)
# the auto choices the run printed (recipes/records.py): its GPU tier and GPU update share
AUTO_TIER = re.compile(r"memory\.gpu_state_blocks auto: GPU tier: (\d+) of (\d+) blocks")
AUTO_SHARE = re.compile(r"optimizer\.gpu_update_blocks auto: GPU update share: (\d+) blocks")
PREDICTED_DECODE = re.compile(
    r"decoding steps x ([\d.]+) ms(?: \(reads ([\d.]+) ms \+ (\d+) ops x ([\d.]+) us\))?"
)


def corpus(path: Path, chars: int) -> Path:
    """A .txt corpus (one document per line) of about `chars` characters of demo text."""
    if path.exists() and path.stat().st_size >= chars:
        return path
    lines = [ln for ln in DEMO_TEXT.read_text().splitlines() if ln.strip()]
    rng, out, size = random.Random(0), [], 0
    while size < chars:
        doc = " ".join(rng.choice(lines) for _ in range(rng.randint(4, 40)))
        out.append(doc)
        size += len(doc) + 1
    path.write_text("\n".join(out) + "\n")
    return path


def vlm_data(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """--images: the mllm rows (bench/vlm_data.py), packed sft, one sample a row."""
    pixels = a.image_side**2
    count = a.rows * a.nproc * a.steps + 4
    section, a.images_per_row = write_vlm_data(
        out / "data",
        out / "processor",
        count=count,
        seq=a.seq,
        share=a.images or a.text_like_share,
        side=a.image_side,
        text_like=not a.images,
    )
    log(f"{a.name}: {count} rows, {a.images_per_row} images of {a.image_side} px a row")
    limits = {"image_max_pixels": pixels, "image_min_pixels": min(pixels, 56 * 56)}
    return {"stage": "sft", "packing": True, **section, **limits, "cutoff_len": a.seq}


def grpo_prompts(path: Path, count: int) -> Path:
    """GRPO prompts longer than any --prompt-tokens (4096 letters): grpo.max_prompt_length keeps
    exactly their last tokens."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            text = "Count the letters.\n" + " ".join(rng.choice("abcdefgh") for _ in range(4096))
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def data_section(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The config's `data`: the pt corpus, or the pairs (dpo) or their rows (--sft-of-pairs),
    or the image rows (--images), or long prompts (grpo --prompt-tokens)."""
    if a.images is not None:
        return vlm_data(a, out)
    if a.command == "grpo" and a.prompt_tokens:
        count = a.rows * a.nproc * (a.steps + 2)  # rows >= prompts per step
        return {"dataset": str(grpo_prompts(out / "prompts.jsonl", count)), "cutoff_len": a.seq}
    if a.command != "dpo" and not a.sft_of_pairs:
        text = corpus(out.parent / "corpus.txt", max(4 * a.seq, 4_000_000))
        return {"stage": "pt", "dataset": str(text), "cutoff_len": a.seq}
    count = a.rows // 2 * a.nproc * a.steps + 4
    pairs, longest = make_pairs(count, a.seq)
    log(f"{a.name}: {count} pairs, rows of up to {longest} tokens")
    sft = a.command != "dpo"
    stage = {"stage": "sft", "packing": False} if sft else {"stage": "dpo"}
    return {**stage, **write_data(out / "data", pairs, sft=sft), "cutoff_len": a.seq}


def write_run(a: argparse.Namespace, overrides: list[str], out: Path) -> Path:
    model_dir = out / "model"
    tokenizer = "demo"
    if a.images is not None:
        vlm_config(a.preset, a.layers).save_pretrained(model_dir)
        pixels = a.image_side**2  # the processor's limits as the data's (vlm_data.py)
        processor = write_processor(
            out / "processor", min_pixels=min(pixels, 56 * 56), max_pixels=pixels
        )
        tokenizer = str(processor)
    else:
        extra = {"num_hidden_layers": a.layers} if a.layers else {}
        model_type, values = preset_values(a.preset, **extra)
        from transformers import AutoConfig

        AutoConfig.for_model(model_type, **values).save_pretrained(model_dir)
    cfg: dict[str, Any] = {
        "model": {"name_or_path": str(model_dir), "random_init": True, "tokenizer": tokenizer},
        "data": data_section(a, out),
        "training": {
            "output_dir": str(out / "run"),
            "micro_batch_size": a.micro,
            # "auto": the plan picks the micro-batch (grpo: of the generation batch's rows)
            "gradient_accumulation_steps": 1 if a.micro == "auto" else a.rows // a.micro,
            "seq_len": a.seq,
            "max_steps": a.steps,
        },
        "logging": {"progress_bar": False, "log_every": 1, "report_to": "none"},
        "checkpoint": {"save_every": 10 * a.steps, "save_final": False, "export_hf": False},
    }
    if a.command == "grpo" and a.prompt_tokens:
        cfg["grpo"] = {
            "max_prompt_length": a.prompt_tokens,
            "max_completion_length": a.seq - a.prompt_tokens,
            # every completion at full length: a fixed cost per step
            "min_completion_length": a.seq - a.prompt_tokens,
            "reward_funcs": [f"{ROOT / 'bench' / 'grpo_rewards.py'}:random_reward"],
        }
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (out / "overrides.txt").write_text(" ".join(overrides))
    return path


def _stepping(out: Path) -> bool:
    """Whether the run has logged a training step (its metrics.jsonl holds a train record)."""
    try:
        return '"kind": "train"' in (out / "run" / "metrics.jsonl").read_text()
    except OSError:
        return False


def summarize(
    name: str, out: Path, rc: int, log_text: str, warmup: int = 2, wall_s: float | None = None
) -> dict[str, Any]:
    records = (
        [
            json.loads(line)
            for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        if (out / "run" / "metrics.jsonl").exists()
        else []
    )
    train = [r for r in records if r["kind"] == "train"]
    steady = train[warmup:] or train
    step_s = statistics.median(r["step_s"] for r in steady) if steady else None
    summary: dict[str, Any] = {"name": name, "rc": rc, "steps": len(train)}
    if wall_s is not None:  # the command's wall time; beside the steps: start, data, model build
        summary["wall_s"] = round(wall_s, 1)
        summary["outside_steps_s"] = round(wall_s - sum(r["step_s"] for r in train), 1)
    if step_s:
        tokens = steady[0]["tokens"]
        summary |= {
            "step_s": round(step_s, 3),
            "tokens_per_s": round(tokens / step_s),
            "step_tokens": tokens,
            "first_step_s": train[0]["step_s"],
        }
        for key in ("mfu", "tokens_per_s_per_gpu", "tflops_per_gpu"):  # per GPU: docs/metrics.md
            values = [r[key] for r in steady if key in r]
            if values:
                summary[key] = round(statistics.median(values), 4)
        times = sorted({k for r in steady for k in r if k.startswith("time/")})
        summary["time"] = {
            k[5:]: round(statistics.median(r[k] for r in steady if k in r), 3) for k in times
        }
        for key in ("gpu_peak_gib", "gpu_alloc_peak_gib", "host_rss_gib"):
            values = [r[key] for r in train if key in r]
            if values:
                summary[key] = max(values)
        summary["loss"] = [round(train[0]["loss"], 3), round(train[-1]["loss"], 3)]
    for ref in (r for r in records if r["kind"] == "reference_pass"):  # dpo: one, before step 1
        summary |= {
            "ref_pairs": ref["pairs"],
            "ref_s": ref["seconds"],
            "ref_tokens_per_s": round(ref["tokens_per_s"]),
        }
    for key in ("generation_tokens_per_s", "completion_length"):  # grpo
        values = [r[key] for r in steady if key in r]
        if values:
            summary[key] = round(statistics.median(values), 1)
    for key in ("gpu_peak_gib/rollout", "gpu_peak_gib/train"):
        values = [r[key] for r in train if key in r]
        if values:
            summary[key.replace("/", "_")] = max(values)
    summary |= _grpo_prediction(log_text, summary.get("time", {}).get("decode_step_ms"))
    downs = [r for r in records if r["kind"] in ("plan_step_down", "oom_retry")]
    if downs:
        summary["step_downs"] = downs
    found = PREDICTED.search(log_text)
    if found:
        summary |= {
            "pred_host_gib": float(found.group(1)),
            "pred_gpu_peak_gib": float(found.group(2)),
            "pred_step_s": float(found.group(3)),
        }
    tier, share = AUTO_TIER.search(log_text), AUTO_SHARE.search(log_text)
    if tier:
        summary["auto_tier"] = f"{tier.group(1)} of {tier.group(2)}"
    if share:
        summary["auto_share"] = int(share.group(1))
    if rc:
        summary["error"] = log_text.strip().splitlines()[-1][-300:] if log_text.strip() else ""
    return summary


def _grpo_prediction(log_text: str, decode_ms: float | None) -> dict[str, Any]:
    """megatrain grpo's printed rollout estimate; with a measured decoding step, the time per
    op that would have predicted it (planning/rollout.py DECODE_OP_S, graph replays only)."""
    found: dict[str, Any] = {}
    step = PREDICTED_GRPO.search(log_text)
    if step:
        found |= {
            "pred_rollout_s": float(step.group(1)),
            "pred_logprob_s": float(step.group(2)),
            "pred_train_s": float(step.group(3)),
            "pred_grpo_step_s": float(step.group(4)),
        }
    decode = PREDICTED_DECODE.search(log_text)
    if decode:
        found["pred_decode_step_ms"] = float(decode.group(1))
        if decode.group(2) and decode_ms:
            reads_ms, ops = float(decode.group(2)), int(decode.group(3))
            found["op_us_fit"] = round(1e3 * (decode_ms - reads_ms) / ops, 3)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(epilog="after --: config overrides, as megatrain train takes")
    ap.add_argument("--name", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=32, help="rows per optimizer step")
    ap.add_argument(
        "--micro",
        type=lambda text: text if text == "auto" else int(text),
        default=4,
        help="rows per micro-batch, or auto (the plan's: megatrain grpo's and dpo's default)",
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--timeout", type=int, default=560)
    ap.add_argument("--nproc", type=int, default=1, help="ranks: torchrun --nproc-per-node N")
    ap.add_argument(
        "--command",
        choices=["train", "grpo", "dpo"],
        default="train",
        help="grpo: the grpo keys as overrides (and the prompts, or --prompt-tokens); dpo: "
        "preference pairs",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="grpo: prompts of exactly this many tokens, completions of --seq minus them, every "
        "one at full length (grpo.min_completion_length), a random reward",
    )
    ap.add_argument(
        "--images",
        type=float,
        default=None,
        help="train: a Qwen2.5-VL preset on image rows, SHARE of each row's tokens image "
        "tokens (0: the same rows with text in the images' place, --text-like-share of them)",
    )
    ap.add_argument("--image-side", type=int, default=448, help="--images: pixels a side")
    ap.add_argument(
        "--text-like-share",
        type=float,
        default=0.25,
        help="--images 0: the share of the image run it stands for (its text replaces them)",
    )
    ap.add_argument(
        "--sft-of-pairs",
        action="store_true",
        help="train: dpo's pairs as SFT rows (prompt + chosen, prompt + rejected)",
    )
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    a, overrides = ap.parse_args(argv[:split]), argv[split + 1 :]
    if a.sft_of_pairs and a.command != "train":
        ap.error("--sft-of-pairs is for --command train")
    if a.images is not None and (a.command != "train" or a.preset not in VLM_PRESETS):
        ap.error(f"--images is for --command train with a preset of {', '.join(VLM_PRESETS)}")
    out = Path(os.environ.get("OUT", "/tmp/out")) / a.name
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "run", ignore_errors=True)  # a rerun of the name starts afresh
    config = write_run(a, overrides, out)
    launch = [sys.executable]
    if a.nproc > 1:  # as docs/multi_gpu.md launches it
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
    command = [*launch, "-m", "megatrain", a.command, "--config", str(config), *overrides]
    log(f"{a.name}: {' '.join(command)}")
    logfile = out / "train.log"
    # torchrun: every rank's host memory, as the node holds it while the steps run (after the
    # first step's record; loading is over), where metrics.jsonl has rank 0's RSS only
    node = NodeMemory(only_when=lambda: _stepping(out)) if a.nproc > 1 else None
    start = time.monotonic()
    with open(logfile, "w") as f:
        try:
            rc = subprocess.run(
                command, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall_s = time.monotonic() - start
    summary = summarize(a.name, out, rc, logfile.read_text(), a.warmup, wall_s)
    if a.nproc == 1:  # the run's peak RSS, loading included (this runner starts one child)
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        summary["host_peak_rss_gib"] = round(peak_kib / 2**20, 2)
    if node is not None:
        node.stop()
        if node.before is not None and node.peak is not None:
            summary |= {
                "node_used_before_gib": round(node.before, 1),
                "node_used_in_steps_gib": round(node.peak, 1),
                "node_job_in_steps_gib": round(node.peak - node.before, 1),
            }
    data = "pairs as sft rows" if a.sft_of_pairs else "pairs" if a.command == "dpo" else "corpus"
    if a.command == "grpo":
        data = "long prompts" if a.prompt_tokens else "prompts (overrides)"
    if a.images is not None:
        data = "image rows" if a.images else "image rows as text"
        # metrics.jsonl counts no images: from the data, one sample a packed row (vlm_data.py)
        per_step = a.images_per_row * a.rows * a.nproc
        summary |= {
            "images_per_row": a.images_per_row,
            "image_side": a.image_side,
            "images_per_step": per_step,
            "images_counted_from": "data (rows per step x images per row)",
        }
        if summary.get("step_s"):
            summary["images_per_s"] = round(per_step / summary["step_s"], 2)
    result(**{"name": a.name, "command": a.command, "nproc": a.nproc, "data": data, **summary})


if __name__ == "__main__":
    main()
