"""The `memory:` section: where weights, optimizer states and activations live (GPU or host),
and how long rows are cut (layer inputs kept every K layers, MLP sequence tiles).
The planner (planning/plan.py) resolves its "auto" values."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.choices import OFFLOAD_CHOICES
from megatrain.config.types import (
    check_choice,
    check_count_or_auto,
    check_int,
    check_number,
    check_types,
)


@dataclass(frozen=True)
class MemoryConfig:
    num_slots: int = 2
    """GPU weight slots: layers resident at once (prefetch depth + 1), >= 1."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the fused LM-head + loss; None: chosen from the vocabulary size."""
    pin_memory: bool = True
    """Pin the host bf16 weight shadow and transfer buffers (faster, asynchronous copies)."""
    gpu_margin_gib: float = 2.0
    """GPU memory every plan leaves free beside its predicted peak (the allocator's reserved
    peak: allocated bytes plus the allocator's slack): micro_batch_size, the GPU tier, layer
    inputs and MLP tiles "auto", and the fit check."""
    host_margin_gib: float = 4.0
    """Host memory the resource check keeps free for the OS and data loading."""
    gpu_state_blocks: int | str = "auto"
    """Blocks whose fp32 master, AdamW states (in optimizer.state_dtype's format: fp32, bf16 or
    int8; int4 takes no tier) and bf16 weights (which hold the gradient until the update) stay
    on the GPU and are updated there with the host's arithmetic, never streamed (each goes to
    the GPU as the store is built, so the host never holds it, loading included), counted in
    this order: the decoder layers from the first, then the embedding, then the head: 14 B/param
    on the GPU with fp32 states, 10 bf16, 8 int8. An integer >= 0 (0: none; more than the
    model has: all), or
    "auto": as many as the GPU holds beside the run (gpu_margin_gib kept free); none on the CPU.
    Under torchrun each rank keeps its 1/N shard of those states on its GPU and the blocks'
    weights whole; "auto" plans one rank's GPU (every rank takes the least count planned)."""
    probe_rates: bool = True
    """Before it plans, a run on a GPU measures this machine's pinned copy rates each way and
    its CPU AdamW rate (the run's state format, impl and threads), about 3 s and 3 GB of host
    memory that are freed again, and plans with them (the GPU tier, the update share and its
    staging sets, the printed step); under torchrun the first rank of each node measures while
    the others wait, and every rank plans with the slowest node's rates. false: the rates of
    the H100 test host (`megatrain estimate` assumes them unless given --probe)."""
    activation_offload: str = "auto"
    """Each layer's saved input (boundary activation) to host memory during the forward, copied
    back just ahead of its backward: "on" (all kept inputs), "off" (all stay on the GPU), or
    "auto": those the GPU cannot hold beside the run go to the host (none on the CPU)."""
    checkpoint_every: int | str = "auto"
    """Keep the saved input of one layer in K (>= 1) and recompute the others in the backward
    from the kept one before them (K - 1 extra layer forwards per K), or "auto": the smallest K
    whose kept inputs fit the GPU and host (1 when all fit)."""
    mlp_tiles: int | str = "auto"
    """Sequence tiles each decoder layer's MLP and norms run over ([tokens x intermediate] tensors
    then exist one tile at a time): an integer >= 1 (1: not tiled) or "auto": on the GPU the
    fewest tiles (1, 2, 4, ...) whose predicted peak fits, up to tiles of 16384 tokens (a tiled
    MLP runs its forward once more in the backward, so tiles are paid only where memory needs
    them; `megatrain estimate` prints the choice); on the CPU tiles of at most 16384 tokens;
    none with training.compile_layers. With tiles, the norms' outputs are not kept for the
    backward and attention's backward runs over groups of heads once a call would cover more
    than 2^21 head x positions (docs/architecture.md)."""

    def validate(self) -> None:
        check_types("memory", self)
        check_choice("memory.activation_offload", self.activation_offload, OFFLOAD_CHOICES)
        for key in ("checkpoint_every", "mlp_tiles"):
            value = getattr(self, key)
            if (isinstance(value, str) and value != "auto") or (
                isinstance(value, int) and value < 1
            ):
                raise ValueError(
                    f"memory.{key}={value!r} must be an integer >= 1 or 'auto' "
                    "(docs/configuration.md, memory section)"
                )
        check_count_or_auto(
            "memory.gpu_state_blocks",
            self.gpu_state_blocks,
            "keep every optimizer state on the host",
        )
        check_int("memory.num_slots", self.num_slots, minimum=1)
        check_int("memory.loss_chunk_tokens", self.loss_chunk_tokens, minimum=1, optional=True)
        check_number("memory.gpu_margin_gib", self.gpu_margin_gib, low=0.0)
        check_number("memory.host_margin_gib", self.host_margin_gib, low=0.0)
