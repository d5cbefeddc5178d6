"""Take each decoder layer's exact call arguments from the Hugging Face body's own forward.

The body (e.g. `LlamaModel`) builds everything its layers need: causal / sliding-window /
packed-sequence masks per layer type, rotary position embeddings, per-layer kwargs. Instead of
re-implementing that per architecture, the body runs once per micro-batch with every decoder
layer swapped for a recording stand-in that returns its input unchanged; the engine then runs
the real layers itself with the recorded (args, kwargs). The last stand-in stops the body, so
the final norm (whose weights are not there) never runs.

Invariants:
- The stand-in for layer i+1 must receive exactly the object layer i returned. If it does not,
  the body transforms hidden states between layers in a way the engine cannot reproduce, and
  capture raises instead of silently running the wrong computation.
- The hidden state handed to layer 0 stays connected (autograd) to `inputs_embeds`, so body
  code between the embedding and the first layer (e.g. Gemma's sqrt(hidden) scaling) is
  differentiated exactly. No recorded kwarg may depend on `inputs_embeds` through autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatrain.model.structure import ModelStructure


@dataclass
class LayerCall:
    """How the body called one decoder layer, minus the hidden states."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden_as_kwarg: bool

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.hidden_as_kwarg:
            out = layer(*self.args, hidden_states=hidden, **self.kwargs)
        else:
            out = layer(hidden, *self.args, **self.kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out


@dataclass
class CapturedCalls:
    first_hidden: torch.Tensor  # input of layer 0; a function of inputs_embeds under autograd
    calls: list[LayerCall]


class _Stop(Exception):
    pass


class _Mismatch(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for decoder layer `index`; attribute reads fall through to the real layer."""

    def __init__(self, index: int, real: nn.Module, capture: LayerCallCapture) -> None:
        super().__init__()
        self.index = index
        self.__dict__["_real"] = real  # not registered as a submodule
        self.__dict__["_capture"] = capture

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_capture"]._record(self.index, args, kwargs)


class LayerCallCapture:
    """Runs the body with recording stand-ins; one instance per model, reused every step."""

    def __init__(self, structure: ModelStructure) -> None:
        self.structure = structure
        self._tuple_mode: bool | None = None  # whether layers return tuples; found on first use
        self._calls: list[LayerCall] = []
        self._first: torch.Tensor | None = None
        self._last_out: Any = None
        self._trying_tuple = False

    def capture(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> CapturedCalls:
        modes = [self._tuple_mode] if self._tuple_mode is not None else [False, True]
        for tuple_mode in modes:
            self._trying_tuple = tuple_mode
            try:
                result = self._run_body(inputs_embeds, attention_mask, position_ids)
            except _Mismatch:
                continue
            self._tuple_mode = tuple_mode
            return result
        name = type(self.structure.body).__name__
        raise ValueError(
            f"{name}: the body changes hidden states between decoder layers (layer i+1 does not "
            "receive what layer i returned); this architecture is not supported"
        )

    def _run_body(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> CapturedCalls:
        self._calls, self._first, self._last_out = [], None, None
        layers = self.structure.layers
        originals = list(layers)
        for i, layer in enumerate(originals):
            layers[i] = _Recorder(i, layer, self)
        try:
            self.structure.body(
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        except _Stop:
            pass
        finally:
            for i, layer in enumerate(originals):
                layers[i] = layer
        if len(self._calls) != len(originals) or self._first is None:
            raise ValueError(
                f"{type(self.structure.body).__name__}: the body called {len(self._calls)} of "
                f"{len(originals)} decoder layers; this architecture is not supported"
            )
        return CapturedCalls(first_hidden=self._first, calls=self._calls)

    def _record(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        if "hidden_states" in kwargs:
            hidden, hidden_as_kwarg = kwargs.pop("hidden_states"), True
        else:
            hidden, args, hidden_as_kwarg = args[0], args[1:], False
        if index == 0:
            self._first = hidden
        elif hidden is not self._last_out:
            raise _Mismatch()
        _check_no_grad_kwargs(args, kwargs, index)
        self._calls.append(
            LayerCall(args=tuple(args), kwargs=kwargs, hidden_as_kwarg=hidden_as_kwarg)
        )
        if index == len(self.structure.layers) - 1:
            raise _Stop()
        self._last_out = hidden
        return (hidden,) if self._trying_tuple else hidden


def _check_no_grad_kwargs(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> None:
    values = list(args) + list(kwargs.values())
    flat: list[Any] = []
    while values:
        v = values.pop()
        if isinstance(v, (tuple, list)):
            values.extend(v)
        elif isinstance(v, dict):
            values.extend(v.values())
        else:
            flat.append(v)
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in flat):
        raise ValueError(
            f"decoder layer {index} receives an input (other than the hidden states) that "
            "depends on the embeddings through autograd; such architectures are not supported"
        )
