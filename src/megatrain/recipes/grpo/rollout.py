"""Rollouts: sampling completions with the policy's current weights, from the host store.

Each generation batch builds a device copy of the Hugging Face model (the weightless skeleton
copied, materialised on the device, its weights copied once from each store block's copy
source: the bf16 shadow, or the fp32 master in fp32 compute; no reload from disk) and runs
transformers' `generate` on it with a KV cache. The copy and its cache are freed before the
training phase, so the GPU holds either the rollout model or the engine's working set. When
the model does not fit, the streamed copy keeps only embedding and head resident and copies
each decoder layer into a slot just before it runs (all sequences advance one token per pass
over the layers; the KV cache stays on the GPU): slow, but any size generates. Between the
two, the resident copy may keep its decoder layers' linear weights compact (`compact`: int8 or
fp8, model/quant_linear.py, grpo.rollout_weights), quantized on the device block by block.

With `logprobs` the rollout also records each sampled token's log-prob under its own model
(log_softmax(logits / temperature)): the loss's truncated importance weights compare it with
the trainer's (recipes/grpo/loss.py).

Sampling is seeded by (seed, generation index) alone, under a forked RNG: a run and its resume
draw the same completions from the same weights, and the global RNG is untouched.

Under torchrun (store/shard.py: each rank holds a shard of every block) the resident copy is
built from every rank's shards, all-gathered block by block on the device, so each rank
generates its own prompts with the whole model (recipes/grpo/ranks.py); the streamed path
streams from a whole store and does not run under several ranks (recipes/grpo/plan.py).

A completion is the generated tokens up to and including the first end-of-sequence token, or
`max_new_tokens` tokens when there is none (clipped).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from megatrain.distributed import all_gather
from megatrain.engine.slots import bind_module
from megatrain.model.quant_linear import QuantLinear, compact_linears, quantize
from megatrain.model.structure import ModelStructure
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.store.shard import ShardedBlock, is_sharded


@dataclass
class Rollout:
    completions: list[list[int]]  # per prompt row, its completion tokens (EOS included)
    clipped: list[bool]  # no EOS within max_new_tokens
    generated_tokens: int  # tokens the model produced, padding after EOS excluded
    prefill_s: float = 0.0  # static path (decode.py): prefill, warm-up step and graph capture
    decode_s: float = 0.0  # static path: the decode_steps steps after those
    decode_steps: int = 0
    # with `logprobs`: per completion, each token's log-prob under the rollout's model at the
    # sampling temperature (log_softmax(logits / temperature), before top-p and EOS suppression:
    # the trainer's definition, so the two differ by the weights' precision only)
    logps: list[list[float]] | None = None


@contextmanager
def device_model(
    structure: ModelStructure,
    store: HostStore,
    device: torch.device,
    *,
    streamed: bool = False,
    num_slots: int | None = None,
    compact: str | None = None,
    ready: Callable[[ParamBlock], Any] | None = None,
    resident: Callable[[ParamBlock], torch.Tensor | None] = lambda _block: None,
) -> Iterator[Any]:
    """The HF model on `device` in the store's compute dtype, with its current weights.

    Resident (default): every weight copied to the device once. `streamed`: only the embedding
    and head are; each decoder layer's parameters are views into one of `num_slots` device
    buffers, and a forward pre-hook copies the layer's weights in just before it runs, so
    `generate` works whatever the model's size (every decoding step streams all layers).
    `compact` ("int8" or "fp8", resident only): the decoder layers' linear weights are kept in
    that format (model/quant_linear.py), quantized on the device block by block from the
    compute-dtype copy source, so the device holds the compact model and one layer in the
    compute dtype at most. The copy is freed on exit.

    `ready(block)` is called before a block's weights are read (the engine's `wait_update`:
    its pending optimizer update applied), in the store's forward order, the order the host
    worker updates them in: block k is copied while block k+1 is updated. Without it, call
    between optimizer steps (every update applied). `resident(block)`: the block's whole
    weights where the device already holds them (the engine's GPU tier, `tier_weights`), read
    there instead of from the store (under ranks: instead of all-gathering its shards again).
    """
    assert not (streamed and compact), "compact weights are for the resident rollout"
    model = copy.deepcopy(structure.causal_lm)  # meta parameters: copies the module tree only
    names = {id(m): n for n, m in structure.causal_lm.named_modules()}
    prefix = names[id(structure.layers)]
    layers = model.get_submodule(prefix)
    skip = {id(p) for p in layers.parameters()} if streamed else set()
    linears = {f"{prefix}.{n}": m for n, m in compact_linears(layers).items()} if compact else {}
    skip |= {id(m.weight) for m in linears.values()}
    made: dict[int, nn.Parameter] = {}  # tied parameters stay one tensor
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in skip:
                if id(p) not in made:
                    empty = torch.empty(p.shape, dtype=store.compute_dtype, device=device)
                    made[id(p)] = nn.Parameter(empty, requires_grad=False)
                module._parameters[name] = made[id(p)]
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)  # rotary frequencies etc., dtype kept
    blocks = [store.embed, store.head] if streamed else store.blocks
    if streamed and ready is not None:  # the layers are read while decoding: all updates first
        for block in store.blocks:
            ready(block)
    wait = ready if ready is not None and not streamed else (lambda _block: None)
    filled = _fill(model, blocks, device, {f"{n}.weight" for n in linears}, compact, wait, resident)
    assert filled == {id(p) for p in made.values()}, "every parameter lives in a store block"
    hooks = []
    if streamed:
        assert num_slots is not None, "streamed generation needs memory.num_slots"
        assert not is_sharded(store), "streamed generation from a sharded store"
        hooks = _stream_layers(list(layers.children()), store, device, num_slots)
    model.eval()
    try:
        yield model
    finally:
        for hook in hooks:
            hook.remove()
        del model, made
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _fill(
    model: nn.Module,
    blocks: list[ParamBlock],
    device: torch.device,
    quantized: set[str],
    compact: str | None,
    ready: Callable[[ParamBlock], Any],
    resident: Callable[[ParamBlock], torch.Tensor | None],
) -> set[int]:
    """Copy each block's weights into the model's device parameters (the ids of those filled),
    each after `ready(block)`; a weight named in `quantized` is quantized to `compact` from a
    device copy of its block (one block at a time) and its `nn.Linear` replaced by a
    QuantLinear."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled, done = set(), set()
    with torch.no_grad():
        for block in blocks:
            ready(block)
            source = resident(block)
            source = _whole_source(block, device) if source is None else source
            if compact and any(e.full_name in quantized for e in block.entries):
                source = source.to(device)  # the one block in the compute dtype
            for entry in block.entries:
                if entry.full_name in quantized:
                    assert compact is not None
                    owner = entry.full_name.removesuffix(".weight")
                    bias = model.get_submodule(owner).bias
                    assert bias is None or isinstance(bias, torch.Tensor)
                    q, scale = quantize(block.view(source, entry), compact)
                    parent, _, child = owner.rpartition(".")
                    setattr(model.get_submodule(parent), child, QuantLinear(q, scale, bias))
                    done.add(entry.full_name)
                    continue
                params[entry.full_name].copy_(block.view(source, entry), non_blocking=True)
                filled.add(id(params[entry.full_name]))
            del source
    assert done == quantized, "every quantized weight lives in a store block"
    return filled


def _whole_source(block: ParamBlock, device: torch.device) -> torch.Tensor:
    """The block's copy source in its whole flat layout: the source itself, or under several
    ranks (store/shard.py) every rank's shard all-gathered on `device` (a collective: every
    rank builds its rollout model at the same point, block after block)."""
    if not isinstance(block, ShardedBlock):
        return block.source
    full = torch.empty(block.padded_numel, dtype=block.source.dtype, device=device)
    all_gather(full, block.source.to(device))
    return full


def _stream_layers(
    layers: list[nn.Module], store: HostStore, device: torch.device, num_slots: int
) -> list[Any]:
    """Bind layer i's parameters to slot i % num_slots; copy its weights in before it runs."""
    numel = max(b.numel for b in store.layers)
    slots = [
        torch.empty(numel, dtype=store.compute_dtype, device=device)
        for _ in range(min(num_slots, len(store.layers)))
    ]
    hooks = []
    for i, (layer, block) in enumerate(zip(layers, store.layers, strict=True)):
        slot = slots[i % len(slots)]
        bind_module({"layer": layer}, block, slot)

        def load(_module: nn.Module, _args: Any, block: Any = block, slot: Any = slot) -> None:
            slot[: block.numel].copy_(block.source)  # synchronous: ready before the layer runs

        hooks.append(layer.register_forward_pre_hook(load))
    return hooks


def generate(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_ids: list[int],
    do_sample: bool,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    min_new_tokens: int = 0,
    logprobs: bool = False,
) -> Rollout:
    """Completions of `prompts` (one per row; repeat a prompt for several), left-padded batch.

    `min_new_tokens`: end-of-sequence suppressed before that many tokens
    (grpo.min_completion_length; `max_new_tokens` generates every completion at full length).
    `logprobs`: the sampled tokens' log-probs too (Rollout.logps; forward hooks on the model).
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)
    width = ids.shape[1]
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens or None,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=top_p if do_sample else None,
        top_k=0 if do_sample else None,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids,
        use_cache=True,
    )
    devices = [device] if device.type == "cuda" else []
    sampled = _SampledLogps(model, temperature) if logprobs else None
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config
            )
    finally:
        if sampled is not None:
            sampled.remove()
    new = out[:, width:]
    logps = sampled.finish(new).cpu().tolist() if sampled is not None else None
    rows = new.cpu().tolist()  # sync point: the completions to the host
    return to_rollout(rows, eos_token_ids, max_new_tokens, logps)


def sampling_logps(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, V] float32 log-probs the rollout records for its sampled tokens (Rollout.logps):
    log_softmax(logits / temperature), before top-p and end-of-sequence suppression."""
    return torch.log_softmax(logits_NV.float() / temperature, dim=-1)


class _SampledLogps:
    """Forward hooks that record, during `generate`, the log-prob of each sampled token.

    After each forward the last position's log_softmax(logits / temperature) waits (one [N, V]
    float32); the next forward's input ids are the tokens sampled from it, and the last
    sampled tokens come from the output (`finish`). Read once, at the end.
    """

    def __init__(self, model: nn.Module, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after),
        ]

    def _before(self, _module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.pending is not None:
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.steps.append(self.pending.gather(1, ids[:, -1:]))
            self.pending = None

    def _after(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self.pending = sampling_logps(output.logits[:, -1], self.temperature)

    def finish(self, new_NT: torch.Tensor) -> torch.Tensor:
        """[N, T] log-probs of the generated tokens `new_NT`."""
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, new_NT[:, -1:]))
            self.pending = None
        assert len(self.steps) == new_NT.shape[1], "one log-prob per generated token"
        return torch.cat(self.steps, dim=1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch: token ids and the mask of real tokens [N, W]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p) :] = 1
    return ids, mask


def to_rollout(
    rows: list[list[int]],
    eos_token_ids: list[int],
    max_new_tokens: int,
    logps: list[list[float]] | None = None,
) -> Rollout:
    """Generated rows (anything after the first EOS is padding) as completions, and their
    tokens' log-probs (`logps`, one per generated token) cut the same way."""
    eos = set(eos_token_ids)
    completions, clipped = [], []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        completions.append(row[: end if end is not None else max_new_tokens])
        clipped.append(end is None)
    kept = None
    if logps is not None:
        kept = [lp[: len(c)] for lp, c in zip(logps, completions, strict=True)]
    return Rollout(completions, clipped, sum(len(c) for c in completions), logps=kept)
