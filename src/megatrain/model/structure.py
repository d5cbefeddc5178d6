"""Find the parts of any Hugging Face causal LM that the engine streams or keeps resident.

A causal LM is taken apart into: the input embedding, the decoder layers (one ModuleList), the
final norm, and the lm_head (possibly tied to the embedding). Everything is found from the HF
model's own accessors and module tree, with no per-architecture table. Anything the engine
could not run faithfully (extra trainable modules outside those parts, parameters shared between
layers, no layer list) is refused with an error that names it: never silent wrong numbers.

Layers are grouped by structure (class, parameter names and shapes, layer type) so a hybrid
model reports e.g. `linear_attention` and `full_attention` groups, MoE and dense layers apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel

_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_norm", "norm_f")


@dataclass
class LayerGroup:
    kind: str  # e.g. "full_attention", "linear_attention+moe", "dense"
    layer_indices: list[int]
    param_shapes: dict[str, tuple[int, ...]]


@dataclass
class ModelStructure:
    causal_lm: PreTrainedModel
    body: nn.Module
    body_attr: str  # attribute of causal_lm holding the body (e.g. "model")
    embed: nn.Module
    layers: nn.ModuleList
    final_norm: nn.Module
    lm_head: nn.Module
    lm_head_attr: str
    tied: bool
    groups: list[LayerGroup] = field(default_factory=list)
    # vision-language models (model/multimodal.py): the multimodal body that merges image
    # features into the embeddings and calls `body` (its language model), and its vision modules
    # (tower, projector) by attribute name; None / empty for a text-only causal LM
    front: nn.Module | None = None
    vision: dict[str, nn.Module] = field(default_factory=dict)

    @property
    def is_multimodal(self) -> bool:
        return self.front is not None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        parts = [f"{g.kind} x{len(g.layer_indices)}" for g in self.groups]
        tie = "tied" if self.tied else "untied"
        return f"{type(self.causal_lm).__name__}: {', '.join(parts)}; embeddings {tie}"


def discover(causal_lm: PreTrainedModel) -> ModelStructure:
    """Take `causal_lm` apart; raises ValueError naming whatever is unsupported."""
    name = type(causal_lm).__name__
    # The body is normally at base_model_prefix; some causal LMs split out of a multimodal
    # family keep the multimodal prefix (Llama 4: "language_model") with the body at "model".
    children = dict(causal_lm.named_children())
    body_attr = next(
        (
            a
            for a in (getattr(causal_lm, "base_model_prefix", ""), "model")
            if isinstance(children.get(a), nn.Module)
        ),
        "",
    )
    if not body_attr:
        raise ValueError(
            f"{name}: no decoder body (looked for attributes "
            f"{causal_lm.base_model_prefix!r} and 'model')"
        )
    body = children[body_attr]
    front, vision = None, {}
    language = getattr(body, "language_model", None)
    if isinstance(language, nn.Module):  # a vision-language model
        front, body, vision = body, language, vision_modules(body)
    embed = causal_lm.get_input_embeddings()
    lm_head = causal_lm.get_output_embeddings()
    if embed is None or lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(f"{name}: needs an input embedding and an lm_head with a weight")
    layers = _find_layers(body, causal_lm.config.get_text_config().num_hidden_layers, name)
    final_norm = _find_final_norm(body, embed, layers, name)
    lm_head_attr = next(k for k, m in causal_lm.named_children() if m is lm_head)
    _check_no_other_params(causal_lm, [embed, layers, final_norm, lm_head, *vision.values()], name)
    _check_no_shared_params(layers, name)
    structure = ModelStructure(
        causal_lm=causal_lm,
        body=body,
        body_attr=body_attr,
        embed=embed,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        lm_head_attr=lm_head_attr,
        tied=lm_head.weight is embed.weight,
        front=front,
        vision=vision,
    )
    structure.groups = group_layers(structure)
    return structure


def _find_layers(body: nn.Module, num_layers: int, name: str) -> nn.ModuleList:
    candidates = [m for m in body.children() if isinstance(m, nn.ModuleList)]
    matching = [m for m in candidates if len(m) == num_layers]
    if len(matching) != 1:
        raise ValueError(
            f"{name}: cannot find the decoder layers (expected one ModuleList of "
            f"config.num_hidden_layers={num_layers} layers in the body, found "
            f"{[len(m) for m in candidates]})"
        )
    return matching[0]


def _find_final_norm(
    body: nn.Module, embed: nn.Module, layers: nn.ModuleList, name: str
) -> nn.Module:
    for attr in _NORM_NAMES:
        module = getattr(body, attr, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(
        f"{name}: cannot find the final norm of the body (looked for {', '.join(_NORM_NAMES)})"
    )


def _check_no_other_params(causal_lm: nn.Module, parts: list[nn.Module], name: str) -> None:
    known = {id(p) for m in parts for p in m.parameters()}
    extra = [n for n, p in causal_lm.named_parameters() if id(p) not in known]
    if extra:
        raise ValueError(
            f"{name}: parameters outside the embedding, decoder layers, final norm, lm_head and "
            "(vision-language models) the modules beside the language model are not supported: "
            f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}"
        )


def vision_modules(front: nn.Module) -> dict[str, nn.Module]:
    """The multimodal body's children other than its language model, by attribute name (the
    vision tower, the projector): what turns pixels into embeddings."""
    return {
        n: m
        for n, m in front.named_children()
        if m is not front.language_model and any(True for _ in m.parameters())
    }


def _check_no_shared_params(layers: nn.ModuleList, name: str) -> None:
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        for pname, p in layer.named_parameters():
            if id(p) in owner and owner[id(p)] != i:
                raise ValueError(
                    f"{name}: parameter {pname!r} is shared between decoder layers "
                    f"{owner[id(p)]} and {i}; layers with shared weights are not supported"
                )
            owner[id(p)] = i


def group_layers(structure: ModelStructure) -> list[LayerGroup]:
    """Layers with the same class, parameter shapes and layer type form one group."""
    layer_types = getattr(structure.causal_lm.config, "layer_types", None)
    groups: dict[tuple, LayerGroup] = {}
    for i, layer in enumerate(structure.layers):
        shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
        attn_kind = layer_types[i] if layer_types and i < len(layer_types) else "attention"
        is_moe = any("expert" in n for n in shapes)
        kind = f"{attn_kind}+moe" if is_moe else attn_kind
        key = (type(layer).__name__, kind, tuple(sorted(shapes.items())))
        if key not in groups:
            groups[key] = LayerGroup(kind=kind, layer_indices=[], param_shapes=shapes)
        groups[key].layer_indices.append(i)
    return list(groups.values())
