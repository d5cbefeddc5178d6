"""The references verify trains beside the engine: plain PyTorch (HF model, torch AdamW,
clip_grad_norm_), in fp32, float64, or PyTorch's own bf16 + fp32-master recipe."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.engine.microbatch import shifted_targets
from megatrain.model.multimodal import MultimodalInputs
from megatrain.optim.adamw import AdamWHyper
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore


def float64(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64; MoE experts on the eager path (grouped_mm has no float64 kernel)."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        with contextlib.suppress(ValueError):  # no switchable experts implementation
            setter("eager")
    return model.double()


def all_finite(tensors: dict[str, dict[str, torch.Tensor]]) -> bool:
    return all(bool(torch.isfinite(t).all()) for group in tensors.values() for t in group.values())


def snapshot(block: ParamBlock, out: dict[str, torch.Tensor]) -> None:
    flat = block.grad_landing.float()
    for e in block.entries:
        out[e.full_name] = block.view(flat, e).clone()


def master_weights(store: HostStore) -> dict[str, torch.Tensor]:
    return {e.full_name: b.view(b.master, e) for b in store.blocks for e in b.entries}


EngineState = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]


def engine_state(store: HostStore) -> EngineState:
    """Per parameter: the engine's master weight, AdamW m and v (fp32 states: verify's store)
    and the optimizer steps applied, as views of the store."""
    out: EngineState = {}
    for b in store.blocks:
        assert b.state_dtype == "fp32", "verify judges against exact AdamW: fp32 states"
        for e in b.entries:
            out[e.full_name] = (
                b.view(b.master, e),
                b.view(b.exp_avg, e),
                b.view(b.exp_avg_sq, e),
                b.step,
            )
    return out


def start_from_engine(store: HostStore, *references: Reference | None) -> None:
    """The next step of every reference starts from the engine's weights and AdamW states."""
    state = engine_state(store)
    for reference in {id(r): r for r in references if r is not None}.values():
        reference.start_from(state)


class Reference:
    """Plain PyTorch training of the HF model: AdamW, clip_grad_norm_, same decay groups.

    With `bf16_master`, the model computes in bf16 and AdamW updates fp32 master copies of its
    weights, which are cast back into the model after every step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        decay: dict[str, bool],
        *,
        device: torch.device,
        lr: float,
        hyper: AdamWHyper,
        clip_norm: float | None,
        bf16_master: bool = False,
    ) -> None:
        self.model: Any = model.to(device)
        self.device, self.clip_norm = device, clip_norm
        self.named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        body: Any = getattr(model, "model", None)  # a vision-language model's multimodal body
        self.inputs = MultimodalInputs(body) if hasattr(body, "language_model") else None
        self.master = dict(self.named)
        if bf16_master:
            self.master = {n: torch.nn.Parameter(p.detach().clone()) for n, p in self.named.items()}
            self.model.to(torch.bfloat16)
        groups = [
            {
                "params": [p for n, p in self.master.items() if decay[n]],
                "weight_decay": hyper.weight_decay,
            },
            {"params": [p for n, p in self.master.items() if not decay[n]], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=lr, betas=hyper.betas, eps=hyper.eps)

    def start_from(self, state: EngineState) -> None:
        """Take the engine's weights and AdamW states (`engine_state`) as this reference's, so
        that its next step starts where the engine's does (verify/__init__.py: each step is
        judged on its own arithmetic)."""
        with torch.no_grad():
            for name, master in self.master.items():
                weight, exp_avg, exp_avg_sq, step = state[name]
                master.copy_(weight)
                if master is not self.named[name]:
                    self.named[name].copy_(master)
                opt_state = self.opt.state[master]
                if opt_state:  # no state: never had a gradient, on both sides (AdamW skips it)
                    opt_state["exp_avg"].copy_(exp_avg)
                    opt_state["exp_avg_sq"].copy_(exp_avg_sq)
                    opt_state["step"].fill_(step)

    def step(self, micro: list[Batch]) -> dict[str, dict[str, torch.Tensor]]:
        model = self.model
        denom = sum(b.num_target_tokens for b in micro)
        total = 0.0
        for batch in micro:
            b = batch.to(self.device)
            if self.inputs is not None:  # a vision-language model: its images and positions
                kwargs = self.inputs.kwargs(b.input_ids, b.attention_mask, b.position_ids, b.images)
            else:
                kwargs = {
                    "input_ids": b.input_ids,
                    "attention_mask": b.attention_mask,
                    "position_ids": b.position_ids,
                    "use_cache": False,
                }
            out = model(**kwargs)
            logits = out.logits if out.logits.dtype == torch.float64 else out.logits.float()
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1),
                    shifted_targets(b.labels).flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                / denom
            )
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + model.router_aux_loss_coef * out.aux_loss / len(micro)
            loss.backward()
            total += float(loss.detach())
        for name, master in self.master.items():
            grad = self.named[name].grad
            if master is not self.named[name]:
                master.grad = None if grad is None else grad.float()
        grads = {
            n: p.grad.detach().cpu().clone() for n, p in self.master.items() if p.grad is not None
        }
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.master.values(), self.clip_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, master in self.master.items():
                if master is not self.named[name]:
                    self.named[name].copy_(master)
        weights = {n: p.detach().cpu() for n, p in self.master.items()}
        return {
            "loss": {"loss": torch.tensor(total, dtype=torch.float64)},
            "grad": grads,
            "weight": weights,
        }
