"""Checkpoint bytes: what the disk check predicts from the parameter counts (planning/disk.py
`checkpoint_nbytes`), what `Checkpointer.bytes_needed` counts from the store, and the tensor
bytes the checkpoint's files hold are one number, for fp32, bf16, int8 and int4 AdamW states,
written by one process or by two ranks (each its padded part, store/shard.py); a run's disk
check and its checkpoints agree. Each rank reads its part of compressed states back as written."""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint.checkpointer import Checkpointer
from megatrain.checkpoint.saving import FORMAT_VERSION, write_blocks
from megatrain.config import load_config
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.planning import model_spec
from megatrain.planning.disk import checkpoint_nbytes, run_disk_bytes
from megatrain.recipes.sft import Trainer
from megatrain.run_files import TRAINER_STATE_FILE
from megatrain.store.host import HostStore
from megatrain.store.shard import shard_master
from run_helpers import DEMO, tiny_run_args


def tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data in the safetensors files under `folder` (headers excluded: a file
    is an 8-byte header length, the JSON header, then the tensors)."""
    total = 0
    for file in folder.rglob("*.safetensors"):
        raw = file.read_bytes()
        (header,) = struct.unpack("<Q", raw[:8])
        total += len(raw) - 8 - header
    return total


def _store(state_dtype: str, rank: int = 0, world: int = 1) -> HostStore:
    model = load_causal_lm(None, model_type="llama", tiny=True, seed=0)
    shard = None
    if world > 1:
        shard = functools.partial(shard_master, rank=rank, world=world, pin_memory=False)
    return HostStore(
        discover(model), compute_dtype=torch.float32, state_dtype=state_dtype, shard=shard
    )


def _predicted(state_dtype: str, world: int) -> int:
    spec = model_spec(load_causal_lm(None, model_type="llama", tiny=True).config)
    blocks = [spec.embed_params, *(layer.params for layer in spec.layers), spec.head_params]
    return checkpoint_nbytes(blocks, state_dtype, world=world)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
def test_one_process_writes_the_predicted_bytes(tmp_path: Path, state_dtype: str) -> None:
    store = _store(state_dtype)
    ckpt = Checkpointer(tmp_path, keep_last=1)
    path = ckpt.save(1, store, {}, run_id="r")
    written = tensor_bytes(path)
    assert written == ckpt.bytes_needed(store) == _predicted(state_dtype, world=1)
    params = sum(b.numel for b in store.blocks)
    per_param = {"fp32": 12, "bf16": 8, "int8": 6, "int4": 4}[state_dtype]
    scales = 8 * sum(-(-b.numel // 2048) for b in store.blocks) if state_dtype == "int8" else 0
    if state_dtype == "int4":  # per (partial) block of 128: 2 x 64 bytes of codes, 2 scales
        scales = (2 * 64 + 8) * sum(-(-b.numel // 128) for b in store.blocks)
    assert written == per_param * params + scales  # not 12 B/param for compressed states


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
def test_two_ranks_write_the_predicted_bytes(tmp_path: Path, state_dtype: str) -> None:
    """Each rank writes its padded part of every block (as checkpoint/shards.py has every rank
    do, into one folder); together they are what both predictions say."""
    stores = [_store(state_dtype, rank, world=2) for rank in range(2)]
    (tmp_path / "blocks").mkdir()
    for store in stores:
        write_blocks(tmp_path, store)
    assert len(list((tmp_path / "blocks").iterdir())) == 2 * len(stores[0].blocks)
    ckpt = Checkpointer(tmp_path, world_size=2, keep_last=1)
    written = tensor_bytes(tmp_path)
    assert written == ckpt.bytes_needed(stores[0]) == _predicted(state_dtype, world=2)
    assert written > _predicted(state_dtype, world=1)  # the padding to whole int8 blocks


@pytest.mark.parametrize("state_dtype", ["int8", "int4"])
def test_each_rank_reads_its_part_of_compressed_states_back(
    tmp_path: Path, state_dtype: str
) -> None:
    """Each rank's part of every block (master, codes and scales of its whole quantization
    blocks, the step) written as checkpoint/shards.py has each rank write it, read back into
    that rank's store by a 2-rank Checkpointer, bit for bit (the path of a 2-rank resume with
    compressed states; tests/distributed/test_distributed_ranks.py runs it under torchrun in
    test_compressed_states_shard_and_resume_exactly, slow-marked)."""
    gen = torch.Generator().manual_seed(0)
    written = [_store(state_dtype, rank, world=2) for rank in range(2)]
    (tmp_path / "blocks").mkdir()
    for store in written:
        for block in store.blocks:
            block.step = 3
            for t in (block.master, *block.state_tensors().values()):
                if t.dtype == torch.uint8:  # codes
                    t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
                else:
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
        write_blocks(tmp_path, store)
    state = {"format_version": FORMAT_VERSION, "step": 3, "world_size": 2}
    (tmp_path / TRAINER_STATE_FILE).write_text(json.dumps(state))
    for rank, saved in enumerate(written):
        store = _store(state_dtype, rank, world=2)
        Checkpointer(tmp_path, world_size=2, keep_last=1).load(tmp_path, store)
        for block, ref in zip(store.blocks, saved.blocks, strict=True):
            assert block.step == 3 and block.state_tensors().keys() == ref.state_tensors().keys()
            for key, t in {"master": block.master, **block.state_tensors()}.items():
                assert torch.equal(t, {"master": ref.master, **ref.state_tensors()}[key])


def test_the_run_checks_the_disk_for_the_checkpoints_it_writes(tmp_path: Path) -> None:
    """A run with int8 states plans its disk for int8 checkpoints (about half of fp32's), and
    its checkpoint holds exactly those bytes."""
    cfg = load_config(DEMO, tiny_run_args(tmp_path, "--training.max_steps", "1",
                                          "--optimizer.state_dtype", "int8"))  # fmt: skip
    trainer = Trainer(cfg)
    try:
        predicted = trainer.checkpoint_bytes()
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary.checkpoint is not None
    assert tensor_bytes(summary.checkpoint) == predicted
    params = trainer.builder.spec.total_params
    assert 6 * params <= predicted < 7 * params
    disk = run_disk_bytes(params, save_every=0, save_final=True, keep_last=1, export_hf=False,
                          export_dtype="bf16", total_steps=1, checkpoint_bytes=predicted,
                          state_dtype="int8")  # fmt: skip
    assert disk.checkpoint_bytes == predicted
    assert "AdamW m, v in int8" in disk.describe()
