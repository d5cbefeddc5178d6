"""Shared by the run tests: the demo config shrunk to a tiny model (`tiny_run_args`), a run
interrupted inside a given optimizer step (`crash_during_step`), the gradients an engine ships
(`parity_engine`, `grad_snapshot`, `rel_error`), KTO rows from the demo's preference pairs
(`kto_folder`), the exported weights of two runs compared (`assert_exports_close`), and an
engine built from a config run for a few generated steps (`engine_steps`, `block_states`), and
a checkpoint's block files read back and a resumed run checked against them
(`checkpoint_blocks`, `assert_resumes_exactly`)."""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatrain.package_assets import demo_assets_dir
from megatrain.store.blocks import ParamBlock

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
SMALL = (
    "{vocab_size: 512, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
    "num_attention_heads: 2, num_key_value_heads: 1, head_dim: 16, tie_word_embeddings: true}"
)
FEW_SAMPLES = ("--data.max_samples", "512")
"""512 of the demo's 3000 samples (69 packed rows of 256 tokens: 8 steps of 8 rows an epoch)
for runs of a few steps whose property does not depend on the rows they train on: a Trainer
tokenizes its whole data set as it is set up, ~2.5 s of the demo's on one core, ~0.4 s of these."""


def tiny_run_args(out: Path, *overrides: str) -> list[str]:
    """Overrides of examples/demo.yaml for a quick run into `out`: a 2-layer model, 512
    samples (FEW_SAMPLES), no eval split, no progress bar or TensorBoard, no export (each can
    be overridden after)."""
    return [
        "--training.output_dir", str(out), "--logging.progress_bar", "false",
        "--logging.report_to", "none", "--model.config_overrides", SMALL, *FEW_SAMPLES,
        "--data.val_size", "0", "--training.micro_batch_size", "2",
        "--checkpoint.export_hf", "false", *overrides,
    ]  # fmt: skip


def crash_during_step(trainer: Any, step: int) -> list[float]:
    """Train until the start of optimizer step `step` (1-based), then raise KeyboardInterrupt
    inside it, as a kill would; close the trainer and return the losses of the steps before."""
    real_step, seen = trainer.engine.train_step, []

    def dies(*args: object, **kwargs: object) -> object:
        if len(seen) == step - 1:
            raise KeyboardInterrupt
        result = real_step(*args, **kwargs)
        seen.append(result.loss)
        return result

    trainer.engine.train_step = dies
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    trainer.close()
    return seen


def parity_engine(lr: float) -> tuple[Any, Any, Any, dict[str, torch.Tensor]]:
    """A tiny fp32 qwen3 for a loss's parity against plain PyTorch (no clipping, no decay):
    (structure, an untouched copy of its HF model for the reference, the engine, the dict
    each shipped gradient lands in by parameter name)."""
    import copy

    from megatrain.recipes.builder import RunBuilder
    from megatrain.verify import verify_config

    cfg = verify_config(model_type="qwen3", tiny=True, max_grad_norm=0.0, weight_decay=0.0, lr=lr)
    builder = RunBuilder(cfg)
    structure = builder.model()
    reference_model = copy.deepcopy(structure.causal_lm)
    engine = builder.engine(structure, builder.store(structure))
    landed: dict[str, torch.Tensor] = {}
    engine.worker.on_landed = lambda block: grad_snapshot(block, landed)
    return structure, reference_model, engine, landed


def grad_snapshot(block: ParamBlock, out: dict[str, torch.Tensor]) -> None:
    """The block's landed gradient (an engine's `worker.on_landed`), by parameter name."""
    flat = block.grad_landing.float()
    for e in block.entries:
        out[e.full_name] = block.view(flat, e).clone()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64 (|b| floored at 1e-30)."""
    b = b.double()
    return float(
        torch.linalg.vector_norm(a.double() - b) / torch.linalg.vector_norm(b).clamp(min=1e-30)
    )


def kto_folder(folder: Path, rows: int) -> Path:
    """A data folder of `rows` KTO rows from demo_dpo's pairs: chosen desirable, rejected not,
    alternately; its dataset_info.json registers them as `kto`."""
    pairs = [json.loads(line) for line in (demo_assets_dir() / "demo_dpo.jsonl").open()][:rows]
    folder.mkdir()
    with (folder / "kto.jsonl").open("w") as f:
        for i, p in enumerate(pairs):
            good = i % 2 == 0
            row = {"instruction": p["instruction"], "input": p["input"], "label": good}
            f.write(json.dumps(row | {"output": p["chosen" if good else "rejected"]}) + "\n")
    columns = {"prompt": "instruction", "query": "input", "response": "output", "kto_tag": "label"}
    info = {"kto": {"file_name": "kto.jsonl", "columns": columns}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def assert_exports_close(one: Path, two: Path, atol: float) -> None:
    """The two runs' HF exports (output folders `one`, `two`) hold the same tensors, each
    element within `atol`, and no element differs by `atol` or more."""
    from safetensors.torch import load_file

    w1 = load_file(str(one / "hf_model" / "model.safetensors"))
    w2 = load_file(str(two / "hf_model" / "model.safetensors"))
    assert w2.keys() == w1.keys()
    moved = 0.0
    for name, ref in w1.items():
        torch.testing.assert_close(w2[name], ref, rtol=0.0, atol=atol)
        moved = max(moved, float((ref - w2[name]).abs().max()))
    assert moved < atol


def engine_steps(
    cfg: Any,
    steps: int,
    *,
    optimizer: Any = None,
    check: Any = None,
) -> tuple[list[tuple[float, float]], Any, Any, Any]:
    """(loss and grad norm per step, builder, store, engine) of `steps` generated steps of the
    engine `cfg` builds (with `optimizer` if given); `check(engine, builder, store)` runs after
    the last update, before the engine closes."""
    from megatrain.recipes.builder import RunBuilder
    from megatrain.verify import make_batches

    builder = RunBuilder(cfg)
    structure = builder.model()
    store = builder.store(structure)
    engine = builder.engine(structure, store, *([optimizer] if optimizer is not None else []))
    vocab = structure.causal_lm.config.vocab_size
    batches = make_batches(cfg, steps, vocab, 0, *builder.batch())
    results = []
    try:
        for micro in batches:
            r = engine.train_step(micro, lr=cfg.optimizer.learning_rate)
            results.append((r.loss, r.grad_norm))
        engine.wait_updates()
        if check is not None:
            check(engine, builder, store)
    finally:
        engine.close()
    return results, builder, store, engine


def block_states(store: Any, *, shadow: bool = True) -> dict[tuple[str, str], torch.Tensor]:
    """Copies of every block's master, stored AdamW states, (bf16 shadow) and step count."""
    state: dict[tuple[str, str], torch.Tensor] = {}
    for b in store.blocks:
        tensors = {"master": b.master, **b.state_tensors()}
        if shadow and b.shadow is not None:
            tensors["shadow"] = b.shadow
        state |= {(b.name, k): t.clone() for k, t in tensors.items()}
        state[(b.name, "step")] = torch.tensor(b.step)
    return state


def checkpoint_blocks(checkpoint: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of a checkpoint's `blocks/` files, by file name and key."""
    from safetensors import safe_open

    out = {}
    for file in sorted((checkpoint / "blocks").iterdir()):
        with safe_open(str(file), framework="pt") as f:
            out[file.name] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out


def assert_resumes_exactly(
    losses_of: Any, tmp: Path, common: tuple[str, ...], straight: list[float]
) -> None:
    """A 6-step run in `tmp/a` (losses `straight`, checkpoints at steps 3 and 6) resumed from
    step 3 into `tmp/b` by `losses_of(out, *overrides)`: steps 4-6 give the same losses and
    the step-6 checkpoint holds the same tensors, bit for bit."""
    resumed = losses_of(
        tmp / "b",
        *common,
        "--checkpoint.resume_from",
        str(tmp / "a" / "checkpoints" / "step-00000003"),
    )
    assert resumed == straight[3:]
    final = checkpoint_blocks(tmp / "a" / "checkpoints" / "step-00000006")
    again = checkpoint_blocks(tmp / "b" / "checkpoints" / "step-00000006")
    for name, tensors in final.items():
        for key, saved in tensors.items():
            assert torch.equal(again[name][key], saved), (name, key)


def free_port() -> int:
    """A free TCP port on this host, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Join a gloo process group of `world` processes on this host (a spawned test worker)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
