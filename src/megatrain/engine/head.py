"""Final norm + lm_head + a per-token loss, fused per token chunk, forward and backward together.

The full [tokens x vocab] logits never exist: for each chunk of supervised positions the head
runs forward with autograd, the chunk's loss is differentiated at once, and only the gradient
w.r.t. the chunk's hidden states (and the head parameters' gradients) is kept. Positions with no
target (prompt, padding) are skipped entirely: the norm and lm_head act per token, so this is
exact, and prompt-heavy SFT batches spend no lm_head FLOPs on prompts.

Logits come from the HF causal LM's own forward with its body replaced by a stub that returns
the normed hidden states, so whatever that forward does between body and logits (Gemma's final
logit soft-capping, a logit scale) is applied exactly as Hugging Face does it.

The loss is cross-entropy (mean over the step's target tokens) unless a `TokenObjective` is
given: then it is any function of the targets' log-probs (of logits / temperature) and of
per-token side inputs (advantages, old log-probs, weights, ...), which the head gathers for each
chunk's tokens. `logprobs` is the same pass without gradients: each target's log-prob.

Invariant: one chunk's gradients exist at a time (the head weight's is as large as the weight):
they are added into the accumulators and freed before the next chunk's backward, as the plan's
loss phase counts them (planning/activations.py `loss_chunk`).

Shapes: N = tokens of a micro-batch, C = tokens of a chunk, D = hidden size, V = vocab.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from megatrain.batch import IGNORE_INDEX
from megatrain.model.structure import ModelStructure

# A chunk's fp32 logits, their gradient and the bf16 logits (~10 bytes per logit) stay under
# ~2 GiB: large enough that per-chunk overhead is small (1,400 tokens at a 152k vocabulary).
_LOGIT_BYTES_PER_CHUNK = 2 << 30


TokenFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
"""(log-probs [C] of a chunk's targets, side inputs of those C tokens) -> the chunk's loss.
A TokenFn with an `observe_logits` method is also shown each chunk's logits / temperature
([C, V], detached) in training steps, for metrics such as the policy's entropy."""


PrepareFn = Callable[[list[torch.Tensor]], tuple[list[dict[str, torch.Tensor]], torch.Tensor]]
"""(per micro-batch, fp32 [B, S] on the host: the log-prob of each supervised label, 0 elsewhere,
label-aligned as `StreamingEngine.logprobs` gives them) -> (per micro-batch, more per-token
inputs [B, S], label-aligned; the part of the step's loss they carry, a scalar)."""


@dataclass
class TokenObjective:
    """A step's loss as a sum over its target tokens of `fn` of their log-probs.

    `inputs[k]` holds micro-batch k's per-token side inputs: name -> host tensor [B, S] aligned
    with its labels (entry t belongs to the target token at position t). `fn` sees the
    log-probs of `logits / temperature` and returns the chunk's share of the loss; every
    weighting and normalisation lives in `fn` and its inputs, so the step's loss is exactly
    the sum of what `fn` returns.

    A loss that is not a sum over tokens (DPO: a non-linear function of per-sequence sums) sets
    `prepare`: the step then first runs the head without gradients over every micro-batch for
    the targets' log-probs, hands them to `prepare`, and merges the per-token inputs it returns
    (d loss / d logp, typically) into `inputs` before the usual pass, whose `fn` then makes the
    gradient; the step's loss is the value `prepare` returns plus the sum of what `fn` returns.
    """

    fn: TokenFn
    inputs: list[dict[str, torch.Tensor]]
    temperature: float = 1.0
    prepare: PrepareFn | None = None


class _StubOutput(BaseModelOutputWithPast):
    """The body's output as the causal LM forward reads it; fields it never got are None."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _BodyStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        return _StubOutput(last_hidden_state=self.hidden)


class LogitsFn:
    """normed hidden [C, D] -> logits [C, V] through the HF causal LM's forward."""

    def __init__(self, structure: ModelStructure, lm_head: nn.Module) -> None:
        self._stub = _BodyStub()
        lm = copy.copy(structure.causal_lm)  # shallow: shares config and code, not module dict
        lm._modules = dict(lm._modules)
        lm._modules[structure.body_attr] = self._stub
        lm._modules[structure.lm_head_attr] = lm_head
        self._lm = lm
        params = inspect.signature(type(structure.causal_lm).forward).parameters
        self._kwargs: dict[str, Any] = {"use_cache": False}
        if "output_router_logits" in params:
            self._kwargs["output_router_logits"] = False

    def __call__(self, normed_CD: torch.Tensor) -> torch.Tensor:
        self._stub.hidden = normed_CD.unsqueeze(0)
        try:
            out = self._lm(inputs_embeds=self._stub.hidden, **self._kwargs)
        finally:
            self._stub.hidden = None
        return out.logits[0]


def default_chunk_tokens(vocab_size: int) -> int:
    return max(64, _LOGIT_BYTES_PER_CHUNK // (vocab_size * 10))


class ChunkedLoss:
    def __init__(
        self,
        structure: ModelStructure,
        norm: nn.Module,
        lm_head: nn.Module,
        chunk_tokens: int | None,
    ) -> None:
        self.norm = norm
        self.logits = LogitsFn(structure, lm_head)
        vocab = structure.causal_lm.config.get_text_config().vocab_size
        self.chunk_tokens = chunk_tokens or default_chunk_tokens(vocab)

    def run(
        self,
        hidden_BSD: torch.Tensor,
        targets_host_BS: torch.Tensor,
        denom: float,
        params: list[nn.Parameter] | None,
        grad_acc: list[torch.Tensor] | None = None,
        *,
        fn: TokenFn | None = None,
        side_host_BS: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Loss of one micro-batch; with `params`, also its gradients.

        `targets_host_BS` are the shifted labels on the host (position t predicts its target).
        Without `fn` the loss is the cross-entropy sum / denom; with it, the sum of what `fn`
        returns per chunk, given the chunk's log-probs and `side_host_BS` (shifted like the
        targets) gathered for its tokens. With `params`, each parameter's gradient is added into
        the matching fp32 tensor of `grad_acc`. Returns (loss, sum of the targets' negative
        log-probs, d loss / d hidden_BSD or None without `params`).
        """
        device = hidden_BSD.device
        hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
        rows, rows_dev, targets_dev = self._rows(targets_host_BS, device)
        side_dev = {
            name: _to_device(t.reshape(-1)[rows], device)
            for name, t in (side_host_BS or {}).items()
        }
        loss = torch.zeros((), dtype=torch.float32, device=device)
        nll = torch.zeros((), dtype=torch.float32, device=device)
        grad_ND = torch.zeros_like(hidden_ND) if params is not None else None
        for start in range(0, rows.numel(), self.chunk_tokens):
            span = slice(start, start + self.chunk_tokens)
            idx, tgt = rows_dev[span], targets_dev[span]
            side = {name: t[span] for name, t in side_dev.items()}
            if params is None:
                with torch.no_grad():
                    chunk, chunk_nll = self._chunk_loss(
                        hidden_ND[idx], tgt, denom, fn, side, temperature
                    )
                loss += chunk
                nll += chunk_nll
                continue
            assert grad_ND is not None and grad_acc is not None
            chunk, chunk_nll = self._chunk_backward(
                hidden_ND, idx, tgt, denom, fn, side, temperature, params, grad_acc, grad_ND
            )
            loss += chunk
            nll += chunk_nll
        grad_BSD = None if grad_ND is None else grad_ND.view_as(hidden_BSD)
        return loss, nll, grad_BSD

    def _chunk_backward(
        self,
        hidden_ND: torch.Tensor,
        idx: torch.Tensor,
        targets_C: torch.Tensor,
        denom: float,
        fn: TokenFn | None,
        side_C: dict[str, torch.Tensor],
        temperature: float,
        params: list[nn.Parameter],
        grad_acc: list[torch.Tensor],
        grad_ND: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's loss and gradients: the hidden rows' into `grad_ND`, the parameters' added
        into `grad_acc`. Its gradients (the head weight's is [vocab, hidden]) are freed on
        return, before the next chunk's backward makes its own."""
        h_CD = hidden_ND[idx].detach().requires_grad_(True)
        with torch.enable_grad():
            chunk, chunk_nll = self._chunk_loss(h_CD, targets_C, denom, fn, side_C, temperature)
        grads = torch.autograd.grad(chunk, [h_CD, *params], allow_unused=True)
        grad_ND.index_copy_(0, idx, grads[0].to(grad_ND.dtype))
        for acc, g in zip(grad_acc, grads[1:], strict=True):
            if g is not None:
                acc.add_(g)
        return chunk.detach(), chunk_nll

    @torch.no_grad()
    def logprobs(
        self, hidden_BSD: torch.Tensor, targets_host_BS: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """Host fp32 [B, S]: log-prob of each target under logits / temperature (0 elsewhere)."""
        hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
        rows, rows_dev, targets_dev = self._rows(targets_host_BS, hidden_BSD.device)
        out_N = torch.zeros(targets_host_BS.numel(), dtype=torch.float32, device=hidden_BSD.device)
        for start in range(0, rows.numel(), self.chunk_tokens):
            span = slice(start, start + self.chunk_tokens)
            logits_CV = self._logits(hidden_ND[rows_dev[span]], temperature)
            out_N[rows_dev[span]] = -F.cross_entropy(logits_CV, targets_dev[span], reduction="none")
        return out_N.view(targets_host_BS.shape).cpu()  # sync point: copy to the host

    def _rows(
        self, targets_host_BS: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target positions on the host, the same on the device, their targets on the device)."""
        flat = targets_host_BS.reshape(-1)
        rows = torch.nonzero(flat != IGNORE_INDEX).squeeze(1)
        targets = flat[rows]
        return rows, _to_device(rows, device), _to_device(targets, device)

    def _logits(self, h_CD: torch.Tensor, temperature: float) -> torch.Tensor:
        logits_CV = self.logits(self.norm(h_CD)).float()
        return logits_CV if temperature == 1.0 else logits_CV / temperature

    def _chunk_loss(
        self,
        h_CD: torch.Tensor,
        targets_C: torch.Tensor,
        denom: float,
        fn: TokenFn | None,
        side_C: dict[str, torch.Tensor],
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chunk's loss, the sum of its targets' negative log-probs, detached)."""
        logits_CV = self._logits(h_CD, temperature)
        if fn is None:
            ce = F.cross_entropy(logits_CV, targets_C, reduction="sum")
            return ce / denom, ce.detach()
        logp_C = -F.cross_entropy(logits_CV, targets_C, reduction="none")
        observe = getattr(fn, "observe_logits", None)  # metrics of the whole distribution
        if observe is not None:
            observe(logits_CV.detach())
        return fn(logp_C, side_C), -logp_C.detach().sum()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous copy: through pinned memory on CUDA (pageable memory would make the copy
    wait for every kernel queued before it: the loss phase then absorbs the forward's)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
