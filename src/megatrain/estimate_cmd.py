"""`megatrain estimate`: host RAM, GPU peak and step time of a setup, without loading weights.

    megatrain estimate --config examples/qwen2_5_7b.yaml [--section.key VALUE ...]
    megatrain estimate --model Qwen/Qwen2.5-7B --seq-len 4096 --micro-batch-size 4 --grad-accum 8
    megatrain estimate --model-type qwen3 --tiny --seq-len 256 --tokens-per-step 4096 --json

Only the model's config is read (hub id, local directory, or a transformers model type); the
model is built on the meta device. With `--config`, the run's YAML (megatrain.config) gives the
model, sequence length, batch, dtype, slots, margins and packing; flags given here override it.
`--micro-batch-size auto` picks the largest micro-batch whose predicted GPU peak fits. The
machine is this one (`--probe` measures its rates, a few seconds) with the H100 test host's
numbers for whatever is not measured; `--gpu-gib` / `--host-gib` set the memory sizes.

Prints a table, or with `--json` one JSON object. Exit status 0 when the setup fits, 1 when it
does not (the reasons are printed), 2 for a usage error (raised as ValueError to the CLI).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from megatrain.model.loading import load_config as load_hf_config
from megatrain.model.loading import parse_config_sets
from megatrain.resources import (
    check_fits,
    detect,
    estimate,
    format_estimate,
    model_spec,
    pick_micro_batch,
    probe,
)


@dataclass(frozen=True)
class _Setup:
    """What to estimate, from the run config and the flags (flags win)."""

    source: str | None
    model_type: str | None
    tiny: bool
    trust_remote_code: bool
    attn_implementation: str | None
    overrides: dict[str, Any]
    seq_len: int
    micro_batch_size: int | str
    grad_accum: int | None
    tokens_per_step: int | None
    dtype: str
    num_slots: int
    layout: str
    clipping: bool
    loss_chunk_tokens: int | None
    pin_memory: bool
    gpu_margin_gib: float
    host_margin_gib: float


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("model (one of)")
    src.add_argument("--config", help="a run's YAML file (megatrain train --config)")
    src.add_argument("--model", help="hub id or local directory (only config.json is read)")
    src.add_argument("--model-type", help="a transformers model type, e.g. qwen3")
    src.add_argument("--tiny", action="store_true", help="tiny random config of --model-type")
    src.add_argument("--trust-remote-code", action="store_true")
    src.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. num_hidden_layers=4",
    )
    run = parser.add_argument_group("setup (default: the --config file's values)")
    run.add_argument("--seq-len", type=int, help="tokens per row")
    run.add_argument("--micro-batch-size", help="rows per micro-batch, or auto")
    steps = run.add_mutually_exclusive_group()
    steps.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    steps.add_argument(
        "--tokens-per-step", type=int, help="tokens per optimizer step (grad accumulation follows)"
    )
    run.add_argument("--dtype", choices=["bf16", "fp32"], help="compute dtype")
    run.add_argument("--num-slots", type=int, help="GPU weight slots")
    run.add_argument(
        "--layout",
        choices=["padded", "packed", "full"],
        help="rows padded (4-D masks), packed samples, or full rows without mask",
    )
    run.add_argument("--max-grad-norm", type=float, help="0: no clipping")
    hw = parser.add_argument_group("hardware")
    hw.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine's PCIe, matmul and CPU optimizer rates",
    )
    hw.add_argument("--gpu-gib", type=float, help="GPU memory (default: this GPU or 80)")
    hw.add_argument("--host-gib", type=float, help="host RAM (default: this machine's)")
    hw.add_argument("--gpu-margin-gib", type=float, help="GPU memory to leave free")
    hw.add_argument("--host-margin-gib", type=float, help="host RAM to leave free")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    # Unknown `--section.key VALUE` tokens override the --config file: cli.main collects them
    # (parse_known_args) into args.overrides for subcommands that set takes_overrides.
    parser.set_defaults(takes_overrides=True)


def run_estimate(args: argparse.Namespace) -> int:
    setup = _setup(args)
    try:
        config = load_hf_config(
            setup.source,
            model_type=setup.model_type,
            tiny=setup.tiny,
            trust_remote_code=setup.trust_remote_code,
            overrides=setup.overrides or None,
        )
    except FileNotFoundError:
        raise
    except OSError as e:  # hub unreachable, unknown repo
        raise ValueError(
            f"cannot read the model config of {setup.source!r}: "
            f"{str(e).splitlines()[0]} (offline: give a local directory holding "
            "its config.json, or --model-type NAME)"
        ) from e
    spec = model_spec(config, setup.dtype, setup.attn_implementation)
    hardware = (
        probe(gpu_gib=args.gpu_gib, host_gib=args.host_gib)
        if args.probe
        else detect(gpu_gib=args.gpu_gib, host_gib=args.host_gib)
    )
    common: dict[str, Any] = dict(
        seq_len=setup.seq_len,
        num_slots=setup.num_slots,
        padded=setup.layout == "padded",
        packed=setup.layout == "packed",
        clipping=setup.clipping,
    )
    reason = None
    if setup.micro_batch_size == "auto":
        mbs, grad_accum, reason = pick_micro_batch(
            spec,
            tokens_per_step=setup.tokens_per_step,
            grad_accum=setup.grad_accum,
            hardware=hardware,
            gpu_margin_gib=setup.gpu_margin_gib,
            **common,
        )
    else:
        mbs, grad_accum = int(setup.micro_batch_size), _grad_accum(setup)
    est = estimate(
        spec,
        micro_batch_size=mbs,
        grad_accum=grad_accum,
        hardware=hardware,
        loss_chunk_tokens=setup.loss_chunk_tokens,
        pin_memory=setup.pin_memory,
        **common,
    )
    try:
        check_fits(
            est,
            hardware,
            host_margin_gib=setup.host_margin_gib,
            gpu_margin_gib=setup.gpu_margin_gib,
        )
        problem = None
    except ValueError as e:
        problem = str(e)
    if args.json:
        print(
            json.dumps(
                {
                    **est.to_dict(),
                    "fits": problem is None,
                    "problem": problem,
                    "micro_batch_reason": reason,
                }
            )
        )
    else:
        print(format_estimate(est))
        if reason:
            print(f"auto micro-batch: {reason}")
        print(
            f"fits: {'yes' if problem is None else 'no'} (margins: GPU "
            f"{setup.gpu_margin_gib:g} GiB, host {setup.host_margin_gib:g} GiB)"
        )
        if problem:
            print(problem)
    return 0 if problem is None else 1


def _grad_accum(setup: _Setup) -> int:
    if setup.tokens_per_step is None:
        return setup.grad_accum or 1
    rows = setup.tokens_per_step // setup.seq_len
    mbs = int(setup.micro_batch_size)
    if rows < mbs or rows % mbs or rows * setup.seq_len != setup.tokens_per_step:
        raise ValueError(
            f"--tokens-per-step {setup.tokens_per_step} must be a multiple of "
            f"micro_batch_size x seq_len = {mbs * setup.seq_len}"
        )
    return rows // mbs


def _setup(args: argparse.Namespace) -> _Setup:
    sources = [x for x in (args.config, args.model, args.model_type) if x]
    if len(sources) != 1:
        raise ValueError(
            "estimate needs exactly one of --config FILE, --model ID|PATH, --model-type NAME"
        )
    overrides = getattr(args, "overrides", None) or []
    if overrides and not args.config:
        raise ValueError(f"unexpected arguments {overrides}: --section.key overrides need --config")
    sets = parse_config_sets(args.set)
    if args.config:
        return _from_run_config(args, overrides, sets)
    if args.seq_len is None:
        raise ValueError("give --seq-len N (or a --config file)")
    return _Setup(
        source=args.model,
        model_type=args.model_type,
        tiny=args.tiny,
        trust_remote_code=args.trust_remote_code,
        attn_implementation=None,
        overrides=sets,
        seq_len=args.seq_len,
        micro_batch_size=_mbs(args.micro_batch_size or "1"),
        grad_accum=(args.grad_accum or 1) if args.tokens_per_step is None else None,
        tokens_per_step=args.tokens_per_step,
        dtype=args.dtype or "bf16",
        num_slots=args.num_slots or 2,
        layout=args.layout or "padded",
        clipping=(1.0 if args.max_grad_norm is None else args.max_grad_norm) > 0,
        loss_chunk_tokens=None,
        pin_memory=True,
        gpu_margin_gib=_pick(args.gpu_margin_gib, 2.0),
        host_margin_gib=_pick(args.host_margin_gib, 4.0),
    )


def _from_run_config(
    args: argparse.Namespace, overrides: list[str], sets: dict[str, Any]
) -> _Setup:
    from megatrain.config import load_config

    cfg = load_config(args.config, overrides)
    m, t, mem = cfg.model, cfg.training, cfg.memory
    grad_accum = _pick(args.grad_accum, t.gradient_accumulation_steps)
    return _Setup(
        source=m.name_or_path,
        model_type=m.model_type,
        tiny=m.tiny,
        trust_remote_code=m.trust_remote_code,
        attn_implementation=m.attn_implementation,
        overrides={**m.config_overrides, **sets},
        seq_len=_pick(args.seq_len, t.seq_len or cfg.data.cutoff_len),
        micro_batch_size=_mbs(args.micro_batch_size or str(t.micro_batch_size)),
        grad_accum=None if args.tokens_per_step is not None else grad_accum,
        tokens_per_step=args.tokens_per_step,
        dtype=args.dtype or m.compute_dtype,
        num_slots=_pick(args.num_slots, mem.num_slots),
        layout=args.layout or cfg.data.layout(),
        clipping=_pick(args.max_grad_norm, cfg.optimizer.max_grad_norm) > 0,
        loss_chunk_tokens=mem.loss_chunk_tokens,
        pin_memory=mem.pin_memory,
        gpu_margin_gib=_pick(args.gpu_margin_gib, mem.gpu_margin_gib),
        host_margin_gib=_pick(args.host_margin_gib, mem.host_margin_gib),
    )


def _pick(flag: Any, default: Any) -> Any:
    return default if flag is None else flag


def _mbs(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--micro-batch-size must be an integer >= 1 or auto, got {text!r}")
    return value
