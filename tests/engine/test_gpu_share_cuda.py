"""The GPU update share on a real device (skipped without CUDA): the split between the host
worker and the GPU against the run without a share.

On CUDA the share's update is the torch reference of the host's C kernel, run on the GPU: each
float32 operation is its own elementwise kernel (no contraction into a fused multiply-add
across operations), correctly rounded, in the kernel's order, with the same scalars; the
square root is taken in float64 and rounded once, and divisions have full-size divisors
(optim/update_io.py `adamw_chunk`). The held gradient is rounded on the GPU as the host landing
holds it (the int8 codes by the same device generator as without a share). So the weights and
states equal the host path's bit for bit here too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.config import TrainConfig
from megatrain.engine.layout import DeviceLayout, held_bytes
from megatrain.planning.spec import block_sizes
from megatrain.verify import verify_config
from run_helpers import block_states, engine_steps

pytestmark = pytest.mark.gpu

LAYERS = 4
BF16_MASTER = ("--optimizer.master_dtype", "bf16")
INT4_INT8 = (*BF16_MASTER, "--optimizer.state_dtype", "int4", "--optimizer.grad_dtype", "int8")


def _cfg(share: int, *args: str, **shorthands: Any) -> TrainConfig:
    return verify_config(
        None,
        ["--optimizer.gpu_update_blocks", str(share), "--memory.gpu_state_blocks", "0", *args],
        model_type="llama",
        tiny=True,
        device="cuda",
        dtype="bf16",
        config_overrides={"num_hidden_layers": LAYERS, "tie_word_embeddings": False},
        **shorthands,
    )


def _layout_as_planned(engine: Any, builder: Any, store: Any) -> None:
    planned = DeviceLayout.of(
        engine.plan, block_sizes(builder.spec), store.compute_dtype, engine.share.formats
    )
    assert held_bytes(engine.device_buffers()) == planned.bytes_by_name()
    if engine.share.blocks:
        assert engine.share.grads is not None and engine.share.grads.is_cuda


def _train(cfg: TrainConfig, steps: int = 3) -> tuple[list[tuple[float, float]], dict, int]:
    results, _, store, engine = engine_steps(cfg, steps, check=_layout_as_planned)
    state = block_states(store)
    assert all(t.device.type == "cpu" for t in state.values())  # streamed: on the host
    return results, state, len(engine.share.blocks)


@pytest.mark.parametrize(
    ("share", "args", "clip"),
    [
        (2, ("--optimizer.impl", "c"), 1.0),
        (2, ("--optimizer.impl", "c"), 0.0),
        (3, ("--optimizer.state_dtype", "int8"), 1.0),
        (2, INT4_INT8, 1.0),
    ],
)  # fmt: skip
def test_share_on_cuda_equals_host_updates(share: int, args: tuple[str, ...], clip: float) -> None:
    host, host_state, none = _train(_cfg(0, *args, max_grad_norm=clip))
    ours, our_state, count = _train(_cfg(share, *args, max_grad_norm=clip))
    assert (none, count) == (0, share)
    assert ours == host
    for key, value in host_state.items():
        assert torch.equal(our_state[key], value), key
