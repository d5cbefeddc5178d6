"""Vision-language models: what the multimodal body needs besides the embeddings, per micro-batch.

A vision-language model (`...ForConditionalGeneration` with a multimodal body holding a
`language_model`; model/structure.py) runs its own code to merge images: the body embeds the ids,
runs the vision tower and projector on the pixel inputs, scatters the features into the image
placeholder positions, builds the masks (Gemma 3's bidirectional attention over an image's
tokens from `token_type_ids`) and calls its language model. The engine keeps all of that: capture
(model/capture.py) runs the multimodal body with the kwargs made here and the engine's own
embeddings in place of the body's embedding lookup.

Made here, and nowhere per family:
- the token type ids the body's forward takes (`token_type_ids` / `mm_token_type_ids`: 1 at
  image tokens), from `input_ids == image token id`;
- Qwen's 3-D rotary positions (M-RoPE: temporal, height, width), per packed sample, from the
  body's own `get_rope_index`, with the text positions as a fourth row so the language model
  builds the packed-sequence mask (no attention across samples): [4, B, S]. A sample without
  images has its text positions in all three rows, as `get_rope_index` gives them.

Invariant: the images of a micro-batch (`Batch.images`) are in the order of their placeholder
tokens, row by row; a packed sample's images are the next ones in that order.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from megatrain.model.vision_attention import use_varlen


def image_token_id(config: PretrainedConfig) -> int:
    """The placeholder id image features replace (`image_token_id` or `image_token_index`)."""
    value = getattr(config, "image_token_id", None)
    if value is None:
        value = getattr(config, "image_token_index", None)
    if not isinstance(value, int):
        raise ValueError(f"{config.model_type}: the config names no image token id")
    return value


def image_inputs(
    config: PretrainedConfig, sizes: list[tuple[int, int]], *, seed: int = 0
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Random pixel inputs for images of `sizes` (height, width in pixels; the fixed-size
    families ignore them) as the family's processor shapes them, and each image's token count."""
    gen = torch.Generator().manual_seed(seed)
    vision = config.vision_config
    if hasattr(vision, "spatial_merge_size"):  # Qwen: flattened patches + (t, h, w) grids
        p, t, m = vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
        grids = [(1, h // p, w // p) for h, w in sizes]
        patches = sum(a * b * c for a, b, c in grids)
        pixels = torch.randn(patches, 3 * t * p * p, generator=gen)
        counts = [a * b * c // (m * m) for a, b, c in grids]
        return {"pixel_values": pixels, "image_grid_thw": torch.tensor(grids)}, counts
    side = vision.image_size
    pixels = torch.randn(len(sizes), 3, side, side, generator=gen)
    per_image = getattr(config, "mm_tokens_per_image", None) or getattr(
        config, "image_seq_length", None
    )
    assert isinstance(per_image, int), config.model_type
    return {"pixel_values": pixels}, [per_image] * len(sizes)


class MultimodalInputs:
    """The multimodal body's forward kwargs for one micro-batch (besides the embeddings)."""

    def __init__(self, front: nn.Module) -> None:
        self.front = front
        config: Any = front.config
        self.image_id = image_token_id(config)
        params = inspect.signature(type(front).forward).parameters
        self._type_keys = [k for k in ("token_type_ids", "mm_token_type_ids") if k in params]
        self._rope = getattr(front, "get_rope_index", None)
        self._rope_params = set(inspect.signature(self._rope).parameters) if self._rope else set()
        vision = getattr(config, "vision_config", None)
        self._merge = getattr(vision, "spatial_merge_size", 1)

    def kwargs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        images: dict[str, torch.Tensor] | None,
    ) -> dict[str, Any]:
        is_image = input_ids == self.image_id
        out: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "use_cache": False,
            **(images or {}),
        }
        for key in self._type_keys:
            out[key] = is_image.to(torch.int64 if key == "token_type_ids" else torch.int32)
        if self._rope is not None:
            out["position_ids"] = self.rope_positions(input_ids, position_ids, images)
        else:
            out["position_ids"] = position_ids
        if images is None:
            _check_no_placeholders(is_image, self.image_id)
        return out

    def rope_positions(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        images: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        """[4, B, S]: the text positions, then M-RoPE's three rows, per packed sample."""
        B, S = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).expand(B, S)
        grids = images.get("image_grid_thw") if images else None
        pending = [] if grids is None else [tuple(g) for g in grids.tolist()]
        rows = torch.empty(3, B, S, dtype=torch.int64, device=input_ids.device)
        starts = (position_ids == 0).cpu()
        counts = (input_ids == self.image_id).cumsum(1).cpu()
        for b in range(B):
            bounds = [*torch.nonzero(starts[b]).flatten().tolist(), S]
            for s, e in itertools.pairwise(bounds):
                tokens = int(counts[b, e - 1]) - (int(counts[b, s - 1]) if s else 0)
                taken = []
                while tokens > 0:
                    if not pending:
                        raise ValueError(
                            "a micro-batch has more image placeholder tokens than its images' "
                            "grids account for (Batch.images['image_grid_thw'])"
                        )
                    grid = pending.pop(0)
                    taken.append(grid)
                    tokens -= grid[0] * grid[1] * grid[2] // (self._merge**2)
                rows[:, b, s:e] = self._sample_rope(input_ids[b, s:e], taken, position_ids[b, s:e])
        return torch.cat([position_ids[None].to(torch.int64), rows])

    def _sample_rope(
        self, ids: torch.Tensor, grids: list[tuple[int, ...]], text: torch.Tensor
    ) -> torch.Tensor:
        if not grids:
            return text[None].expand(3, -1)
        kwargs: dict[str, Any] = {
            "input_ids": ids[None],
            "image_grid_thw": torch.tensor(grids, device=ids.device),
        }
        if "attention_mask" in self._rope_params:
            kwargs["attention_mask"] = torch.ones_like(ids)[None]
        if "mm_token_type_ids" in self._rope_params:
            kwargs["mm_token_type_ids"] = (ids == self.image_id).to(torch.int32)[None]
        assert self._rope is not None
        positions, _ = self._rope(**kwargs)
        return positions[:, 0, :]


def _check_no_placeholders(is_image: torch.Tensor, image_id: int) -> None:
    if bool(is_image.any()):
        raise ValueError(
            f"a micro-batch holds image placeholder tokens (id {image_id}) but no images; "
            "image rows need their images (data: an `images` column)"
        )


class EmbeddingStandIn(nn.Module):
    """Stands in for the language model's embedding during capture: returns the engine's
    embeddings (already computed, autograd-connected to the gathered rows) for the ids."""

    def __init__(self, embeds: torch.Tensor) -> None:
        super().__init__()
        self.embeds = embeds

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert tuple(input_ids.shape) == tuple(self.embeds.shape[:2]), (
            input_ids.shape,
            self.embeds.shape,
        )
        return self.embeds


def _is_projector(name: str) -> bool:
    """The projector (pixels' features -> the language model's width): LLaVA's and Gemma 3's
    `multi_modal_projector`, Qwen's `merger` (and Qwen3-VL's deepstack mergers)."""
    last = name.rpartition(".")[2]
    return "projector" in last or "merger" in last


def vision_parts(structure: Any) -> dict[str, tuple[nn.Module, bool]]:
    """The vision modules split into tower and projector parts: dotted name under the
    multimodal body -> (module, is a projector). A module holding both is split into its
    children; parameters held directly by such a module count as the tower's."""
    out: dict[str, tuple[nn.Module, bool]] = {}

    def visit(name: str, module: nn.Module, projector: bool) -> None:
        mixed = not projector and any(_is_projector(n) for n, _ in module.named_modules() if n)
        if not mixed:
            if any(True for _ in module.parameters()):
                out[name] = (module, projector)
            return
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"{name}: a vision module holding both projector and tower parts has parameters "
                "of its own; train its vision modules together or not at all"
            )
        for child, sub in module.named_children():
            visit(f"{name}.{child}", sub, _is_projector(child))

    for name, module in structure.vision.items():
        visit(name, module, _is_projector(name))
    return out


def trained_vision(structure: Any, *, tower: bool, projector: bool) -> dict[str, nn.Module]:
    """The vision parts that train (model.freeze_vision / freeze_projector false), by name."""
    return {
        n: m
        for n, (m, is_proj) in vision_parts(structure).items()
        if (projector if is_proj else tower)
    }


def unused_vision_params(structure: Any) -> set[int]:
    """ids of the vision parameters the image features never depend on (LLaVA's layers after
    its feature layer, the pooling head of Gemma 3's SigLIP tower): PyTorch's AdamW leaves a
    parameter without gradient alone, so the store keeps these frozen. Found once, from the
    autograd graph of one smallest image's features on the host (fp32, no backward)."""
    front = structure.front
    if front is None:
        return set()
    config = front.config
    vision = config.vision_config
    side = getattr(vision, "patch_size", 14) * getattr(vision, "spatial_merge_size", 1)
    inputs, _ = image_inputs(config, [(side, side)])
    params = [p for m in structure.vision.values() for p in m.parameters()]
    wanted = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            out = front.get_image_features(**inputs, return_dict=True)
    finally:
        for p, flag in zip(params, wanted, strict=True):
            p.requires_grad_(flag)
    roots: list[torch.Tensor] = []
    pending: list[Any] = [out.pooler_output, getattr(out, "deepstack_features", None)]
    while pending:
        x = pending.pop()
        if isinstance(x, torch.Tensor):
            roots.append(x)
        elif isinstance(x, (list, tuple)):
            pending.extend(x)
    reached = _leaves(roots)
    return {id(p) for m in structure.vision.values() for p in m.parameters()} - reached


def _leaves(roots: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors the autograd graph of `roots` reaches."""
    seen: set[Any] = set()
    stack: list[Any] = [t.grad_fn for t in roots if t.grad_fn is not None]
    found: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(f for f, _ in fn.next_functions)
    return found


def vision_split(structure: Any) -> tuple[int, int]:
    """(tower, projector) parameters of the vision modules (0, 0 for a text-only model)."""
    tower = projector = 0
    for module, is_proj in vision_parts(structure).values():
        n = sum(p.numel() for p in module.parameters())
        tower, projector = (tower, projector + n) if is_proj else (tower + n, projector)
    return tower, projector


def patches_per_image_token(config: PretrainedConfig) -> float:
    """Patches the vision tower runs per image token: Qwen merges merge x merge patches into
    one; the fixed-size families (LLaVA, Gemma 3) pool an image's patches into its tokens."""
    vision = config.vision_config
    merge = getattr(vision, "spatial_merge_size", None)
    if merge:
        return float(merge * merge)
    side = vision.image_size // vision.patch_size
    per_image = getattr(config, "mm_tokens_per_image", None) or getattr(
        config, "image_seq_length", None
    )
    return side * side / (per_image or side * side)


def vision_width(config: PretrainedConfig) -> int:
    """The vision tower's hidden size (Qwen2-VL calls it embed_dim)."""
    vision = config.vision_config
    return int(getattr(vision, "embed_dim", None) or vision.hidden_size)


def vision_saved_bytes_per_patch(config: PretrainedConfig, itemsize: int) -> int:
    """What the vision tower's autograd keeps per patch (all its blocks) when it trains:
    per block 12 x width (attention input, q/k/v and their rotary copies, output, norms kept
    in fp32) and 7 x intermediate (the MLP's gate, up, activation, down input, in and out of
    fp32). Calibrated on an H100 (docs/performance.md run 38: Qwen2.5-VL-7B's tower, 8,192
    patches a micro-batch, ~19 GiB): ~77 KiB a patch and block there."""
    vision = config.vision_config
    depth = getattr(vision, "depth", None) or vision.num_hidden_layers
    width = vision_width(config)
    inner = getattr(vision, "intermediate_size", None) or 4 * width
    return int(depth * (12 * width + 7 * inner) * itemsize)


def vision_numel(structure: Any) -> int:
    """Parameters of a vision-language model's vision modules (0 for a text-only model)."""
    return sum(vision_split(structure))


def vision_on_device(
    structure: Any, flat: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> dict[str, nn.Module]:
    """The vision modules of a vision-language model as they run: copies whose frozen
    parameters are views of `flat` (the device layout's buffer, compute dtype), in eval mode.
    The host keeps the fp32 originals, exported as loaded; buffers (rotary tables) go to the
    device. Parameters the store took (trained ones: meta on the host) stay meta in the copies,
    for the engine to bind (engine/vision.py). Attention over Qwen's windows runs as one
    varlen kernel where it can (model/vision_attention.py)."""
    if not structure.vision:
        return {}
    frozen = [
        p for m in structure.vision.values() for p in m.parameters() if p.device.type != "meta"
    ]
    numel = sum(p.numel() for p in frozen)
    assert (flat.numel() if flat is not None else 0) == numel, (numel, flat)
    out, offset = {}, 0
    for name, module in structure.vision.items():
        memo: dict[int, Any] = {}
        for p in module.parameters():
            if p.device.type == "meta":
                continue
            assert flat is not None
            view = flat[offset : offset + p.numel()].view(p.shape)
            view.copy_(p.detach())
            memo[id(p)] = nn.Parameter(view, requires_grad=False)
            offset += p.numel()
        clone = copy.deepcopy(module, memo)
        for sub in clone.modules():
            for key, buf in list(sub._buffers.items()):
                if buf is not None and buf.device.type != "meta":
                    sub._buffers[key] = buf.to(device)
        use_varlen(clone, dtype, device)  # Qwen's chunked attention in one call
        out[name] = clone.eval()
    return out
