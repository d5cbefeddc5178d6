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
  capture raises instead of silently running the wrong computation. One exception, for
  vision-language models only: an additive injection (Qwen3-VL's deepstack adds image features
  at the image positions after the first layers) is recorded as the layer's `after` and checked
  additive once per model, by a second capture whose stand-ins shift what they return.
- Vision-language models (model/multimodal.py): the multimodal body runs instead of the language
  model, with the ids, the images and the engine's embeddings standing in for its embedding
  lookup, and `vision` (the vision modules on the device) swapped in for the host's.
- The hidden state handed to layer 0 stays connected (autograd) to `inputs_embeds`, so body
  code between the embedding and the first layer (e.g. Gemma's sqrt(hidden) scaling) is
  differentiated exactly. No recorded kwarg may depend on `inputs_embeds` through autograd.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatrain.model.multimodal import EmbeddingStandIn, MultimodalInputs
from megatrain.model.structure import ModelStructure


@dataclass
class LayerCall:
    """How the body called one decoder layer, minus the hidden states."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hidden_as_kwarg: bool
    after: torch.Tensor | None = None  # added to the layer's output (a VLM's deepstack)

    def run(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self.hidden_as_kwarg:
            out = layer(*self.args, hidden_states=hidden, **self.kwargs)
        else:
            out = layer(hidden, *self.args, **self.kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out if self.after is None else out + self.after


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

    def __init__(
        self, structure: ModelStructure, vision: dict[str, nn.Module] | None = None
    ) -> None:
        """`vision`: the vision modules of a vision-language model as they run (device copies
        in the compute dtype), by attribute of the multimodal body; None: the host's."""
        self.structure = structure
        self.vision = vision or {}
        self._inputs = MultimodalInputs(structure.front) if structure.front is not None else None
        self._additive_checked = False
        self._shift = 0.0  # what the stand-ins add to what they return (the additivity check)
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
        *,
        input_ids: torch.Tensor | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> CapturedCalls:
        """`input_ids` and `images` (Batch.images): a vision-language model's, on the device."""
        if self._inputs is not None:
            assert input_ids is not None, "a vision-language model's capture needs the ids"
            kwargs = self._inputs.kwargs(input_ids, attention_mask, position_ids, images)
        else:
            kwargs = {"attention_mask": attention_mask, "position_ids": position_ids}
            kwargs["use_cache"] = False
        modes = [self._tuple_mode] if self._tuple_mode is not None else [False, True]
        for tuple_mode in modes:
            self._trying_tuple = tuple_mode
            try:
                result = self._run_body(inputs_embeds, kwargs)
            except _Mismatch:
                continue
            self._tuple_mode = tuple_mode
            if not self._additive_checked and any(c.after is not None for c in result.calls):
                self._check_additive(inputs_embeds, kwargs, result)
            return result
        name = type(self.structure.body).__name__
        raise ValueError(
            f"{name}: the body changes hidden states between decoder layers (layer i+1 does not "
            "receive what layer i returned); this architecture is not supported"
        )

    def _opened_mask(self, value: Any) -> Any:
        """`_attend_somewhere` once per mask object of this capture (layers share masks)."""
        if isinstance(value, dict):
            return {k: self._opened_mask(v) for k, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in self._masks:
            self._masks[id(value)] = (value, _attend_somewhere(value))
        return self._masks[id(value)][1]

    def of_batch(self, inputs_embeds: torch.Tensor, batch: Any) -> CapturedCalls:
        """`capture` of a micro-batch on the device (megatrain.batch.Batch)."""
        return self.capture(
            inputs_embeds,
            batch.attention_mask,
            batch.position_ids,
            input_ids=batch.input_ids,
            images=batch.images,
        )

    def _check_additive(
        self, inputs_embeds: torch.Tensor, kwargs: dict[str, Any], result: CapturedCalls
    ) -> None:
        """The injections between layers do not depend on the hidden states they are added to:
        capture again with the stand-ins' outputs shifted; the differences must not move."""
        self._shift = 1.0
        try:
            shifted = self._run_body(inputs_embeds, kwargs)
        finally:
            self._shift = 0.0
        for i, (a, b) in enumerate(zip(result.calls, shifted.calls, strict=True)):
            if (a.after is None) != (b.after is None):
                raise ValueError(_between_layers_error(self.structure, i))
            if a.after is None or b.after is None:
                continue
            # (h + 1 + d) - (h + 1) against (h + d) - h: each side rounds twice at the
            # magnitude |h| + |d| + 1 (h: what the stand-ins returned, the first hidden states)
            hidden = float(result.first_hidden.detach().abs().max())
            scale = float(a.after.abs().max()) + hidden + 1.0
            tol = 4 * torch.finfo(a.after.dtype).eps * scale
            if float((a.after - b.after).abs().max()) > tol:
                raise ValueError(_between_layers_error(self.structure, i))
        self._additive_checked = True

    def _run_body(self, inputs_embeds: torch.Tensor, kwargs: dict[str, Any]) -> CapturedCalls:
        self._calls, self._first, self._last_out = [], None, None
        self._masks: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (mask, opened mask)
        layers = self.structure.layers
        originals = list(layers)
        for i, layer in enumerate(originals):
            layers[i] = _Recorder(i, layer, self)
        try:
            if self._inputs is None:
                self.structure.body(inputs_embeds=inputs_embeds, **kwargs)
            else:
                with self._front_swapped(inputs_embeds):
                    assert self.structure.front is not None
                    self.structure.front(**kwargs)
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

    @contextmanager
    def _front_swapped(self, inputs_embeds: torch.Tensor) -> Iterator[None]:
        """The multimodal body with the engine's embeddings and the running vision modules."""
        st = self.structure
        assert st.front is not None
        embed_attr = next(n for n, m in st.body.named_children() if m is st.embed)
        saved = {n: st.front._modules[n] for n in self.vision}
        st.body._modules[embed_attr] = EmbeddingStandIn(inputs_embeds)
        st.front._modules.update(self.vision)
        try:
            yield
        finally:
            st.body._modules[embed_attr] = st.embed
            st.front._modules.update(saved)

    def _record(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        if "hidden_states" in kwargs:
            hidden, hidden_as_kwarg = kwargs.pop("hidden_states"), True
        else:
            hidden, args, hidden_as_kwarg = args[0], args[1:], False
        if index == 0:
            self._first = hidden
        elif hidden is not self._last_out:
            last = self._last_out
            if self._inputs is None or not isinstance(hidden, torch.Tensor):
                raise _Mismatch()
            if not isinstance(last, torch.Tensor) or hidden.shape != last.shape:
                raise _Mismatch()
            # `last` is detached: the injection's graph reaches only what it injects (trained
            # vision modules), never the hidden states
            self._calls[-1].after = hidden - last
        _check_no_grad_kwargs(args, kwargs, index)
        if self._inputs is not None:  # a VLM's image masks (causal text masks never are empty)
            kwargs = {k: self._opened_mask(v) for k, v in kwargs.items()}
        self._calls.append(
            LayerCall(args=tuple(args), kwargs=kwargs, hidden_as_kwarg=hidden_as_kwarg)
        )
        if index == len(self.structure.layers) - 1:
            raise _Stop()
        out = hidden.detach() + self._shift if self._shift else hidden.detach()
        self._last_out = out
        return (out,) if self._trying_tuple else out


def _attend_somewhere(value: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask [B, 1, Q, K] whose query rows attend to nothing (padding rows
    of a bidirectional image mask, Gemma 3's) with those rows opened to every key: CUDA's
    sdpa kernels turn an empty row into NaN, which reaches the weights' gradients through the
    zero gradient of that padding row. The row's output is never read by a real token (its key
    is masked for them) nor by the loss, so nothing else changes; transformers does the same
    for its own sdpa masks."""
    if value.dtype != torch.bool or value.dim() != 4:
        return value
    empty = ~value.any(-1, keepdim=True)
    if not bool(empty.any()):
        return value
    return value | empty


def _between_layers_error(structure: ModelStructure, index: int) -> str:
    return (
        f"{type(structure.front).__name__}: between decoder layers {index} and {index + 1} the "
        "body changes the hidden states in a way that depends on them (not an addition); this "
        "architecture is not supported"
    )


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
