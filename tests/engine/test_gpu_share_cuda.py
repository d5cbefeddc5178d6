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

import mmap
from typing import Any

import pytest
import torch

from megatrain.config import TrainConfig
from megatrain.engine import gpu_share
from megatrain.engine.layout import DeviceLayout, held_bytes
from megatrain.planning.spec import block_sizes
from megatrain.store import memory
from megatrain.verify import verify_config
from run_helpers import block_states, engine_steps

pytestmark = pytest.mark.gpu

LAYERS = 4
BF16_MASTER = ("--optimizer.master_dtype", "bf16")
INT4_INT8 = (*BF16_MASTER, "--optimizer.state_dtype", "int4", "--optimizer.grad_dtype", "int8")


def _cfg(share: int, *args: str, model_type: str = "llama", **shorthands: Any) -> TrainConfig:
    return verify_config(
        None,
        ["--optimizer.gpu_update_blocks", str(share), "--memory.gpu_state_blocks", "0", *args],
        model_type=model_type,
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
        (3, ("--optimizer.state_dtype", "int8", "--optimizer.gpu_update_sets", "2"), 1.0),
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


def test_share_seconds_are_its_gpu_span() -> None:
    """`time/gpu_update_s` on CUDA: the waited blocks' GPU span from CUDA events (the update
    only queues its work, so the worker's own time would miss it), positive and read once."""
    spans: list[float] = []

    def read(engine: Any, builder: Any, store: Any) -> None:
        spans.extend([engine.share.collect_seconds(), engine.share.collect_seconds()])

    engine_steps(_cfg(2, "--optimizer.state_dtype", "int8"), 2, check=read)
    assert 0 < spans[0] < 60 and spans[1] == 0.0


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("states", ["int8", "fp32"])
def test_share_on_gpt_oss_equals_host_updates(
    states: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-OSS blocks (expert biases, attention sinks: more no-decay entries), as in run 62's
    diagnostic: bit for bit the host updates. `in_place`: the store's tensors on mappings of
    their own from 4 KiB up (not 32 MiB), so the share page-locks them where they lie
    (store/memory.py `pin_in_place`, cudaHostRegister), as it does a large model's; a tiny
    model's are otherwise copied into CUDA's pinned memory."""
    pinned: list[bool] = []
    if in_place:
        monkeypatch.setattr(memory, "HUGE_PAGE_MIN_BYTES", mmap.PAGESIZE)
        real = gpu_share.pin_in_place

        def pin(tensor: torch.Tensor) -> bool:
            pinned.append(real(tensor))
            return pinned[-1]

        monkeypatch.setattr(gpu_share, "pin_in_place", pin)
    args = ("--optimizer.state_dtype", states)
    host, host_state, _ = _train(_cfg(0, *args, model_type="gpt_oss", max_grad_norm=1.0))
    ours, our_state, count = _train(_cfg(3, *args, model_type="gpt_oss", max_grad_norm=1.0))
    assert any(pinned) == in_place
    assert count == 3 and ours == host
    for key, value in host_state.items():
        assert torch.equal(our_state[key], value), key
