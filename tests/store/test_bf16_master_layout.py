"""bf16 master weights in the store and the planner: bytes per parameter (store, estimator,
checkpoint and fit check agree), sharded updates, the GPU tier, and the optimizer.master_dtype
key."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config

from megatrain.checkpoint.checkpointer import Checkpointer
from megatrain.config import load_config
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.model.tiny import tiny_config
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.planning import Hardware, host_problem, model_spec
from megatrain.planning.disk import checkpoint_bytes_per_param, checkpoint_nbytes
from megatrain.planning.hardware import GIB
from megatrain.planning.plan import plan_resources
from megatrain.planning.ranks import Ranks
from megatrain.planning.run_shape import RunShape
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import GRAD_BLOCK, POOL_LANDINGS
from megatrain.store.host import HostStore
from megatrain.store.int4 import INT4_BLOCK, INT4_HALF, int4_nbytes
from megatrain.store.master import weight_bytes_per_param
from megatrain.store.shard import shard_block, shard_master
from megatrain.store.states import QUANT_BLOCK, allocate_states
from predict import predict
from shapes import QWEN25_3B

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
# m + v bytes of one parameter, the int8 scales left out (counted per block below)
STATE_BYTES = {"fp32": 8, "bf16": 4, "int8": 2}


def _store(state_dtype: str, rank: int = 0, world: int = 1, **hold: Any) -> HostStore:
    model = load_causal_lm(None, model_type="llama", tiny=True, seed=0)
    shard = None
    if world > 1:
        shard = functools.partial(shard_master, rank=rank, world=world, pin_memory=False)
    return HostStore(
        discover(model),
        compute_dtype=torch.bfloat16,
        state_dtype=state_dtype,
        master_dtype="bf16",
        shard=shard,
        **hold,
    )


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
def test_store_bytes_equal_the_estimate(state_dtype: str) -> None:
    """2 (bf16 master) + 2 (bf16 gradient landing) + m and v per parameter, no shadow."""
    store = _store(state_dtype)
    for block in store.blocks:
        assert block.master.dtype == torch.bfloat16 and block.master_dtype == "bf16"
        assert block.shadow is None and block.source is block.master
        assert block.grad is not None and block.grad_landing is block.grad
        assert block.grad.dtype == torch.bfloat16
    numels = [b.numel for b in store.blocks]
    if state_dtype == "int4":  # two codes a byte per state, an fp32 absmax per 128 per state
        states = sum(2 * (INT4_HALF + 4) * math.ceil(n / INT4_BLOCK) for n in numels)
    else:
        states = sum(STATE_BYTES[state_dtype] * n for n in numels)
    expected = sum(4 * n for n in numels) + states
    if state_dtype == "int8":
        expected += sum(8 * math.ceil(n / QUANT_BLOCK) for n in numels)
    assert store.host_bytes() == expected
    spec = model_spec(tiny_config("llama"))
    est = predict(spec, seq_len=32, micro_batch_size=1, state_dtype=state_dtype,
                  master_dtype="bf16")  # fmt: skip
    assert est.host.store_bytes == store.host_bytes()
    assert est.settings["master_dtype"] == "bf16"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("grad_dtype", "clipping"), [("int8", True), ("bf16", False)])
def test_held_gradient_bytes_equal_the_estimate(
    grad_dtype: str, clipping: bool, world: int
) -> None:
    """int8 held gradients (clipping on): per block int8 codes + one fp32 unit per 2048 values,
    where the bf16 landing took 2 bytes a value. Clipping off: no block owns a landing; the
    store has POOL_LANDINGS bf16 landings of its largest block. The store allocates what the
    planner counts, whole or as a rank's shards."""
    stores = [_store("int4", r, world, grad_dtype=grad_dtype, clipping=clipping)
              for r in range(world)]  # fmt: skip
    for store in stores:
        for block in store.blocks:
            if grad_dtype == "int8":
                assert block.grad is not None and block.grad.dtype == torch.int8
                assert block.grad_unit is not None
                assert block.grad_unit.numel() == math.ceil(block.numel / GRAD_BLOCK)
            else:
                assert block.grad is None and block.grad_pool is store.grad_pool
        own = sum(b.master.numel() * 2 + int4_nbytes(b.numel) for b in store.blocks)
        if grad_dtype == "int8":
            own += sum(b.numel + 4 * math.ceil(b.numel / GRAD_BLOCK) for b in store.blocks)
        else:
            assert store.grad_pool is not None
            own += POOL_LANDINGS * 2 * max(b.numel for b in store.blocks)
        assert store.host_bytes() == own
    spec = model_spec(tiny_config("llama"))
    est = predict(spec, seq_len=32, micro_batch_size=1, state_dtype="int4", master_dtype="bf16",
                  grad_dtype=grad_dtype, clipping=clipping, pin_memory=False,
                  ranks=Ranks(world, 1))  # fmt: skip
    assert est.host.store_bytes == sum(s.host_bytes() for s in stores)
    assert est.settings["grad_dtype"] == grad_dtype


def test_bytes_per_parameter_of_a_large_model() -> None:
    """bf16 compute: 12, 8 and ~6 bytes per parameter, 2 less than an fp32 master's 14, 10, ~8
    (the master's 4 + the shadow's 2 become the master's 2 + the gradient landing's 2)."""
    assert weight_bytes_per_param("fp32") == 6 and weight_bytes_per_param("bf16") == 4
    spec = model_spec(tiny_config("llama", hidden_size=1024, intermediate_size=4096))
    per_param = {}
    for state_dtype in ("fp32", "bf16", "int8"):
        est = predict(spec, seq_len=32, micro_batch_size=1, state_dtype=state_dtype,
                      master_dtype="bf16")  # fmt: skip
        per_param[state_dtype] = est.host.store_bytes / est.total_params
    assert per_param["fp32"] == 12 and per_param["bf16"] == 8
    assert 6 < per_param["int8"] <= 6 + 8 / 2048 + 1e-6
    assert checkpoint_bytes_per_param("fp32", "bf16") == 10  # 2 master + 8 states
    assert checkpoint_bytes_per_param("int8", "bf16") == 4 + 8 / 2048


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoints_hold_the_predicted_bytes(tmp_path: Path, world: int) -> None:
    """A checkpoint stores the bf16 master (2 B/param) and the states: as predicted, whole or
    sharded (each rank its padded part, the master a bf16 shard)."""
    stores = [_store("int8", rank, world) for rank in range(world)]
    assert all(b.master.dtype == torch.bfloat16 for s in stores for b in s.blocks)
    ckpt = Checkpointer(tmp_path, world_size=world, keep_last=1)
    spec = model_spec(load_causal_lm(None, model_type="llama", tiny=True).config)
    blocks = [spec.embed_params, *(layer.params for layer in spec.layers), spec.head_params]
    predicted = checkpoint_nbytes(blocks, "int8", world=world, master_dtype="bf16")
    assert ckpt.bytes_needed(stores[0]) == predicted
    assert predicted < checkpoint_nbytes(blocks, "int8", world=world)  # the fp32 master's


def test_fit_check_suggests_a_bf16_master() -> None:
    spec = model_spec(tiny_config("llama", hidden_size=1024, intermediate_size=4096))
    params = spec.total_params
    # a host that holds the bf16-master store (12 B/param, 13.3 while the largest of these
    # layers, a third of the model, exists once more in fp32 as it loads) but not the fp32 one
    hw = Hardware(host_bytes=int(13.5 * params) + GIB, process_baseline_bytes=0)
    kwargs = dict(seq_len=32, micro_batch_size=1, hardware=hw, pin_memory=False)
    fp32 = predict(spec, **kwargs)  # type: ignore[arg-type]
    bf16 = predict(spec, master_dtype="bf16", **kwargs)  # type: ignore[arg-type]
    assert host_problem(bf16, hw, margin_gib=1.0) is None
    problem = host_problem(fp32, hw, margin_gib=1.0)
    assert problem is not None and "Use optimizer.master_dtype: bf16 (12.00 B/param" in problem


def test_the_gpu_tier_takes_no_block_of_a_bf16_master() -> None:
    shape = RunShape(
        seq_len=4096, num_slots=2, layout="full", clip_norm=1.0, loss_chunk_tokens=None,
        pin_memory=False, check_gpu=True, state_dtype="fp32", master_dtype="bf16",
        gpu_state_blocks="auto",
    )  # fmt: skip
    plan = plan_resources(
        model_spec(Qwen2Config(**QWEN25_3B)), shape, hardware=Hardware(), micro_batch_size=1,
        grad_accum=2, gpu_margin_gib=2, host_margin_gib=4,
    )  # fmt: skip
    assert plan.gpu_state_blocks == 0
    assert plan.tier_reason == "GPU tier: none (master_dtype bf16: fp32 only)"


def test_master_dtype_config_key() -> None:
    assert load_config(DEMO, []).optimizer.master_dtype == "fp32"
    bf16 = ["--optimizer.master_dtype", "bf16", "--model.compute_dtype", "bf16"]
    assert load_config(DEMO, bf16).optimizer.master_dtype == "bf16"
    with pytest.raises(ValueError, match=r"optimizer.master_dtype='fp16' must be one of"):
        load_config(DEMO, ["--optimizer.master_dtype", "fp16"])
    with pytest.raises(ValueError, match=r"set model.compute_dtype: bf16, or optimizer.master"):
        load_config(DEMO, ["--optimizer.master_dtype", "bf16", "--model.compute_dtype", "fp32"])
    with pytest.raises(ValueError, match=r"gpu_state_blocks=2 with optimizer.master_dtype: bf16"):
        load_config(DEMO, [*bf16, "--memory.gpu_state_blocks", "2"])


def test_a_sharded_bf16_master_updates_as_the_whole_block() -> None:
    """Rank 0's shard (offset 0: the whole block's rounding keys) equals the whole block bit
    for bit over several steps; the other shards salt their keys with their offset, so after
    one step each of their weights is one of the same two bf16 neighbours of the same fp32
    value as the whole block's: at most one bf16 ulp apart."""
    n, decay, world = 5 * QUANT_BLOCK + 123, 3 * QUANT_BLOCK + 7, 3
    gen = torch.Generator().manual_seed(0)
    whole = ParamBlock(
        name="layer.2", entries=[], numel=n, decay_numel=decay,
        master=(torch.randn(n, generator=gen) * 0.02).bfloat16(), state_dtype="fp32",
        **allocate_states(n, "fp32"),  # type: ignore[arg-type]
    )  # fmt: skip
    whole.grad = torch.zeros(n, dtype=torch.bfloat16)
    shards = [shard_block(whole, rank, world, pin_memory=False) for rank in range(world)]
    assert all(s.master.dtype == s.grad_landing.dtype == torch.bfloat16 for s in shards)
    opt = CpuAdamW(AdamWHyper(weight_decay=0.1), num_threads=2)
    for step in range(3):
        grad = torch.randn(n, generator=gen).bfloat16()
        whole.grad_landing.copy_(grad)
        opt.update(whole, lr=1e-3)
        padded = torch.cat([grad, torch.zeros(shards[0].padded_numel - n, dtype=grad.dtype)])
        for s in shards:
            s.grad_landing.copy_(padded[s.shard_offset : s.shard_offset + s.numel])
            opt.update(s, lr=1e-3)
        masters = torch.cat([s.master for s in shards])[:n]
        first = shards[0].numel
        assert torch.equal(masters[:first], whole.master[:first])
        if step == 0:
            ulp = torch.ldexp(torch.ones(n), torch.frexp(whole.master.float())[1] - 8)
            assert bool(((masters.float() - whole.master.float()).abs() <= ulp).all())
            assert not torch.equal(masters, whole.master)  # the other shards' bits differ
