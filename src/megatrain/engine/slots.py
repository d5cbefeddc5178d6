"""GPU weight slots and the modules bound to them.

`num_slots` flat device buffers, each the size of the largest decoder layer. Layer i always
lives in slot i % num_slots, and has its own module: a copy of the HF layer made on the meta
device whose parameters are views into that slot's buffer. Loading layer i is one copy into the
buffer; its module is ready at once, with no per-step binding.

The first `resident` layers are the GPU tier (engine/tier.py): their modules are bound to the
block's device weights (`resident_weights`, on the device for the whole run), they take no slot,
and loading them is a no-op. Streamed layer i lives in slot (i - resident) % num_slots.

One module per layer rather than one per structural group: HF layers carry per-layer attributes
that parameter shapes do not reveal (sliding window or not, layer type, whether RoPE applies),
and modules cost no device memory since their parameters are views.

Compiled layers (`compile_layers`): each module is `torch.compile`d in place, with dynamic
shapes (`compile_dynamic`). Layers of one structure share their compiled code (dynamo guards on
the parameters' metadata, not on which module holds them; HF layers read their index only for
a KV cache, which training passes none of), so a run compiles one graph per layer structure and
grad mode: two (the forward under no_grad; the recompute with its backward), Gemma 3's sliding
and full layers included (the window is in the mask they get). docs/architecture.md "Compiled
layers" has the counts.

Invariants:
- A slot is overwritten only after the compute stream is done with its previous layer
  (`free` event) and, on the host, after the layer's optimizer update (caller's job).
- `holds[s]` names the layer whose current weights are in slot s, or None once those weights
  are stale (after an optimizer update): the last layers of the forward stay resident and are
  reused by the first layers of the backward without a copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from megatrain.engine.transfers import Event, Transfers
from megatrain.model.structure import ModelStructure
from megatrain.store.blocks import ParamBlock
from megatrain.store.shard import layout_numel

# (block, destination flat buffer, event to wait for) -> event marking the weights in place
LoadFn = Callable[[ParamBlock, torch.Tensor, Event | None], Event]


def bind_module(
    roots: dict[str, nn.Module], block: ParamBlock, flat: torch.Tensor
) -> list[nn.Parameter]:
    """Point the parameters of `roots` (copies of the block's HF modules) at views of `flat`.

    Returns the bound parameters in block-entry order (what autograd differentiates).
    """
    params: list[nn.Parameter] = []
    for entry in block.entries:
        owner_path, _, attr = entry.name.rpartition(".")
        owner = roots[entry.root].get_submodule(owner_path) if owner_path else roots[entry.root]
        param = nn.Parameter(block.view(flat, entry), requires_grad=True)
        setattr(owner, attr, param)
        params.append(param)
    return params


def device_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of a weightless (meta-parameter) HF module, with its buffers on `device`."""
    clone = copy.deepcopy(module)
    for sub in clone.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                sub._buffers[name] = buf.to(device)
    return clone


def move_body_buffers(structure: ModelStructure, device: torch.device) -> None:
    """Body-level buffers (rotary inv_freq, ...) where the captured body runs; layers excluded."""
    in_layers = {id(m) for m in structure.layers.modules()}
    for module in structure.body.modules():
        if id(module) in in_layers:
            continue
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device and buf.device.type != "meta":
                module._buffers[name] = buf.to(device)


def compile_dynamic(module: nn.Module) -> None:
    """torch.compile `module` in place (its bound parameters stay its own), its inputs' sizes
    symbolic from the first compile on.

    Static (torch's default), dynamo compiles for the first sizes it sees and again, with the
    changed ones symbolic, the first time one differs: each graph twice, the second time in the
    step that brings a short micro-batch or, with padded rows, another length (Llama-3.1-8B at
    64k on an H100: 21.5 s for that step against 7.1-7.4). `dynamic=True` makes every input
    dimension symbolic at once; dimensions that meet the weights (the hidden size, the head
    dim) are specialised again by them, and parameters stay static (dynamo's
    `force_parameter_static_shapes`), so what stays symbolic is rows and length: matmuls and
    attention are the same library calls, the generated elementwise kernels take those sizes
    as arguments. Sizes 0 and 1 are still specialised: a micro-batch of one row compiles once
    more. (Marking only the varying dimensions, `maybe_mark_dynamic`, would need them found
    by size in every call, and a size that matched by coincidence in one call and not in the
    next failed dynamo's guard on the marks: a recompile.)"""
    module.compile(dynamic=True)


class LayerSlots:
    def __init__(
        self,
        layers: nn.ModuleList,
        blocks: list[ParamBlock],
        *,
        buffers: list[torch.Tensor],
        transfers: Transfers,
        compile_layers: bool = False,
        resident: int = 0,
        resident_weights: Callable[[ParamBlock], torch.Tensor] | None = None,
        load: LoadFn | None = None,
    ) -> None:
        """`buffers`: the device slots (engine/layout.py: one per slot, each as long as the
        largest streamed layer); `resident_weights`: a resident layer's whole device weights
        (engine/tier.py; default its copy source); `load`: how a block's weights reach a slot
        (engine/collectives.py; default, one host-to-device copy of its copy source)."""
        assert 0 <= resident <= len(blocks), resident
        self.resident = resident
        streamed = blocks[resident:]
        assert bool(buffers) == bool(streamed), (len(buffers), len(streamed))
        assert all(b.numel() >= layout_numel(s) for b in buffers for s in streamed)
        self.num_slots = len(buffers)
        self.transfers = transfers
        self._copy_in = load or self._h2d
        self.buffers = buffers
        device = transfers.device
        self.modules: list[nn.Module] = []
        self.params: list[list[nn.Parameter]] = []
        for i, (layer, block) in enumerate(zip(layers, blocks, strict=True)):
            module = device_copy(layer, device)
            if i < resident:
                flat = block.source if resident_weights is None else resident_weights(block)
            else:
                flat = self.buffers[self.slot(i)]
            self.params.append(bind_module({"layer": module}, block, flat))
            if compile_layers:
                compile_dynamic(module)
            self.modules.append(module)
        if compile_layers:
            # One compiled graph per layer structure and grad mode (module docstring); allow
            # one per layer and mode for a model whose layers differ in a guarded attribute.
            dynamo = torch._dynamo.config
            dynamo.cache_size_limit = max(dynamo.cache_size_limit, 4 * len(blocks))
            dynamo.accumulated_cache_size_limit = max(
                dynamo.accumulated_cache_size_limit, 8 * len(blocks)
            )
        self.blocks = blocks
        self.holds: list[int | None] = [None] * self.num_slots
        self._ready: list[Event | None] = [None] * self.num_slots
        self._free: list[Event | None] = [None] * self.num_slots

    def slot(self, layer: int) -> int:
        assert layer >= self.resident, f"layer {layer} is resident, it has no slot"
        return (layer - self.resident) % self.num_slots

    def load(self, layer: int) -> None:
        """Start copying `layer` into its slot unless its current weights are already there."""
        if layer < self.resident:
            return  # GPU tier: its weights never leave the device
        s = self.slot(layer)
        if self.holds[s] == layer:
            return
        self._ready[s] = self._copy_in(self.blocks[layer], self.buffers[s], self._free[s])
        self.holds[s] = layer

    def _h2d(self, block: ParamBlock, dst: torch.Tensor, after: Event | None) -> Event:
        return self.transfers.h2d(dst[: block.numel], block.source, after=after)

    def acquire(self, layer: int) -> nn.Module:
        """The layer's module, once its weights are on the device (compute stream waits)."""
        if layer < self.resident:
            return self.modules[layer]  # updated on the compute stream itself: no wait
        s = self.slot(layer)
        assert self.holds[s] == layer, f"layer {layer} not loaded (slot {s} has {self.holds[s]})"
        self.transfers.wait(self._ready[s])
        return self.modules[layer]

    def release(self, layer: int) -> None:
        """Compute issued so far is the last use of this slot's content."""
        if layer >= self.resident:
            self._free[self.slot(layer)] = self.transfers.compute_event()

    def invalidate(self) -> None:
        """The host weights changed (optimizer step): nothing on the device is current."""
        self.holds = [None] * self.num_slots
