"""LayerSlots, bind_module, device_copy on the CPU, over a tiny Llama's real host store.

Five decoder layers, 1..5 slots (and more slots than layers): layer i lives in slot i % n, its
module's parameters are views of that slot's buffer, and loading copies a block only when the
slot does not already hold that layer's current weights. Copies are counted by a Transfers
subclass that records each h2d call and then does the real copy. fp32 compute, so a loaded
slot equals the layer's fp32 master bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megatrain.engine.layout import SLOTS, BlockSizes, DeviceLayout
from megatrain.engine.plan import EnginePlan
from megatrain.engine.slots import LayerSlots, bind_module, device_copy
from megatrain.engine.transfers import Event, Transfers
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import ModelStructure, discover
from megatrain.store.host import HostStore

NUM_LAYERS = 5
CPU = torch.device("cpu")


@dataclass
class Model:
    original: Any  # the HF model with its weights (a copy made before the store took them)
    structure: ModelStructure  # the weightless skeleton
    store: HostStore


@pytest.fixture(scope="module")
def model() -> Model:
    hf = load_causal_lm(
        None, model_type="llama", tiny=True, config_overrides={"num_hidden_layers": NUM_LAYERS}
    )
    original = copy.deepcopy(hf)
    structure = discover(hf)
    store = HostStore(structure, compute_dtype=torch.float32)
    return Model(original, structure, store)


class Marker:
    """A distinct completed event per compute_event() call, so ordering can be traced."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CountingTransfers(Transfers):
    """Real CPU transfers that also record every h2d copy and every compute event."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.copies: list[tuple[int, Event | None]] = []  # (slot buffer address, after)
        self.events: list[Event] = []

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after: Event | None = None) -> Event:
        self.copies.append((dst.data_ptr(), after))
        return super().h2d(dst, src, after)

    def compute_event(self) -> Event:
        self.events.append(Marker())
        return self.events[-1]


def _slots(model: Model, num_slots: int) -> tuple[LayerSlots, CountingTransfers]:
    transfers = CountingTransfers()
    plan = EnginePlan(num_slots=num_slots, clip_norm=None, loss_chunk_tokens=64)
    sizes = BlockSizes.of_store(model.store, model.structure.tied)
    slots = LayerSlots(
        model.structure.layers,
        model.store.layers,
        buffers=DeviceLayout.of(plan, sizes, torch.float32).empty(SLOTS, CPU),
        transfers=transfers,
    )
    return slots, transfers


def _slot_of(slots: LayerSlots, transfers: CountingTransfers, copy_index: int) -> int:
    address = transfers.copies[copy_index][0]
    return [b.data_ptr() for b in slots.buffers].index(address)


def test_num_slots_is_capped_at_the_layer_count(model: Model) -> None:
    # 0 slots is refused by the config (memory.num_slots >= 1, tests/config); here it is a bug
    with pytest.raises(AssertionError):
        _slots(model, 0)
    slots, _ = _slots(model, 8)
    assert slots.num_slots == NUM_LAYERS and len(slots.buffers) == NUM_LAYERS


@pytest.mark.parametrize("num_slots", [1, 2, 3, 5])
def test_layer_modules_are_views_of_their_slot(model: Model, num_slots: int) -> None:
    slots, _ = _slots(model, num_slots)
    largest = max(b.numel for b in model.store.layers)
    assert all(b.numel() == largest for b in slots.buffers)
    for i, params in enumerate(slots.params):
        s = slots.slot(i)
        assert s == i % num_slots
        buf = slots.buffers[s]
        module_params = dict(slots.modules[i].named_parameters())
        for entry, p in zip(model.store.layers[i].entries, params, strict=True):
            assert module_params[entry.name] is p and p.shape == entry.shape
            assert p.data_ptr() == buf.data_ptr() + entry.offset * buf.element_size()
        # a write to the slot buffer is what the module sees
        buf.copy_(torch.arange(buf.numel(), dtype=torch.float32))
        first, last = model.store.layers[i].entries[0], model.store.layers[i].entries[-1]
        assert module_params[first.name].reshape(-1)[0].item() == first.offset
        assert module_params[last.name].reshape(-1)[-1].item() == last.offset + last.numel - 1


def _forward_backward(slots: LayerSlots) -> list[int]:
    """The engine's schedule (engine.py: _forward, _backward) over all layers.

    Returns the layer behind each copy, in issue order. The content of each acquired module is
    checked against that layer's master on the way.
    """
    layers, n = slots.blocks, slots.num_slots
    loaded: list[int] = []

    def load(i: int) -> None:
        before = len(slots.transfers.copies)
        slots.load(i)
        loaded.extend([i] * (len(slots.transfers.copies) - before))

    def use(i: int) -> None:
        assert slots.acquire(i) is slots.modules[i]
        flat = torch.cat([p.detach().reshape(-1) for p in slots.params[i]])  # in entry order
        assert torch.equal(flat, layers[i].master), f"layer {i} holds stale weights"
        slots.release(i)

    for j in range(n):
        load(j)
    for i in range(len(layers)):
        use(i)
        if i + n < len(layers):
            load(i + n)
    for j in range(len(layers) - 1, len(layers) - 1 - n, -1):
        load(j)  # still resident from the forward: no copy
    for i in range(len(layers) - 1, -1, -1):
        use(i)
        if i - n >= 0:
            load(i - n)
    return loaded


@pytest.mark.parametrize("num_slots", [1, 2, 3, 5])
def test_backward_reuses_the_resident_last_layers(model: Model, num_slots: int) -> None:
    slots, transfers = _slots(model, num_slots)
    loaded = _forward_backward(slots)
    forward = list(range(NUM_LAYERS))
    backward = list(range(NUM_LAYERS - 1 - num_slots, -1, -1))
    assert loaded == forward + backward
    for k, layer in enumerate(loaded):
        assert _slot_of(slots, transfers, k) == layer % num_slots


def test_a_slot_is_refilled_only_after_its_release(model: Model) -> None:
    """Each copy into a used slot is ordered after the compute event of that slot's release."""
    slots, transfers = _slots(model, 2)
    slots.load(0)
    slots.load(1)
    assert [after for _, after in transfers.copies] == [None, None]  # fresh slots
    slots.acquire(0)
    slots.release(0)
    slots.acquire(1)
    slots.release(1)
    slots.load(2)
    slots.load(3)
    assert transfers.copies[2][1] is transfers.events[0]  # slot 0 after layer 0's compute
    assert transfers.copies[3][1] is transfers.events[1]  # slot 1 after layer 1's compute


def test_acquire_needs_the_layer_loaded(model: Model) -> None:
    slots, _ = _slots(model, 2)
    with pytest.raises(AssertionError, match="layer 0 not loaded"):
        slots.acquire(0)
    slots.load(0)
    slots.load(2)  # same slot: layer 0 is gone
    with pytest.raises(AssertionError, match="layer 0 not loaded"):
        slots.acquire(0)
    assert slots.holds == [2, None]


def test_invalidate_forces_a_copy_of_the_new_weights(model: Model) -> None:
    slots, transfers = _slots(model, 2)
    block = model.store.layers[1]
    slots.load(1)
    saved = block.master.clone()
    try:
        block.master.add_(1.0)  # an optimizer step on the host
        slots.load(1)
        assert len(transfers.copies) == 1  # resident: no copy, so the slot is stale...
        assert not torch.equal(slots.buffers[1], block.master)
        slots.invalidate()  # ...until the engine says the host weights changed
        assert slots.holds == [None, None]
        slots.load(1)
        assert len(transfers.copies) == 2
        assert torch.equal(slots.buffers[1][: block.numel], block.master)
    finally:
        block.master.copy_(saved)


def test_a_loaded_layer_computes_what_the_hf_layer_computes(model: Model) -> None:
    slots, _ = _slots(model, 2)
    rotary = model.original.model.rotary_emb
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, model.original.config.hidden_size, generator=gen)
    position_ids = torch.arange(7).unsqueeze(0).expand(2, -1)
    cos_sin = rotary(hidden, position_ids)
    for i in (3, 4):
        slots.load(i)
        out = slots.acquire(i)(hidden, position_embeddings=cos_sin)
        ref = model.original.model.layers[i](hidden, position_embeddings=cos_sin)
        # Same kernels on the same fp32 values; only the buffer's alignment differs, which may
        # change how a dot product of K <= 128 terms is split across SIMD lanes: a reordered
        # fp32 sum moves by at most K * 2**-24 of the sum of |terms|, here O(1) like the output.
        atol = 128 * 2**-24 * ref.abs().max().item()
        torch.testing.assert_close(out, ref, rtol=0.0, atol=atol)


def test_bind_module_binds_in_entry_order_and_gradients_flow(model: Model) -> None:
    block = model.store.layers[0]
    module = device_copy(model.structure.layers[0], CPU)
    flat = block.master.clone()
    params = bind_module({"layer": module}, block, flat)
    assert [p.shape for p in params] == [e.shape for e in block.entries]
    assert all(p.requires_grad and not p.is_meta for p in params)
    named = dict(module.named_parameters())
    for entry, p in zip(block.entries, params, strict=True):
        assert named[entry.name] is p
        assert torch.equal(p.detach(), block.view(block.master, entry))
    flat.zero_()  # the parameters are views: they follow the buffer
    assert all(float(p.detach().abs().sum()) == 0.0 for p in params)


def test_device_copy_copies_buffers_and_keeps_parameters_meta(model: Model) -> None:
    body = model.structure.causal_lm.model
    clone = device_copy(body, CPU)
    assert clone is not body
    assert all(p.is_meta for p in clone.parameters())
    original = dict(body.named_buffers())
    copied = dict(clone.named_buffers())
    assert copied.keys() == original.keys() and "rotary_emb.inv_freq" in copied
    for name, buf in copied.items():
        assert buf is not original[name] and torch.equal(buf, original[name])
