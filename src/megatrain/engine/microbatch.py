"""Per-micro-batch state of one step, and the embedding that starts it.

The embedding table never goes to the GPU whole: the rows a micro-batch uses are gathered on
the host from the embedding block's copy source (bf16 shadow, or fp32 master), copied over, and
fed to a device copy of the HF embedding module through remapped ids. The module's own forward
runs (so scaled embeddings such as Gemma's are exact), and its gradient w.r.t. the gathered rows
is scattered back into the full-table accumulator at the end of the backward. An embedding in
the GPU tier (engine/tier.py, `table`) has its table on the device: rows are gathered there.
Sharded runs (several ranks) have no host holding the whole table: the engine all-gathers it on
the device each step (`device_table`) and the rows are selected there too.

Shapes: B = batch rows, S = sequence, D = hidden, U = distinct token ids of the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.engine.transfers import Transfers
from megatrain.model.capture import LayerCall, LayerCallCapture
from megatrain.model.router import RouterStats
from megatrain.store.blocks import ParamBlock


@dataclass
class MicroBatch:
    targets_BS: torch.Tensor  # host: shifted labels, position t predicts targets[t]
    rows_UD: torch.Tensor  # device: gathered embedding rows (autograd leaf when training)
    ids_U: torch.Tensor  # device: which table row each gathered row is
    first_BSD: torch.Tensor  # device: input of layer 0, a function of rows_UD
    calls: list[LayerCall]
    router_weights: torch.Tensor | None  # device: flat attention mask (MoE aux loss weights)
    hidden: torch.Tensor  # device: current boundary activation
    saved: list[torch.Tensor | None] = field(default_factory=list)  # input of each layer
    rng: list[Any] = field(default_factory=list)  # RNG state before each layer's forward
    grad: torch.Tensor | None = None  # gradient w.r.t. `hidden` during the backward
    router_stats: list[RouterStats] = field(default_factory=list)
    router_total: RouterStats | None = None
    # trained vision modules (engine/vision.py): what their backward runs the capture again on
    device_batch: Batch | None = None
    inverse_S: torch.Tensor | None = None  # device: each position's gathered row
    after_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # at deepstack injections


def shifted_targets(labels_BS: torch.Tensor) -> torch.Tensor:
    targets = torch.full_like(labels_BS, IGNORE_INDEX)
    targets[:, :-1] = labels_BS[:, 1:]
    return targets


class Embedder:
    def __init__(
        self,
        embed: nn.Module,
        block: ParamBlock,
        transfers: Transfers,
        dtype: torch.dtype,
        *,
        table: torch.Tensor | None = None,
    ) -> None:
        """`table`: the whole flat table in the compute dtype on the device (the GPU tier's)."""
        if [e.name for e in block.entries] != ["weight"] or len(block.entries[0].shape) != 2:
            raise ValueError(
                f"input embedding {type(embed).__name__} must have exactly one 2-D weight; "
                f"found {[(e.name, tuple(e.shape)) for e in block.entries]}"
            )
        self.module: Any = embed  # a device copy; its weight is set per micro-batch
        del self.module._parameters["weight"]
        self.pad_idx = getattr(embed, "padding_idx", None)
        self.block = block
        self.transfers = transfers
        self.dtype = dtype
        self.shape = block.entries[0].shape
        # [V, D] in the compute dtype on the device: the tier's own, or set per step when sharded
        self.device_table = None if table is None else table[: self.shape.numel()].view(self.shape)

    def start(
        self,
        batch: Batch,
        capture: LayerCallCapture,
        training: bool,
        with_router_weights: bool,
        keep_inputs: bool = False,
    ) -> MicroBatch:
        """`keep_inputs`: the micro-batch keeps its device inputs (trained vision modules)."""
        device = self.transfers.device
        uniq, inverse = torch.unique(batch.input_ids, return_inverse=True)
        if self.device_table is not None:  # GPU tier or sharded: the table is on the device
            rows = self.device_table.index_select(0, uniq.to(device, non_blocking=True))
        else:
            table = self.block.source.view(self.shape)
            rows_host = torch.empty(
                (uniq.numel(), self.shape[1]), dtype=table.dtype, pin_memory=self.transfers.is_cuda
            )
            torch.index_select(table, 0, uniq, out=rows_host)
            rows, copied = self.transfers.h2d_new(rows_host, self.dtype)
            self.transfers.wait(copied)
        assert rows.dtype == self.dtype
        rows.requires_grad_(training)
        dev = batch.to(device)
        self.module.weight = rows  # a plain attribute: the parameter was removed
        if self.pad_idx is not None:
            hit = torch.nonzero(uniq == self.pad_idx)
            self.module.padding_idx = int(hit[0, 0]) if hit.numel() else None
        inverse = inverse.to(device, non_blocking=True)
        with torch.set_grad_enabled(training):
            embeds = self.module(inverse)
            captured = capture.of_batch(embeds, dev)
        self.module.weight = None
        weights = None
        if with_router_weights and dev.attention_mask is not None:
            weights = dev.attention_mask.reshape(-1)
        first = captured.first_hidden
        return MicroBatch(
            targets_BS=shifted_targets(batch.labels),
            rows_UD=rows,
            ids_U=uniq.to(device, non_blocking=True),
            first_BSD=first,
            calls=captured.calls,
            router_weights=weights,
            hidden=first.detach(),
            device_batch=dev if keep_inputs else None,
            inverse_S=inverse if keep_inputs else None,
        )

    def embeds(self, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's input embeddings again (no gradient to the rows)."""
        assert mb.inverse_S is not None
        self.module.weight = mb.rows_UD.detach()
        try:
            return self.module(mb.inverse_S)
        finally:
            self.module.weight = None

    def backward(self, mb: MicroBatch, grad_acc_VD: torch.Tensor) -> None:
        """Scatter d loss / d rows into the full-table fp32 gradient accumulator."""
        assert mb.grad is not None
        (g_rows,) = torch.autograd.grad(mb.first_BSD, mb.rows_UD, mb.grad)
        grad_acc_VD.index_add_(0, mb.ids_U, g_rows.float())
