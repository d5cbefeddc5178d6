"""The `optimizer:` section: AdamW's hyper-parameters, clipping, the learning-rate schedule,
the host kernel and threads, and the host store's formats (docs/optimizer_states.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatrain.choices import GRAD_DTYPES, MASTER_DTYPES, STAGING_SET_CHOICES, STATE_DTYPES
from megatrain.config.types import (
    check_choice,
    check_count_or_auto,
    check_int,
    check_number,
    check_types,
)

LR_SCHEDULERS = ("constant", "linear", "cosine")
OPTIMIZER_IMPLS = ("auto", "c", "torch")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    """The optimizer; only "adamw" (fp32 AdamW on the CPU)."""
    learning_rate: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2); in YAML a list of two numbers."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the parameters that decay (see no_decay, decay_1d)."""
    no_decay: tuple[str, ...] = ("bias", "norm")
    """Regexes searched in parameter names; matching parameters get no weight decay."""
    decay_1d: bool = False
    """Also decay 1-D parameters (biases, norm weights), which otherwise never decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    lr_scheduler: str = "cosine"
    """Decay after warmup: "constant", "linear" or "cosine"."""
    warmup_steps: int = 0
    """Linear warmup steps. Exclusive with warmup_ratio."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of all optimizer steps, 0 <= r < 1. Exclusive with warmup_steps."""
    min_lr_ratio: float = 0.0
    """Floor of the linear/cosine decay as a fraction of learning_rate."""
    impl: str = "auto"
    """AdamW kernel: "c" (compiled C, OpenMP), "torch", or "auto" (c when it compiles)."""
    threads: int | None = None
    """CPU threads for the optimizer (its results do not depend on them); None: the cores this
    process may use (its CPU affinity, less those other processes keep busy) but two; with
    several ranks on a node, each rank's share of them less one (megatrain/threads.py)."""
    state_dtype: str = "fp32"
    """AdamW m and v on the host: "fp32" (exact, 8 B/param), "bf16" (stochastic rounding, 4),
    "int8" (block-wise 8-bit Adam, ~2) or "int4" (block-wise 4-bit, 1.06; optimizer_states.md)."""
    master_dtype: str = "fp32"
    """Master weights on the host: "fp32" (4 B/param, plus the 2 B/param bf16 copy that
    streams to the GPU) or "bf16" (2 B/param: the update runs in fp32 and is rounded
    stochastically into the bf16 master, which is also the streamed copy; gradients then land
    in a bf16 buffer of their own, 2 B/param). bf16 needs model.compute_dtype bf16 and keeps
    no GPU tier (docs/optimizer_states.md)."""
    grad_dtype: str = "bf16"
    """How a bf16 master's gradients wait on the host for their update while clipping needs
    all of them: "bf16" (2 B/param) or "int8" (1.002: block-wise, rounded stochastically on the
    GPU after the exact norm is taken). Without clipping (max_grad_norm 0) each update runs
    after its block's backward and the gradient lands in a few shared bf16 buffers instead.
    Only with master_dtype bf16 (an fp32 master's gradient lands in its bf16 copy, free)."""

    gpu_update_blocks: int | str = "auto"
    """Streamed blocks whose AdamW update runs on the GPU each step instead of the CPU: those
    the CPU would reach last in forward order (the head, then the layers from the last; never
    GPU-tier blocks). Their gradients stay on the GPU; master and states, in their stored
    formats, are copied to the GPU, updated there with the same arithmetic (the same results,
    bit for bit) and copied back while the CPU updates the rest. An integer >= 0 (0: off), or
    "auto" (the default): the count whose predicted step is shortest within the GPU memory
    left (0 where the CPU update does not bound the step, on the CPU, and under torchrun);
    with memory.gpu_state_blocks also "auto", GPU-tier blocks are given up for it where that
    predicts a shorter step. Costs GPU memory: each block's held gradient (2 B/param, int8 1)
    and one block's master and states per staging set (optimizer.gpu_update_sets). The update
    runs the fused Triton kernel where it takes the formats (an fp32 master), else the torch
    reference of the C kernel. The NaN losses GPT-OSS-20B runs gave with a share (runs 70-74)
    came from a race of the embedding's copy, fixed since; the product's settings then ran 20
    steps clean (run 77; docs/optimizer_states.md, "The share's NaN")."""
    gpu_update_sets: int | str = "auto"
    """Device staging sets of the GPU update share, taken in turn: 1 (a block's states go up
    once the previous block's are back on the host: the link's two directions one after the
    other), 2 (one block's go up while the previous one's come back, for a second block's
    master and states of GPU memory), or "auto" (the default: the one whose predicted step is
    shorter within the GPU memory left, planned with optimizer.gpu_update_blocks and
    memory.gpu_state_blocks). 1 where the share holds fewer than two blocks."""

    def validate(self) -> None:
        check_types("optimizer", self)
        check_choice("optimizer.name", self.name, ("adamw",))
        check_number("optimizer.learning_rate", self.learning_rate, low=0.0)
        for i, beta in enumerate(self.betas):
            check_number(f"optimizer.betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        check_number("optimizer.eps", self.eps, low=0.0, low_open=True)
        check_number("optimizer.weight_decay", self.weight_decay, low=0.0)
        for pattern in self.no_decay:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"optimizer.no_decay: {pattern!r} is not a valid regular expression ({e})"
                ) from e
        check_number("optimizer.max_grad_norm", self.max_grad_norm, low=0.0)
        check_choice("optimizer.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        check_int("optimizer.warmup_steps", self.warmup_steps, minimum=0)
        check_number("optimizer.warmup_ratio", self.warmup_ratio, low=0, high=1, high_open=True)
        if self.warmup_steps > 0 and self.warmup_ratio > 0:
            raise ValueError(
                f"optimizer.warmup_steps={self.warmup_steps!r} and optimizer.warmup_ratio="
                f"{self.warmup_ratio!r} are both set; set one of them and leave the other at 0"
            )
        check_number("optimizer.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        check_choice("optimizer.impl", self.impl, OPTIMIZER_IMPLS)
        check_int("optimizer.threads", self.threads, minimum=1, optional=True)
        check_choice("optimizer.state_dtype", self.state_dtype, STATE_DTYPES)
        check_choice("optimizer.master_dtype", self.master_dtype, MASTER_DTYPES)
        check_choice("optimizer.grad_dtype", self.grad_dtype, GRAD_DTYPES)
        check_count_or_auto(
            "optimizer.gpu_update_blocks",
            self.gpu_update_blocks,
            "every streamed block is updated on the CPU",
        )
        sets = ("auto", *STAGING_SET_CHOICES)
        check_choice("optimizer.gpu_update_sets", self.gpu_update_sets, sets)
        if self.grad_dtype != "bf16" and self.master_dtype == "fp32":
            raise ValueError(
                f"optimizer.grad_dtype: {self.grad_dtype} sets how a bf16 master's gradients are "
                "held, but optimizer.master_dtype is fp32, whose gradients land in its bf16 copy "
                "and cost no host memory: set optimizer.master_dtype: bf16 as well, or remove "
                "optimizer.grad_dtype"
            )

    @property
    def clip_norm(self) -> float | None:
        """The global gradient norm to clip to, or None: clipping off (max_grad_norm 0).

        The one place "0 disables clipping" is decided; everything else asks this."""
        return self.max_grad_norm if self.max_grad_norm > 0 else None
