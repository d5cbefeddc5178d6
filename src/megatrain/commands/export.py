"""`megatrain export --checkpoint DIR --out DIR`: a checkpoint as a Hugging Face model folder.

The run is rebuilt from the checkpoint's own config.yaml (or --config) by the same builder as
`train`, on the CPU: the model structure (random init: the weights come from the checkpoint), a
store in fp32, then the checkpoint's master weights, written as safetensors in
`checkpoint.export_dtype` (`--dtype`) with the tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatrain.config import load_config
from megatrain.run_files import CONFIG_FILE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model folder",
        description="--section.key VALUE overrides the checkpoint's config, e.g. "
        "--checkpoint.export_dtype fp32",
    )
    p.add_argument("--checkpoint", required=True, help="a checkpoints/step-N folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--config", help="the run's YAML (default: the checkpoint's config.yaml)")
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], help="checkpoint.export_dtype (default: the config's)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="export into a non-empty folder that is not a previous export (keeps its files)",
    )
    p.set_defaults(run=run, takes_overrides=True)


def run(args: argparse.Namespace) -> int:
    ckpt = Path(args.checkpoint)
    config = Path(args.config) if args.config else ckpt / CONFIG_FILE
    if not ckpt.is_dir() or not config.is_file():
        raise FileNotFoundError(
            f"{ckpt} is not a checkpoint folder with a config.yaml; give one of the "
            "<output_dir>/checkpoints/step-N folders a run wrote"
        )
    dtype = ["--checkpoint.export_dtype", args.dtype] if args.dtype else []
    cfg = load_config(config, [*args.overrides, *dtype])
    import torch  # after the checks above: a usage error answers without loading torch

    from megatrain.checkpoint.export import export_hf
    from megatrain.checkpoint.saving import load_checkpoint  # any world size: read whole
    from megatrain.distributed import Placement
    from megatrain.recipes.builder import RunBuilder

    builder = RunBuilder(cfg, placement=Placement(torch.device("cpu")))  # no GPU needed
    store = builder.store(builder.model(random_init=True), compute_dtype=torch.float32)
    load_checkpoint(ckpt, store)
    out = export_hf(
        store,
        args.out,
        dtype=cfg.checkpoint.export_dtype,
        tokenizer=builder.tokenizer(),
        overwrite=args.overwrite,
    )
    print(f"exported {ckpt} to {out}")
    return 0
