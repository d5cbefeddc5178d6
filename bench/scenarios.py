"""The benchmark runner's scenarios (bench/run.py): each a few commands and what they measure.

Commands are argv tuples; `$OUT`, `$NGPU`, `$THREADS`, `$WHEELS` and `$DEEPSPEED` are filled in
by the runner. Results of past runs live in docs/performance.md, not here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SITE = "/tmp/site"  # where peers_install puts DeepSpeed


@dataclass(frozen=True)
class Scenario:
    what: str  # what it measures
    commands: tuple[tuple[str, ...], ...]
    timeout_s: int = 300


def _verify(*flags: str) -> tuple[str, ...]:
    return (PY, "-m", "megatrain", "verify", "--device", "cuda", *flags)


def _torchrun(*argv: str) -> tuple[str, ...]:
    """`argv` (a script and its flags) as $NGPU ranks on this node."""
    torchrun = (PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "$NGPU")
    return ("env", "OMP_NUM_THREADS=$THREADS", *torchrun, *argv)


def _grpo(name: str, *flags: str) -> tuple[str, ...]:
    """`megatrain grpo` on the Qwen2.5-7B shape (bench/cli_train.py): 8 prompts of 512 tokens a
    step, completions of 1024 at full length (grpo.min_completion_length), a random reward;
    `flags`: cli_train's, then `--` and config overrides."""
    shape = ("--command", "grpo", "--preset", "qwen2.5-7b", "--prompt-tokens", "512")
    return _cli(name, *shape, "--seq", "1536", "--warmup", "1", *flags)


def _cli(name: str, *flags: str) -> tuple[str, ...]:
    """`megatrain train` (or grpo) as a user runs it, through bench/cli_train.py (10 steps)."""
    return (PY, "bench/cli_train.py", "--name", name, *flags)


def _table(base: str, run: str) -> tuple[str, ...]:
    """bench/cli_table.py: the two _cli runs' RESULT lines as a table, tokens/s per GPU of
    `run` over `base`."""
    return (PY, "bench/cli_table.py", "--names", f"{base},{run}", "--ratio", f"{run}/{base}")


_DENSE = ("--preset", "llama3.1-8b", "--seq", "2048", "--micro", "4")
_COMPILE = ("--", "--training.compile_layers", "true")  # a _cli row's override: compiled
_STREAMED = ("--memory.gpu_state_blocks", "0")  # overrides: every block's AdamW on the host
_INT8 = ("--optimizer.state_dtype", "int8")
# issue 11: the Llama-3.1-8B shape, one row a step, 1 warm-up step; the engine before long-row
# support: layer inputs on the GPU, no tiles
_ROW_8B = ("--preset", "llama3.1-8b", "--rows", "1", "--micro", "1", "--warmup", "1")
_OLD_ENGINE = ("--memory.activation_offload", "off", "--memory.checkpoint_every", "1")
_OLD_ENGINE += ("--memory.mlp_tiles", "1")
# Qwen2.5-3B shape, 8k tokens a step in one micro-batch of 4 rows
_SHAPE_3B = ("--preset", "qwen2.5-3b", "--rows", "4", "--micro", "4")
# ranks (issue 10): Qwen2.5-7B shape, seq 2048, 8k tokens per GPU per step (4 rows of 2048 per
# rank, one micro-batch), clipping on and the GPU tier auto (sharded over the ranks) as by
# default; the peers' job the same rows
_RANKS_JOB = ("--preset", "qwen2.5-7b", "--batch", "4", "--seq", "2048", "--steps", "3")
_RANKS = ("--preset", "qwen2.5-7b", "--seq", "2048", "--rows", "4", "--micro", "4")
_RANKS += ("--steps", "5")
# the weak-scaling job: 32k tokens per GPU per step (16 rows of 2048 per rank, micro-batches of 4)
_WEAK = (*_RANKS, "--rows", "16")
_NGPU = ("--nproc", "$NGPU")
# capacity on the ranks: 4k tokens per GPU, 2 steps after a warm-up; ranks load in turns (those
# waiting for a turn wait in torchrun's store, past the collective timeout: distributed.py)
_CAPACITY = ("--rows", "2", "--micro", "2", "--steps", "3", "--warmup", "1", *_NGPU)
# ranks loading at once: 2 of 4 (470 GiB predicted) rather than the 3 that the default 4 GiB
# margin allows (489 of 503 GiB, too close to measure)
_RANKS_32B = ("--preset", "qwen2.5-32b", *_CAPACITY, "--timeout", "580", "--")
_RANKS_32B += ("--memory.host_margin_gib", "16")
_RANKS_14B = ("--preset", "qwen2.5-14b", *_CAPACITY, "--timeout", "410", "--")
# issue 13: 64k tokens/step in 4 micro-batches of 8 rows, compiled; int8 AdamW states at 14B and
# at a Qwen2.5-72B shape cut to 62 layers (56.9B), 8k tokens/step
_COMPILED_8B = (*_DENSE, "--rows", "32", "--micro", "8", "--steps", "5", "--")
_COMPILED_8B += ("--training.compile_layers", "true")
_INT8_14B = ("--preset", "qwen2.5-14b", "--rows", "4", "--micro", "4", "--steps", "5")
_INT8_14B += ("--timeout", "320", "--", *_INT8)
# issue 41: the most compact store (bf16 master, int4 states, int8 held gradients, clipping on)
_COMPACT = ("--optimizer.master_dtype", "bf16", "--optimizer.state_dtype", "int4")
_COMPACT += ("--optimizer.grad_dtype", "int8")
_OSS_120B = ("--preset", "gpt-oss-120b", "--rows", "4", "--micro", "4", "--steps", "4")
_OSS_120B += ("--warmup", "1", "--timeout", "1700", "--", *_COMPACT)
_QUALITY = "fp32,fp32_seed1,bf16m_int4_int8g,bf16m_int4_noclip"
_INT8_56B = ("--preset", "qwen2.5-72b", "--layers", "62", "--rows", "4", "--micro", "4")
_INT8_56B += ("--steps", "4", "--warmup", "1", "--timeout", "550", "--", *_INT8)
_FULL512K = ("--steps", "1", "--warmup", "0", "--timeout", "1680")  # one step, none to warm up
_ROW512K_RUNS = (
    _cli("row512k_4l", *_ROW_8B, "--seq", "524288", "--layers", "4", "--steps", "2",
         "--timeout", "400", "--", *_STREAMED),
    (PY, "bench/attention_kernels.py", "--seq", "524288", "--sdpa", "cudnn", "--modes",
     "whole,split", "--reps", "1"),
)  # fmt: skip
_MOE = ("--preset", "qwen3-30b-a3b", "--layers", "12", "--rows", "32", "--steps", "8")
_MOE_BATCH_ROWS = ("moe64k", "moe64k_m16", "moe64k_m16_noclip", "moe256k_m16")
_HYBRID = ("--preset", "qwen3.5-27b", "--layers", "16", "--seq", "2048", "--rows", "32")
_GRPO_8X8 = (
    "--command", "grpo", "--preset", "qwen2.5-7b", "--rows", "8", "--micro", "8", "--",
    "--model.config_overrides.vocab_size", "512", "--data.stage", "sft", "--data.dataset",
    "demo_count", "--grpo.num_generations", "8", "--grpo.prompts_per_step", "8",
    "--grpo.max_prompt_length", "96", "--grpo.max_completion_length", "1024",
    "--grpo.reward_funcs", "[exact_answer]", "--grpo.compile_decode", "graphs",
)  # fmt: skip


def _grpo_prompts(generations: int) -> tuple[str, ...]:
    """8 prompts a step, `generations` completions each, the seed's learning rate."""
    return (
        *("--grpo.prompts_per_step", "8", "--grpo.num_generations", str(generations)),
        *("--optimizer.learning_rate", "1e-6"),
    )


# issue 25: 16 pairs (32 rows of ~2040 tokens, 64k tokens) per step, 2 pairs per micro-batch, 8
# steps: the pairs as SFT rows (megatrain train), then megatrain dpo (sigmoid, the reference
# precomputed: one forward-only pass over the 132 pairs before step 1); --timeout: each run's
# share of the device command's 600 s (the runner's own timeout a backstop above it)
_DPO = (*_DENSE, "--rows", "32", "--steps", "8")
_DPO_RUNS = (
    _cli("dpo8b_sft", *_DPO, "--sft-of-pairs", "--timeout", "270"),
    _cli("dpo8b", *_DPO, "--command", "dpo", "--timeout", "270"),
    _table("dpo8b_sft", "dpo8b"),
)
_DPO_RANKS = (
    _cli("dpo8b_1gpu", *_DPO, "--command", "dpo", "--timeout", "250"),
    _cli("dpo8b_2ranks", *_DPO, "--command", "dpo", "--nproc", "2", "--timeout", "320"),
    _table("dpo8b_1gpu", "dpo8b_2ranks"),
)
# issue 26: a Qwen2.5-VL-7B shape (bench/vlm_data.py), 32 rows of 2048 (64k tokens) per step, 4
# a micro-batch, 8 steps: text-only rows, then the same rows with 2 images of 448 x 448 each
# (2 x 256 tokens, 25%); --timeout: each run's share of the device command's 600 s
_VLM = ("--preset", "qwen2.5-vl-7b", "--seq", "2048", "--rows", "32", "--micro", "4")
_VLM += ("--steps", "8", "--image-side", "448", "--timeout", "280")
_VLM_RUNS = (
    _cli("vlm7b_text", *_VLM, "--images", "0"),
    _cli("vlm7b_images", *_VLM, "--images", "0.25"),
    (PY, "bench/cli_table.py", "--names", "vlm7b_text,vlm7b_images", "--step-ratio",
     "vlm7b_images/vlm7b_text", "--ratio", "vlm7b_images/vlm7b_text"),
)  # fmt: skip
# issue 24: one shape per architecture on one GPU, 64k tokens a step (32 rows of 2048, micro-batches
# of 4), AdamW states the fit check's advice makes fit (`megatrain estimate --config` on the run's
# own config; bench/architecture_rows.md has the figures). Full Qwen3.5-27B, int8 (bf16: 252.9
# GiB > 247 available on the 251 GiB host); GPT-OSS-20B whole, bf16 (196.5 GiB; int8 on the 125
# GiB host still needs 158.0); Qwen3-Next-80B-A3B cut to 19 of its 48 layers, the most that fit
# the 251 GiB host with int8 (loading peak 245.8 of 247 GiB). The _125G rows: the most layers
# that fit the 125 GiB host (int8). --timeout: the run's share of the device command's 600 s
_ARCH = ("--seq", "2048", "--rows", "32", "--micro", "4")
_BF16 = ("--optimizer.state_dtype", "bf16")
_ARCH_QWEN35 = ("--preset", "qwen3.5-27b", *_ARCH, "--steps", "3", "--warmup", "1")
_ARCH_QWEN35 += ("--timeout", "570", "--", *_INT8)
_ARCH_GPT_OSS = ("--preset", "gpt-oss-20b", *_ARCH, "--steps", "6")
_ARCH_GPT_OSS += ("--timeout", "560", "--", *_BF16)
_ARCH_QWEN3_NEXT = ("--preset", "qwen3-next-80b-a3b", "--layers", "19", *_ARCH, "--steps", "6")
_ARCH_QWEN3_NEXT += ("--timeout", "560", "--", *_INT8)
_GPT_OSS_12 = ("--preset", "gpt-oss-20b", "--layers", "12", *_ARCH, "--steps", "6")
_GPT_OSS_12 += ("--timeout", "280", "--", *_BF16)
_ARCH_GPT_OSS_125G = ("--preset", "gpt-oss-20b", "--layers", "17", *_ARCH, "--steps", "6")
_ARCH_GPT_OSS_125G += ("--timeout", "560", "--", *_INT8)
_ARCH_QWEN3_NEXT_125G = ("--preset", "qwen3-next-80b-a3b", "--layers", "8", *_ARCH, "--steps", "6")
_ARCH_QWEN3_NEXT_125G += ("--timeout", "560", "--", *_INT8)
_ARCH_GPT_OSS_INT8 = ("--preset", "gpt-oss-20b", *_ARCH, "--steps", "6", "--timeout", "400")
_ARCH_GPT_OSS_INT8 += ("--", *_INT8)

# issue 43: the GPU update share's rows, each beside its baseline in one scenario (one machine):
# the defaults, then the share off (a config key), then (where the host holds it) every update
# on the CPU; a table last, tokens/s over the baseline. The whole GPT-OSS-20B with bf16 states
# fits the 1-GPU H200 kind's 125 GiB host (a GPU tier of 12-13 of 26 blocks planned) and a GPU
# of the 4-GPU kind; its rows outlast one device command: start the runner with setsid nohup
# and read its log.
_SHARE_OFF = ("--optimizer.gpu_update_blocks", "0")
_ALL_ON_CPU = (*_STREAMED, *_SHARE_OFF)
_SHARE_OSS_BF16 = ("--preset", "gpt-oss-20b", *_ARCH, "--steps", "6", "--timeout", "900")
_SHARE_OSS_BF16 += ("--", *_BF16)
_SHARE_OSS_17L = ("--preset", "gpt-oss-20b", "--layers", "17", *_ARCH, "--steps", "7")
_SHARE_OSS_17L += ("--timeout", "420", "--", *_INT8)
_SHARE_NEXT_8L = ("--preset", "qwen3-next-80b-a3b", "--layers", "8", *_ARCH, "--steps", "6")
_SHARE_NEXT_8L += ("--timeout", "560", "--", *_INT8)


def _share_rows(
    name: str, flags: tuple[str, ...], *, all_on_cpu: bool
) -> tuple[tuple[str, ...], ...]:
    """Issue 43's row `name` (cli_train `flags`, ending in overrides): the defaults, the GPU
    update share off, every update on the CPU if `all_on_cpu`; a table, the defaults' tokens/s
    over each baseline's."""
    runs: dict[str, tuple[str, ...]] = {name: (), f"{name}_share_off": _SHARE_OFF}
    if all_on_cpu:
        runs[f"{name}_cpu"] = _ALL_ON_CPU
    table = (PY, "bench/cli_table.py", "--names", ",".join(runs))
    table += ("--ratio", f"{name}/{name}_share_off")
    if all_on_cpu:
        table += ("--ratio", f"{name}/{name}_cpu")
    return (*(_cli(run, *flags, *keys) for run, keys in runs.items()), table)


SCENARIOS: dict[str, Scenario] = {
    "env": Scenario(
        "the card, driver, CPU count, memory, torch and transformers versions",
        (
            ("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"),
            (
                PY,
                "-c",
                "import os,torch,transformers;print(os.cpu_count(),torch.__version__,"
                "transformers.__version__)",
            ),
        ),
        timeout_s=60,
    ),
    "verify_cuda": Scenario(
        "engine = PyTorch on the GPU: bf16 and fp32 tiny models (megatrain verify)",
        (
            _verify("--model-type", "llama", "--tiny", "--dtype", "bf16"),
            _verify("--model-type", "qwen3_moe", "--tiny", "--dtype", "bf16"),
            _verify("--model-type", "qwen3_5_text", "--tiny", "--dtype", "bf16"),
            _verify("--model-type", "llama", "--tiny"),
        ),
        timeout_s=200,
    ),
    "verify_hybrid": Scenario(
        "issue 24: bf16 verify on CUDA of the hybrid families (Qwen3.5 text and whole, "
        "Qwen3-Next) with whatever kernels are installed (flash-linear-attention when it is): "
        "the run's `kernels:` line says which",
        (
            _verify("--model-type", "qwen3_5_text", "--tiny", "--dtype", "bf16", "--packed"),
            _verify("--model-type", "qwen3_next", "--tiny", "--dtype", "bf16", "--packed"),
            _verify("--model-type", "qwen3_5", "--tiny", "--dtype", "bf16", "--seq-len", "48"),
        ),
        timeout_s=200,
    ),
    "gpu_tests": Scenario(
        "the test suite's GPU-marked tests",
        ((PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"),),
        timeout_s=300,
    ),
    "peers_install": Scenario(
        "install DeepSpeed and its dependencies from .wheels/ (carried; no network) into "
        f"{SITE}, which every scenario's PYTHONPATH includes",
        (
            (
                PY,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--target",
                SITE,
                "$WHEELS",
            ),
            (
                PY,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-build-isolation",
                "--target",
                SITE,
                "$DEEPSPEED",
            ),
        ),
    ),
    "adamw": Scenario(
        "CPU AdamW: C kernel vs torch fused, Gparams/s and host copy bandwidth; compressed "
        "state layouts (optimizer.state_dtype bf16, int8, int4) through the C kernel (int4 vs "
        "int8 on the GPU host: planning/timing.py INT4_VS_INT8_CPU was measured on the dev VM)",
        (
            (
                PY,
                "bench/adamw.py",
                "--params",
                "1e9",
                "--block",
                "80e6",
                "--threads",
                "14",
                "--huge",
                "yes",
                "--state-dtypes",
                "fp32,bf16,int8,int4",
            ),
        ),
    ),
    "adamw_errno_ab": Scenario(
        "issue 13: the fp32 C kernel built with and without -fno-math-errno, same host, same call",
        tuple(
            (PY, "bench/adamw.py", "--params", "1e9", "--threads", "14", "--huge", "yes", *flag)
            for flag in ((), ("--drop-flag=-fno-math-errno",))
        ),
    ),
    "compare_tier": Scenario(
        "issue 13: Qwen2.5-3B shape, 8k tokens/step, clipping off and on: GPU-resident, DeepSpeed "
        "ZeRO-3 offload (needs peers_install) and MegaTrain with its default GPU tier",
        (
            (
                PY,
                "bench/compare.py",
                *("--preset", "qwen2.5-3b", "--tokens", "8192", "--steps", "4"),
                "--systems",
                "gpu,deepspeed,megatrain,megatrain:optimizer.max_grad_norm=1.0",
            ),
        ),
        timeout_s=420,
    ),
    "quality": Scenario(
        "issue 13: the same ~1.04B fine-tuning run (300 steps, demo-style data scaled up) with "
        "fp32, bf16 and int8 AdamW states, one after the other: loss curves side by side",
        ((PY, "bench/quality.py", "--out", "$OUT/quality", "--steps", "300"),),
        timeout_s=590,
    ),
    "layer_speed": Scenario(
        "one Qwen2.5-7B decoder layer: forward, recompute and backward times, eager and compiled",
        (
            (PY, "bench/layer_speed.py", "--preset", "qwen2.5-7b", "--tokens", "8192"),
            (PY, "bench/layer_speed.py", "--preset", "qwen2.5-7b", "--tokens", "8192", "--compile"),
        ),
    ),
    "moe_layer": Scenario(
        "issue 24: one Qwen3-30B-A3B decoder layer (128 experts, top 8) at 8k tokens, under "
        "each of transformers' experts implementations (grouped_mm, batched_mm, eager) and "
        "compiled, beside a Llama-3.1-8B layer; TFLOPS on active parameters, the top kernels "
        "in $OUT/moe_profile.txt",
        (
            (
                PY,
                "bench/layer_speed.py",
                "--preset",
                "qwen3-30b-a3b",
                "--tokens",
                "8192",
                "--experts",
                "grouped_mm,batched_mm,eager",
                "--profile",
                "$OUT/moe_profile.txt",
            ),
            (
                PY,
                "bench/layer_speed.py",
                "--preset",
                "qwen3-30b-a3b",
                "--tokens",
                "8192",
                "--experts",
                "grouped_mm",
                "--compile",
                "--profile",
                "$OUT/moe_profile.txt",
            ),
            (PY, "bench/layer_speed.py", "--preset", "llama3.1-8b", "--tokens", "8192"),
            (
                PY,
                "bench/layer_speed.py",
                "--preset",
                "llama3.1-8b",
                "--tokens",
                "8192",
                "--compile",
            ),
        ),
        timeout_s=200,
    ),
    "user_moe": Scenario(
        "issue 24: megatrain train on a Qwen3-30B-A3B shape cut to 12 layers at 64k "
        "tokens/step (defaults: eager until run 41, compiled by auto since) and the same "
        "compiled, beside the "
        "Llama-3.1-8B shape compiled at 64k (the reference of the same call); 8 steps each",
        (
            _cli("moe64k", *_MOE, "--timeout", "150"),
            _cli(
                "dense64k",
                *_DENSE,
                "--rows",
                "32",
                "--steps",
                "8",
                "--timeout",
                "210",
                "--",
                "--training.compile_layers",
                "true",
            ),
            _cli("moe64k_c", *_MOE, "--timeout", "170", *_COMPILE),
            (PY, "bench/cli_table.py", "--names", "dense64k,moe64k,moe64k_c"),
        ),
        timeout_s=220,
    ),
    "moe_compiled": Scenario(
        "issue 24: the compiled rows through megatrain train, beside the Llama-3.1-8B shape "
        "compiled at 64k (the reference of the machine): the Qwen3-30B-A3B shape cut to 12 "
        "layers with compile_layers true (8 steps), the Qwen3.5-27B shape cut to 16 layers "
        "with compile_layers true on torch's kernels (6 steps); a table last",
        (
            _cli("dense64k", *_DENSE, "--rows", "32", "--steps", "6", "--timeout", "170"),
            _cli("moe64k_c", *_MOE, "--timeout", "170", *_COMPILE),
            _cli(
                "hybrid64k_c",
                *_HYBRID,
                *("--steps", "6", "--timeout", "230"),
                *_COMPILE,
            ),
            (PY, "bench/cli_table.py", "--names", "dense64k,moe64k_c,hybrid64k_c"),
        ),
        timeout_s=590,
    ),
    "moe_batch": Scenario(
        "issue 24: what bounds the Qwen3-30B-A3B shape cut to 12 layers (defaults: compiled by "
        "auto): 64k tokens/step in micro-batches of 4 rows (the table's row) and of 16 (4x the "
        "tokens per expert in each grouped GEMM), the same without clipping (the CPU AdamW "
        "then overlaps the backward), and 256k tokens/step in micro-batches of 16; 6 steps each",
        (
            _cli("moe64k", *_MOE, "--steps", "6", "--timeout", "150"),
            _cli("moe64k_m16", *_MOE, "--micro", "16", "--steps", "6", "--timeout", "150"),
            _cli(
                "moe64k_m16_noclip",
                *(*_MOE, "--micro", "16", "--steps", "6", "--timeout", "150"),
                *("--", "--optimizer.max_grad_norm", "0"),
            ),
            _cli(
                "moe256k_m16",
                *_MOE,
                *("--rows", "128", "--micro", "16", "--steps", "5"),
                *("--timeout", "190"),
            ),
            (PY, "bench/cli_table.py", "--names", ",".join(_MOE_BATCH_ROWS)),
        ),
        timeout_s=200,
    ),
    "moe_noclip": Scenario(
        "issue 24's MoE bar (300 TFLOPS at 64k): the Qwen3-30B-A3B shape cut to 12 layers, 64k "
        "tokens/step in micro-batches of 4 rows (the table's row), with clipping (the default) "
        "and without (optimizer.max_grad_norm 0: each layer's CPU AdamW starts when its "
        "gradient is ready, during the backward); 6 steps each, a table last",
        (
            _cli("moe64k", *_MOE, "--steps", "6", "--timeout", "150"),
            _cli(
                "moe64k_noclip",
                *(*_MOE, "--steps", "6", "--timeout", "150"),
                *("--", "--optimizer.max_grad_norm", "0"),
            ),
            _table("moe64k", "moe64k_noclip"),
        ),
        timeout_s=330,
    ),
    "moe_noclip_m16": Scenario(
        "moe_noclip in micro-batches of 16 rows (4x the tokens per expert in each grouped GEMM, "
        "one GPU-tier block fewer): with clipping and without, 6 steps each, a table last",
        (
            _cli("moe64k_m16", *_MOE, "--micro", "16", "--steps", "6", "--timeout", "150"),
            _cli(
                "moe64k_m16_noclip",
                *(*_MOE, "--micro", "16", "--steps", "6", "--timeout", "150"),
                *("--", "--optimizer.max_grad_norm", "0"),
            ),
            _table("moe64k_m16", "moe64k_m16_noclip"),
        ),
        timeout_s=330,
    ),
    "hybrid_fla": Scenario(
        "issue 24: the Qwen3.5-27B shape cut to 16 layers at 64k with flash-linear-attention "
        "installed (Triton >= 3.7.1 and fla in the runner's site folder: "
        "bench/triton_parts.sh), the defaults (auto: hybrid layers eager; compiled they ran "
        "slower, run 41), micro-batches of 8 rows (350 TFLOPS in run 42, 345 with 4), 6 "
        "steps, beside the Llama-3.1-8B shape compiled at 64k (the machine's reference); then "
        "the qwen3_5_text bf16 verify with fla's kernels (a cold Triton cache: step 1 162 s)",
        (
            _cli("dense64k", *_DENSE, "--rows", "32", "--steps", "6", "--timeout", "170"),
            _cli("hybrid64k_fla", *_HYBRID, "--micro", "8", "--steps", "6", "--timeout", "420"),
            _verify("--model-type", "qwen3_5_text", "--tiny", "--dtype", "bf16", "--packed"),
            (PY, "bench/cli_table.py", "--names", "dense64k,hybrid64k_fla"),
        ),
        timeout_s=590,
    ),
    "hybrid_fla_compiled": Scenario(
        "issue 22: the Qwen3.5-27B shape cut to 16 layers at 64k with flash-linear-attention "
        "(carried as for hybrid_fla) and compile_layers true (auto leaves hybrid layers eager: "
        "run 45 measured 11.54 s a step against 9.60-9.83 eager), 6 steps; a cold Triton "
        "cache's step 1 takes 200 s",
        (_cli("hybrid64k_fla_c", *_HYBRID, "--steps", "6", "--timeout", "570", *_COMPILE),),
        timeout_s=590,
    ),
    "hybrid_compiled": Scenario(
        "issue 22: the Qwen3.5-27B shape cut to 16 layers at 64k with compile_layers true on "
        "torch's kernels (no flash-linear-attention): the compiled layer's planned peak "
        "(run 39's scaling) against the measured, 5 steps (compiling the chunk loop takes "
        "minutes)",
        (
            _cli(
                "hybrid64k_c",
                *_HYBRID,
                *("--steps", "5", "--timeout", "420"),
                *_COMPILE,
            ),
        ),
        timeout_s=590,
    ),
    "train_shape": Scenario(
        "megatrain train on a preset shape (Qwen2.5-3B, 8k tokens/step, 5 steps after 2 to "
        "warm up): step time, time per phase, memory, the prediction beside",
        (_cli("shape3b", *_SHAPE_3B, "--steps", "7"),),
    ),
    "long_context": Scenario(
        "issue 11: Llama-3.1-8B shape, one 128k-token row per step, clipping on, fp32 AdamW, "
        "GPU tier 0: the engine before long-row support (offload and tiling off, as config "
        "overrides) and the auto plan, 1 step after one warm-up each (each run loads its own "
        "model); GPU time per phase, peak, host RSS, predictions",
        tuple(
            _cli(name, *_ROW_8B, "--seq", "131072", "--steps", "2", "--timeout", "290", "--", *o)
            for name, o in (("row128k_old", (*_STREAMED, *_OLD_ENGINE)), ("row128k", _STREAMED))
        ),
        timeout_s=590,
    ),
    "long_context_auto": Scenario(
        "issue 11: as long_context, megatrain train alone (auto plan, torch's default sdpa "
        "order): the plan's choice at 128k, GPU peak against the predicted",
        (_cli("row128k", *_ROW_8B, "--seq", "131072", "--steps", "2", "--", *_STREAMED),),
        timeout_s=420,
    ),
    "long_context_512k": Scenario(
        "issue 11: the same shape with 4 of its 32 layers at 524,288 tokens (auto plan), 1 "
        "step after a warm-up: GPU peak beside the predicted; then the "
        "cuDNN attention kernel alone at that length, in one call and in the engine's head "
        "groups: time, TFLOPS, backward memory",
        _ROW512K_RUNS,
        timeout_s=590,
    ),
    "long_context_full512k": Scenario(
        "issue 11: the whole 32-layer shape at 524,288 tokens, one step and no warm-up (a step "
        "takes ~12 minutes, more than one device command: start it with setsid and OUT outside "
        "$OUT, poll for the process, read its log in the next command); the auto plan for this "
        "host (a 256 GiB one: on the 125 GiB H100 host the GPU is short, run 26), step "
        "time, GPU peak, host RSS, predictions",
        (_cli("row512k_full", *_ROW_8B, "--seq", "524288", *_FULL512K, "--", *_STREAMED),),
        timeout_s=1700,
    ),
    "user_512k_whole": Scenario(
        "issue 40: the whole 32-layer Llama-3.1-8B shape at one 524,288-token row a step, "
        "2 steps (the first left out of the median), every setting at its default; needs a "
        "256 GiB host and ~22 minutes: start it with setsid and OUT outside $OUT, read "
        "its log and metrics.jsonl from later commands",
        (_cli("whole512k", *_ROW_8B, "--seq", "524288", "--steps", "2", "--timeout", "1700"),),
        timeout_s=1750,
    ),
    "compare": Scenario(
        "MegaTrain vs GPU-resident, FSDP2 CPU offload and DeepSpeed ZeRO-3 offload, same job "
        "(Qwen2.5-3B shape, 8k and 32k tokens/step; DeepSpeed needs its wheels carried)",
        ((PY, "bench/compare.py", "--preset", "qwen2.5-3b", "--tokens", "8192,32768"),),
        timeout_s=580,
    ),
    "compiled_8b": Scenario(
        "issue 13: Llama-3.1-8B shape, 64k tokens/step (4 micro-batches of 8 rows), clipping on, "
        "compiled layers, 3 steps after 2 to warm up: GPU idle share (time/compute_s against "
        "step_s), model TFLOPS, the prediction beside",
        (_cli("compiled8b", *_COMPILED_8B),),
        timeout_s=330,
    ),
    "capacity_int8": Scenario(
        "issue 13: Qwen2.5-14B shape with int8 AdamW states on this host, 8k tokens/step, 3 "
        "steps after 2 to warm up, clipping on: host RSS against 8 B/param and the prediction",
        (_cli("int8_14b", *_INT8_14B),),
        timeout_s=330,
    ),
    "capacity_int8_56b": Scenario(
        "issue 13: the largest int8 model on a 512 GiB host with one GPU: a Qwen2.5-72B shape "
        "cut to 62 of its 80 layers (56.9B), 8k tokens/step, 3 steps after a warm-up, clipping "
        "on, host RSS against 8 B/param",
        (_cli("int8_56b", *_INT8_56B),),
        timeout_s=560,
    ),
    "capacity_120b": Scenario(
        "issue 41: GPT-OSS-120B's shape whole (116.8B, random init) on one H100 of the 503 GiB "
        "host, bf16 master + int4 states + int8 held gradients (4.06 B/param), clipping on, 8k "
        "tokens/step, 3 steps after a warm-up; host RSS and the node's peak against the plan "
        "(longer than one device command: start it in the background)",
        (_cli("oss120b", *_OSS_120B),),
        timeout_s=1750,
    ),
    "quality_compact": Scenario(
        "issue 41: bench/quality.py's 1.04B job, fp32 with two seeds (the noise floor), bf16 "
        "master + int4 states with int8 held gradients and clipping, and without clipping; "
        "the four at once on four GPUs",
        ((PY, "bench/quality.py", "--out", "$OUT/quality", "--gpus", "4", "--dtypes", _QUALITY),),
        timeout_s=580,
    ),
    "user_dense": Scenario(
        "issue 22's rows as users run them (megatrain train, a config file, defaults, 10 "
        "steps): Llama-3.1-8B shape at 64k tokens/step compiled, at 128k, and a Qwen3-30B-A3B "
        "shape cut to 12 layers at 64k",
        (
            _cli("dense64k", *_DENSE, "--rows", "32", *_COMPILE),
            _cli("dense128k", *_DENSE, "--rows", "64"),
            _cli("moe64k", "--preset", "qwen3-30b-a3b", "--layers", "12", "--rows", "32"),
        ),
        timeout_s=560,
    ),
    "user_512k": Scenario(
        "issue 22: a Llama-3.1-8B shape cut to 2 layers, one 524,288-token row, 10 steps",
        (
            _cli(
                "row512k",
                "--preset",
                "llama3.1-8b",
                "--layers",
                "2",
                "--seq",
                "524288",
                "--rows",
                "1",
                "--micro",
                "1",
            ),
        ),
        timeout_s=590,
    ),
    "user_hybrid": Scenario(
        "issue 22: a Qwen3.5-27B shape cut to 16 layers at 64k, eager (auto) and compiled",
        (
            _cli("hybrid64k", *_HYBRID, "--steps", "6"),
            _cli("hybrid64k_c", *_HYBRID, "--steps", "6", *_COMPILE),
        ),
        timeout_s=590,
    ),
    "user_grpo": Scenario(
        "issue 22: megatrain grpo on TRL's 8 x 8 (Qwen2.5-7B shape, vocabulary 512), 10 steps",
        (_cli("grpo7b_8x8", "--steps", "10", *_GRPO_8X8),),
        timeout_s=590,
    ),
    "user_dpo": Scenario(
        "issue 25: megatrain dpo as users run it, Llama-3.1-8B shape, 16 pairs (32 rows of "
        "~2k tokens) per step, 8 steps, beside megatrain train on the same pairs as 32 SFT "
        "rows; step time, tokens/s, the reference pass (seconds, tokens/s); a table last",
        _DPO_RUNS,
        timeout_s=285,
    ),
    "user_dpo_ranks": Scenario(
        "issue 25: user_dpo's DPO run on one GPU and on 2 ranks (--nproc 2, 16 pairs per "
        "rank): the bar, tokens/s per GPU on 2 ranks >= 0.9x one GPU; a table last",
        _DPO_RANKS,
        timeout_s=330,
    ),
    "user_vlm": Scenario(
        "issue 26: megatrain train on a Qwen2.5-VL-7B shape (random init, vision frozen as by "
        "default), 64k tokens/step (32 rows of 2048, micro 4), 8 steps: text-only rows, then "
        "the same rows with ~25% image tokens (two 448 x 448 images a row); tokens/s, "
        "images/s, TFLOPS, GPU peak and host RSS beside the estimate; a table last with the "
        "ratio of step times (the bar: images/text <= 1.15)",
        _VLM_RUNS,
        timeout_s=300,
    ),
    "user_vlm_trained": Scenario(
        "issue 26: user_vlm's image run with the vision tower and projector trained "
        "(model.freeze_vision / freeze_projector false), and bf16 verify on CUDA of the tiny "
        "VLMs with images (Qwen's windowed vision attention through the varlen kernel)",
        (
            _verify(
                "--model-type",
                "qwen2_5_vl",
                "--tiny",
                "--dtype",
                "bf16",
                "--packed",
                "--seq-len",
                "48",
            ),
            _verify(
                "--model-type",
                "qwen3_vl",
                "--tiny",
                "--dtype",
                "bf16",
                "--seq-len",
                "48",
                "--model.freeze_vision",
                "false",
                "--model.freeze_projector",
                "false",
            ),
            _verify("--model-type", "gemma3", "--tiny", "--dtype", "bf16", "--seq-len", "64"),
            _verify(
                "--model-type", "llava", "--tiny", "--dtype", "bf16", "--seq-len", "64", "--packed"
            ),
            _cli(
                "vlm7b_images_trained",
                *_VLM,
                "--images",
                "0.25",
                "--",
                "--model.freeze_vision",
                "false",
                "--model.freeze_projector",
                "false",
            ),
        ),
        timeout_s=300,
    ),
    "arch_qwen35_full": Scenario(
        "issue 24 (dense/hybrid row): the whole Qwen3.5-27B text shape (64 layers, 26.9B) on "
        "one GPU of the 251 GiB host (the 2-GPU machine), int8 AdamW states, 64k tokens/step, "
        "3 steps (the median of the last 2): tokens/s, TFLOPS, host RSS, GPU peak, the "
        "prediction beside",
        (_cli("qwen35_full", *_ARCH_QWEN35),),
        timeout_s=590,
    ),
    "arch_gpt_oss_20b": Scenario(
        "issue 24 (MoE row): the whole GPT-OSS-20B shape (24 layers, 32 experts top 4, "
        "sliding and full attention with sinks; 20.9B, 4.2B active) on one GPU of the 251 GiB "
        "host (the 2-GPU machine: the 125 GiB one cannot hold it, arch_gpt_oss_20b_125g), bf16 "
        "AdamW states, 64k tokens/step, 6 steps",
        (_cli("gpt_oss_20b", *_ARCH_GPT_OSS),),
        timeout_s=590,
    ),
    "gpt_oss_sinks": Scenario(
        "issue 24: GPT-OSS's attention sinks on sdpa's fused kernels (the default since run 43, "
        "model/sink_attention.py) against transformers' eager attention: the GPT-OSS-20B shape "
        "cut to 12 of its 24 layers (fits the 125 GiB host with bf16 states), 64k tokens/step, "
        "6 steps each; a table last with the ratio",
        (
            _cli("gpt_oss_12l", *_GPT_OSS_12),
            _cli("gpt_oss_12l_eager", *_GPT_OSS_12, "--model.attn_implementation", "eager"),
            _table("gpt_oss_12l_eager", "gpt_oss_12l"),
        ),
        timeout_s=590,
    ),
    "verify_fla": Scenario(
        "issue 24: bf16 verify on CUDA of the hybrid tiny models with flash-linear-attention's "
        "kernels (fla and Triton >= 3.7.1 in the runner's site folder: bench/triton_parts.sh); "
        "a cold Triton cache compiles every kernel first (minutes)",
        (
            _verify("--model-type", "qwen3_5_text", "--tiny", "--dtype", "bf16", "--packed"),
            _verify("--model-type", "qwen3_next", "--tiny", "--dtype", "bf16", "--packed"),
        ),
        timeout_s=590,
    ),
    "arch_gpt_oss_20b_125g": Scenario(
        "issue 24: arch_gpt_oss_20b cut to the 17 of its 24 layers that fit the 125 GiB host "
        "(the 1-GPU machine) with int8 AdamW states (15.2B, 3.3B active), 6 steps",
        (_cli("gpt_oss_17l", *_ARCH_GPT_OSS_125G),),
        timeout_s=590,
    ),
    "arch_gpt_oss_20b_int8": Scenario(
        "planning/timing.py's int8 thread exponent: arch_gpt_oss_20b with int8 AdamW states on "
        "all of the 2-GPU machine's 32 vCPUs (30 AdamW threads; run it alone, --cpus 0-31), "
        "the in-run rate of run 46's int8 kernel; then bench/adamw.py's int8 and fp32 on 30 and "
        "14 threads beside it",
        (
            _cli("gpt_oss_20b_int8", *_ARCH_GPT_OSS_INT8),
            (
                PY,
                "bench/adamw.py",
                *("--params", "1e9", "--threads", "30,14", "--state-dtypes", "fp32,int8"),
                *("--huge", "yes", "--reps", "2"),
            ),
        ),
        timeout_s=560,
    ),
    "arch_qwen3_next": Scenario(
        "issue 24 (hybrid MoE row): a Qwen3-Next-80B-A3B shape cut to 19 of its 48 layers (31.9B, "
        "1.9B active), the most that fit the 251 GiB host (the 2-GPU machine, one GPU) with int8 "
        "AdamW states, 64k tokens/step, 6 steps",
        (_cli("qwen3_next_19l", *_ARCH_QWEN3_NEXT),),
        timeout_s=590,
    ),
    "arch_qwen3_next_125g": Scenario(
        "issue 24: arch_qwen3_next cut to the 8 layers that fit the 125 GiB host (the 1-GPU "
        "machine) with int8 AdamW states (13.8B, 1.2B active), 6 steps",
        (_cli("qwen3_next_8l", *_ARCH_QWEN3_NEXT_125G),),
        timeout_s=590,
    ),
    "share_gpt_oss_20b_bf16": Scenario(
        "issue 43: the whole GPT-OSS-20B (24 layers, 20.9B) with bf16 AdamW states on one GPU "
        "whose host holds it (the 1-GPU H200 kind, or one GPU of the 4-GPU kind; run it "
        "alone, in the background: 2 rows of 6-8 minutes), the defaults against the GPU update "
        "share off in one call",
        _share_rows("oss20b_bf16", _SHARE_OSS_BF16, all_on_cpu=False),
        timeout_s=960,
    ),
    "share_gpt_oss_17l_int8": Scenario(
        "issue 43: GPT-OSS-20B cut to 17 of its 24 layers, int8 states, on the 125 GiB host: "
        "the defaults, the GPU update share off, every update on the CPU (runs 79-82)",
        _share_rows("oss17l_int8", _SHARE_OSS_17L, all_on_cpu=True),
        timeout_s=480,
    ),
    "share_qwen3_next_8l_int8": Scenario(
        "issue 43: Qwen3-Next-80B-A3B cut to 8 of its 48 layers, int8 states, on the 125 GiB "
        "host (flash-linear-attention and Triton >= 3.7.1 in the runner's site folder: "
        "bench/triton_parts.sh): the defaults, the GPU update share off, every update on the "
        "CPU (run 73 on the H200)",
        _share_rows("next8l_int8", _SHARE_NEXT_8L, all_on_cpu=True),
        timeout_s=590,
    ),
    "grpo_7b": Scenario(
        "GRPO steps on the Qwen2.5-7B shape (random weights, completions at full length), the "
        "product default (static KV cache, compiled forward, one CUDA graph per token; the "
        "compile in step 1): the seed's 8 prompts x 2 responses (3 steps) and TRL's 8 "
        "generations per prompt (2 steps), 512 + 1024 tokens; generation vs training time, "
        "GPU peak per phase, host RSS, the estimate beside",
        (
            _grpo(
                "grpo7b_2",
                *("--rows", "16", "--micro", "4", "--steps", "3", "--"),
                *_grpo_prompts(2),
            ),
            _grpo(
                "grpo7b_8",
                *("--rows", "64", "--micro", "8", "--steps", "2", "--"),
                *_grpo_prompts(8),
            ),
        ),
        timeout_s=300,
    ),
    "grpo_decode": Scenario(
        "GRPO rollouts on the Qwen2.5-7B shape, 8 prompts x 2 responses, 512 + 1024 tokens, "
        "grpo.compile_decode graphs (eager kernels in the graph, nothing compiled): ms per "
        "decoding step against grpo_7b's compiled one, prefill + capture, op_us_fit for "
        "planning/rollout.py's DECODE_OP_S",
        (
            _grpo(
                "grpo7b_graphs",
                *("--rows", "16", "--micro", "4", "--steps", "3", "--"),
                *(*_grpo_prompts(2), "--grpo.compile_decode", "graphs"),
            ),
        ),
        timeout_s=400,
    ),
    "estimate_check": Scenario(
        "the estimate each megatrain train run printed against what it measured (3B 8k/32k, "
        "7B 16k; 2 steps to warm up); a table last",
        (
            _cli("est3b_8k", *_SHAPE_3B, "--steps", "7", "--timeout", "150"),
            _cli("est3b_32k", *_SHAPE_3B, "--rows", "16", "--steps", "6", "--timeout", "180"),
            _cli("est7b_16k", *_RANKS, "--rows", "8", "--steps", "8", "--timeout", "250"),
            (PY, "bench/estimate_check.py", "$OUT/results.jsonl"),
        ),
    ),
    "ranks_compare": Scenario(
        "ranks (issue 10): Qwen2.5-7B shape, seq 2048, clipping on, 8k tokens per GPU per step: "
        "megatrain train on one GPU and on $NGPU GPUs (--nproc: torchrun), the GPU tier auto "
        "(sharded over the ranks), DeepSpeed ZeRO-3 offload on the same GPUs and rows (needs "
        "peers_install); tokens/s, per GPU (the bar: $NGPU ranks above one GPU), GPU peak, "
        "host RSS; a table of the two megatrain runs",
        (
            _cli("ranks7b_1gpu", *_RANKS),
            _cli("ranks7b_ngpu", *_RANKS, *_NGPU),
            _torchrun("bench/peers.py", "--mode", "deepspeed", *_RANKS_JOB, "--clip", "1.0"),
            _table("ranks7b_1gpu", "ranks7b_ngpu"),
        ),
        timeout_s=420,
    ),
    "ranks_weak32k": Scenario(
        "ranks (issue 10), weak scaling: as ranks_compare at 32k tokens per GPU per step (16 rows "
        "of 2048, 4 micro-batches of 4), no DeepSpeed: one GPU and $NGPU GPUs, GPU tier auto; "
        "the bar: tokens/s per GPU on $NGPU GPUs >= 0.9x one GPU",
        (
            _cli("weak7b_1gpu", *_WEAK),
            _cli("weak7b_ngpu", *_WEAK, *_NGPU),
            _table("weak7b_1gpu", "weak7b_ngpu"),
        ),
        timeout_s=480,
    ),
    "ranks_host_optimizer": Scenario(
        "ranks (issue 10): as ranks_compare's megatrain runs with every block streamed "
        "(gpu_state_blocks 0), so each rank's CPU AdamW runs its part of every block: one GPU "
        "and $NGPU ranks; the step time against the prediction",
        (
            _cli("streamed7b_1gpu", *_RANKS, "--", *_STREAMED),
            _cli("streamed7b_ngpu", *_RANKS, *_NGPU, "--", *_STREAMED),
            _table("streamed7b_1gpu", "streamed7b_ngpu"),
        ),
        timeout_s=300,
    ),
    "ranks_fetch": Scenario(
        "ranks (issue 10): how a streamed layer (Qwen2.5-7B shape, 466 MB bf16) reaches every "
        "GPU of the node: each rank's 1/N part over PCIe + NCCL all-gather (the engine's way) "
        "against each rank pulling the whole layer over its own PCIe link; one GPU alone, then "
        "$NGPU at once",
        (
            (PY, "bench/layer_fetch.py"),
            _torchrun("bench/layer_fetch.py"),
        ),
        timeout_s=180,
    ),
    "ranks_capacity": Scenario(
        "ranks (issue 10): Qwen2.5-32B shape on $NGPU GPUs (4 on a 512 GiB host), 4k tokens "
        "per GPU, 2 steps after a warm-up: host RSS of the node against the estimate's "
        "prediction (training and loading peak)",
        (_cli("ranks32b", *_RANKS_32B),),
        timeout_s=590,
    ),
    "ranks_capacity14": Scenario(
        "ranks (issue 10), capacity on a 2-GPU host (256 GiB): Qwen2.5-14B shape (14.8B) on "
        "$NGPU GPUs, 4k tokens per GPU, 2 steps after a warm-up, first with every block's "
        "states on the host (gpu_state_blocks 0: the whole 14 B/param, 193 GiB, in the node's "
        "RAM), then with the GPU tier auto; host RSS and the node's peak against the estimate",
        tuple(
            _cli(f"ranks14b_{tier}", *_RANKS_14B, "--memory.gpu_state_blocks", tier)
            for tier in ("0", "auto")
        ),
        timeout_s=420,
    ),
    "attention_kernels": Scenario(
        "causal attention alone at the Llama-3.1-8B heads (32 query, 8 kv heads of 128), bf16, "
        "8k to 512k tokens: torch's default sdpa order (what megatrain train runs) against "
        "flash and cuDNN put first; forward and backward time, TFLOPS, the backward's memory",
        ((PY, "bench/attention_kernels.py", "--seq", "8192,32768,131072,524288"),),
        timeout_s=420,
    ),
}
