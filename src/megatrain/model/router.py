"""MoE router auxiliary (load-balancing) loss, computed layer by layer and exactly.

Hugging Face adds `router_aux_loss_coef * load_balancing_loss_func(router_logits of all layers)`
to the loss when `config.output_router_logits` is set and the model's forward calls that
function. Its value couples the layers only through constants:

    aux = E * sum_e (count_e / R) * (prob_e / R)

with count_e the (mask-weighted) number of top-k assignments to expert e over all MoE layers,
prob_e the summed softmax probability of e, R the weighted number of rows (tokens x layers).
count_e is not differentiable (top-k), so the gradient reaching layer l's router is that of
E * sum_e (count_e / R^2) * prob_e(layer l): one cheap surrogate per layer, once the forward has
seen all layers. `RouterAux` checks this decomposition against the model's own
`load_balancing_loss_func` (value and gradient) when it is built and refuses a model whose
function differs, so an unknown formula can never produce silently wrong gradients.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatrain.model.structure import ModelStructure


class RouterAux:
    """Per-model description of the router aux loss; None-equivalent when HF would not add it."""

    def __init__(
        self, router_class: type[nn.Module], index: int, num_experts: int, top_k: int, coef: float
    ) -> None:
        self.router_class = router_class
        self.index = index
        self.num_experts = num_experts
        self.top_k = top_k
        self.coef = coef

    @staticmethod
    def for_model(structure: ModelStructure) -> RouterAux | None:
        lm = structure.causal_lm
        if not getattr(lm.config, "output_router_logits", False):
            return None
        module = sys.modules[type(lm).__module__]
        hf_func = getattr(module, "load_balancing_loss_func", None)
        if hf_func is None or "load_balancing_loss_func(" not in inspect.getsource(
            type(lm).forward
        ):
            return None  # this model's forward never adds an aux loss
        spec = (getattr(type(structure.body), "_can_record_outputs", None) or {}).get(
            "router_logits"
        )
        name = type(lm).__name__
        if spec is None or not hasattr(spec, "target_class"):
            raise ValueError(
                f"{name}: output_router_logits is set but the router module cannot "
                "be found (no router_logits recorder); set it to false"
            )
        lm_attrs: Any = lm  # plain attributes set by the MoE causal LM's __init__
        try:
            aux = RouterAux(
                spec.target_class,
                spec.index,
                int(lm_attrs.num_experts),
                int(lm_attrs.num_experts_per_tok),
                float(lm_attrs.router_aux_loss_coef),
            )
        except AttributeError as e:
            raise ValueError(f"{name}: output_router_logits is set but {e}") from e
        aux.check_against(hf_func, name)
        return aux

    def stats(self, logits: torch.Tensor, weights: torch.Tensor | None) -> RouterStats:
        """count_e, prob_e and R of one layer; `weights` is the flat attention mask or None."""
        probs = torch.softmax(logits.float(), dim=-1)
        selected = torch.topk(probs, self.top_k, dim=-1).indices
        if weights is None:
            weights = torch.ones(probs.shape[0], device=probs.device)
        counts = torch.zeros(self.num_experts, device=probs.device).scatter_add_(
            0, selected.reshape(-1), weights.float().repeat_interleave(self.top_k)
        )
        prob_sum = (probs * weights.float().unsqueeze(-1)).sum(dim=0)
        return RouterStats(counts=counts, prob_sum=prob_sum, rows=weights.float().sum())

    def value(self, total: RouterStats) -> torch.Tensor:
        rows = total.rows
        return self.num_experts * torch.sum((total.counts / rows) * (total.prob_sum / rows))

    def surrogate(
        self, logits: torch.Tensor, weights: torch.Tensor | None, total: RouterStats
    ) -> torch.Tensor:
        """A scalar whose gradient w.r.t. this layer's logits equals that of `value`."""
        probs = torch.softmax(logits.float(), dim=-1)
        if weights is not None:
            probs = probs * weights.float().unsqueeze(-1)
        const = self.num_experts * total.counts / (total.rows * total.rows)
        return torch.sum(const.detach() * probs.sum(dim=0))

    def check_against(self, hf_func: Callable[..., Any], name: str) -> None:
        gen = torch.Generator().manual_seed(0)
        layers = [
            torch.randn(6, self.num_experts, generator=gen, requires_grad=True) for _ in range(3)
        ]
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        for m in (None, mask):
            ref = hf_func(tuple(layers), self.num_experts, self.top_k, m)
            ref_grads = torch.autograd.grad(ref, layers)
            w = None if m is None else m.reshape(-1)
            total = RouterStats.sum([self.stats(x.detach(), w) for x in layers])
            ours = self.value(total)
            ok = torch.allclose(ours, ref.detach(), rtol=1e-5, atol=1e-7)
            for x, g in zip(layers, ref_grads, strict=True):
                (mine,) = torch.autograd.grad(self.surrogate(x, w, total), x)
                ok = ok and torch.allclose(mine, g, rtol=1e-4, atol=1e-7)
            if not ok:
                raise ValueError(
                    f"{name}: its load_balancing_loss_func differs from the form MegaTrain "
                    "computes layer by layer; set output_router_logits: false to train it"
                )


class RouterStats:
    def __init__(self, counts: torch.Tensor, prob_sum: torch.Tensor, rows: torch.Tensor) -> None:
        self.counts = counts
        self.prob_sum = prob_sum
        self.rows = rows

    @staticmethod
    def sum(items: list[RouterStats]) -> RouterStats:
        return RouterStats(
            counts=torch.stack([s.counts for s in items]).sum(0),
            prob_sum=torch.stack([s.prob_sum for s in items]).sum(0),
            rows=torch.stack([s.rows for s in items]).sum(),
        )


class RouterTap:
    """Forward hooks on the router modules of one compute layer; records logits while armed."""

    def __init__(self, layer: nn.Module, aux: RouterAux) -> None:
        self.armed = False
        self.logits: list[torch.Tensor] = []
        routers = [m for m in layer.modules() if isinstance(m, aux.router_class)]
        for router in routers:
            router.register_forward_hook(self._hook)
        self.has_router = bool(routers)
        self._index = aux.index

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.armed:
            out = output[self._index] if isinstance(output, (tuple, list)) else output
            self.logits.append(out)

    def take(self) -> list[torch.Tensor]:
        logits, self.logits = self.logits, []
        return logits


class RoutingMargins(torch.overrides.TorchFunctionMode):
    """Records how close every top-k decision made while active came to a tie.

    A decision's margin is (v_k - v_{k+1}) / max|v| over its row: the gap between the last value
    kept and the first one dropped, relative to the row's scale. Two computations whose inputs
    differ by a relative error below the margin make the same choice; below it, rounding alone
    decides which expert a token goes to. Every `torch.topk` / `Tensor.topk` counts (in a causal
    LM, top-k is routing).
    """

    def __init__(self) -> None:
        super().__init__()
        self.smallest = math.inf
        self.decisions = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk):
            self._record(*args, **(kwargs or {}))
        return out

    def _record(self, x: torch.Tensor, k: int, dim: int = -1, *args: Any, **kwargs: Any) -> None:
        if k >= x.shape[dim]:
            return  # nothing is dropped: no decision
        with torch._C.DisableTorchFunction():
            values = x.detach().double().movedim(dim, -1).sort(dim=-1, descending=True).values
            gap = values[..., k - 1] - values[..., k]
            scale = values.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
            if gap.numel():
                self.smallest = min(self.smallest, float((gap / scale).min()))
                self.decisions += gap.numel()
