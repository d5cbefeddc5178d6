"""The planning half of the one builder (megatrain/recipes/builder.py): config -> resolved plan.

`PlanBuilder(cfg, placement=...).plan()` reads the model's config alone and predicts the run
(planning/plan.py); `engine_plan()` is the `EnginePlan` the engine runs (engine/plan.py), every
"auto" setting (GPU tier, where layer inputs wait, MLP tiles) resolved by that same plan, so
the run uses what the fit check saw. Pure: no process group, no collective; under torchrun
the placement is this rank's and the caller agrees on one GPU-tier count over the ranks
(recipes/builder.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatrain.config import TrainConfig
from megatrain.distributed import Placement
from megatrain.engine.plan import EnginePlan
from megatrain.model.loading import load_config as load_hf_config
from megatrain.planning import Hardware, ModelSpec, detect, model_spec, timing
from megatrain.planning.hardware import GIB, gib
from megatrain.planning.plan import ResourcePlan, resolve
from megatrain.planning.run_shape import RunShape

_ATTENTION_KINDS = ("attention", "full_attention", "sliding_attention")
COMPILE_AUTO_KINDS = (*_ATTENTION_KINDS, *(f"{kind}+moe" for kind in _ATTENTION_KINDS))
"""Layer kinds (model/structure.py) that compile_layers "auto" compiles: softmax attention with
an MLP or routed experts, whose compiled peak the eager profile covers (measured: the
Llama-3.1-8B shape; a Qwen3-30B-A3B shape cut to 12 layers, 71.63 GiB reserved compiled and
eager, 1.40x faster compiled: docs/performance.md runs 40 and 41). Hybrid linear-attention
layers stay eager: compiled on torch's kernels they peak above the eager profile (the plan
scales it: COMPILED_LINEAR_ATTENTION_PEAK) after minutes of compiling, and with
flash-linear-attention they ran slower compiled than eager and held more (runs 41 and 45: 11.54 s
against 9.60-9.83, COMPILED_PACKAGE_SLOWDOWN, COMPILED_PACKAGE_LINEAR_ATTENTION_PEAK)."""


@dataclass(frozen=True)
class StepDown:
    """The plan after a step ran out of GPU memory, and what changed."""

    before: EnginePlan
    after: EnginePlan
    margin_gib: tuple[float, float]  # memory.gpu_margin_gib planned with, before and after
    peak_bytes: tuple[int, int]  # predicted GPU peak, before and after
    step_s: tuple[float, float]  # predicted step time, before and after
    # every failure was a launch outside PyTorch's allocator (recipes/oom.py): the plan goes
    # back up once the step has run (kernel autotuning, in the first steps)
    transient: bool = False
    event = "plan_step_down"  # the metrics.jsonl record's kind

    def changes(self) -> str:
        b, a = self.before, self.after
        return ", ".join(
            f"{name}{x} -> {y}"
            for name, x, y in (
                ("memory.gpu_state_blocks ", b.gpu_state_blocks, a.gpu_state_blocks),
                ("", _inputs(b), _inputs(a)),
                ("MLP tiles ", b.tile_count, a.tile_count),
            )
            if x != y
        )

    def describe(self) -> str:
        """One paragraph: what the plan changed, and what it costs."""
        if self.transient:
            return (
                f"the plan stepped down for this step: {self.changes()}. The failures were "
                "kernel launches outside PyTorch's allocator (a kernel package autotuning), "
                "so the plan goes back up once the step has run, as far as the memory the "
                "tuned kernels keep allows"
            )
        a, b = self.after, self.before
        return (
            f"the plan stepped down: {self.changes()} (planned with "
            f"memory.gpu_margin_gib {self.margin_gib[1]:g} instead of {self.margin_gib[0]:g}); "
            f"predicted GPU peak {gib(self.peak_bytes[0])} -> {gib(self.peak_bytes[1])}, step "
            f"{self.step_s[0]:.2f} s -> {self.step_s[1]:.2f} s. To start with this plan: "
            f"--memory.gpu_margin_gib {self.margin_gib[1]:g}"
            + (
                f" --memory.gpu_state_blocks {a.gpu_state_blocks}"
                if a.gpu_state_blocks != b.gpu_state_blocks
                else ""
            )
        )

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl fields of the step-down."""
        return {
            "gpu_state_blocks": [self.before.gpu_state_blocks, self.after.gpu_state_blocks],
            "layer_inputs": [_inputs(self.before), _inputs(self.after)],
            "mlp_tiles": [self.before.tile_count, self.after.tile_count],
            "gpu_margin_gib": list(self.margin_gib),
            "pred_gpu_peak_gib": [round(n / GIB, 2) for n in self.peak_bytes],
            "pred_step_s": [round(t, 3) for t in self.step_s],
            "transient": self.transient,
        }


def _quarter_gib(nbytes: int) -> float:
    """`nbytes` as GiB, rounded up to a quarter: a margin a user can type."""
    return math.ceil(4 * nbytes / GIB) / 4


def _inputs(plan: EnginePlan) -> str:
    return plan.boundaries.describe() if plan.boundaries else "layer inputs on the GPU"


class PlanBuilder:
    """A run's config -> its resource plan and the settings the plan resolves, before any
    weight exists (meta device). `RunBuilder` extends it with the parts that hold weights and
    data; `megatrain estimate` needs no more than this.

    Cached: `hf_config`, `spec`, `hardware` and the run's own `plan()` are built at most once,
    so the batch, GPU tier, layer-input plan and MLP tiles a run uses are those that were
    checked.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        placement: Placement,
        hardware: Hardware | None = None,
        gpu_reserve: Callable[[PlanBuilder], int] | None = None,
    ) -> None:
        """`placement`: where the run goes (`megatrain estimate` passes the one it plans for,
        a GPU it may not have; a run its own, distributed.placement_here). `gpu_reserve`:
        the GPU bytes another phase of the run needs beside the engine's persistent buffers,
        from this builder's spec and hardware (GRPO's resident rollout: recipes/grpo/plan.py);
        the automatic GPU tier leaves them free."""
        self.cfg = cfg
        self.placement = placement
        self._hardware = hardware
        self._gpu_reserve = gpu_reserve
        # the data's share of image tokens (a vision-language run sets it before planning)
        self.image_share = 0.0

    @property
    def device(self) -> Any:
        """torch.device of the run."""
        return self.placement.device

    # ---------------------------------------------------------------- plan (no weights)

    @functools.cached_property
    def hf_config(self) -> Any:
        m = self.cfg.model
        return load_hf_config(
            m.name_or_path,
            model_type=m.model_type,
            tiny=m.tiny,
            trust_remote_code=m.trust_remote_code,
            overrides=dict(m.config_overrides) or None,
        )

    @functools.cached_property
    def spec(self) -> ModelSpec:
        m = self.cfg.model
        return model_spec(self.hf_config, m.compute_dtype, m.attn_implementation)

    @functools.cached_property
    def hardware(self) -> Hardware:
        """The given hardware, else this machine's; optimizer.threads, when set, is the AdamW
        threads of each of the node's ranks (the compressed kernels' rate follows them)."""
        return self._node_threads(self._hardware or self._machine())

    def _node_threads(self, hw: Hardware) -> Hardware:
        """`hw` with the node's CPU AdamW threads optimizer.threads sets (each rank's, times
        the node's ranks); as it is where the key is unset."""
        threads = self.cfg.optimizer.threads
        if threads is None:
            return hw
        return hw.with_overrides(optimizer_threads=threads * self.placement.local_world_size)

    def _machine(self) -> Hardware:
        """This machine as the plan sees it: detect()'s sizes and the assumed rates."""
        return detect()

    @property
    def pin_memory(self) -> bool:
        """Pinned host buffers: asked for, and useful (only CUDA copies from them)."""
        return self.cfg.memory.pin_memory and self.placement.is_cuda

    def shape(self, layout: str | None = None, compiled: bool | None = None) -> RunShape:
        return RunShape.of(
            self.cfg,
            self.placement,
            layout=layout,
            compiled=self.compiled if compiled is None else compiled,
            pin_memory=self.pin_memory,
            images=self.image_share,
        )

    def plan(
        self, *, tokens_per_step: int | None = None, layout: str | None = None
    ) -> ResourcePlan:
        """The resource plan; the run's own (no arguments) is computed once and cached.

        `tokens_per_step` / `layout` ask what-if questions (megatrain estimate's flags).
        With `training.global_batch_size` and micro_batch_size "auto" the step's tokens are
        fixed at global_batch_size x seq_len.
        """
        if tokens_per_step is None and layout is None:
            return self._own_plan
        return self._plan(tokens_per_step, layout)

    def batch(self) -> tuple[int, int]:
        """(micro_batch_size, gradient accumulation) of the run: the config's, or the plan's
        when micro_batch_size is "auto" (the plan is then computed, else it is not needed)."""
        t = self.cfg.training
        if isinstance(t.micro_batch_size, int):
            return t.micro_batch_size, t.gradient_accumulation_steps
        plan = self.plan()
        return plan.micro_batch_size, plan.grad_accum

    @functools.cached_property
    def _own_plan(self) -> ResourcePlan:
        return self._plan(None, None)

    @functools.cached_property
    def compiled(self) -> bool:
        """training.compile_layers resolved: "auto" compiles on a GPU where the plan's memory
        holds for compiled layers (see its docstring in config/sections.py)."""
        setting = self.cfg.training.compile_layers
        if not isinstance(setting, str):
            return setting
        plain = all(g.kind in COMPILE_AUTO_KINDS for g in self.spec.structure.groups)
        fixed_rows = self.cfg.layout != "padded"
        if not (self.placement.is_cuda and plain and fixed_rows):
            return False
        tiles = self.cfg.memory.mlp_tiles
        return tiles == 1 or (tiles == "auto" and self._plan(None, None, False).mlp_tiles == 1)

    def _plan(
        self, tokens_per_step: int | None, layout: str | None, compiled: bool | None = None
    ) -> ResourcePlan:
        return resolve(
            self.cfg,
            self.spec,
            self.hardware,
            self.shape(layout, compiled),
            tokens_per_step=tokens_per_step,
            gpu_reserve_bytes=self.gpu_reserve_bytes,
        )

    @functools.cached_property
    def gpu_reserve_bytes(self) -> int:
        """What `gpu_reserve` leaves free beside the engine (0 without one)."""
        return self._gpu_reserve(self) if self._gpu_reserve is not None else 0

    def reference_swap_s(self, gpu_state_blocks: int) -> float:
        """planning/timing.py `reference_swap_s` of this run's model, machine and ranks."""
        return timing.reference_swap_s(
            self.spec,
            self.hardware,
            gpu_state_blocks,
            self.placement.is_cuda,
            self.shape().ranks,
        )

    def engine_plan(self) -> EnginePlan:
        """The plan the engine runs: the resource plan's (this rank's GPU-tier count)."""
        return self.plan().engine

    def step_down(self, shortfall_bytes: int) -> StepDown | None:
        """After a step ran out of GPU memory: plan again with `shortfall_bytes` more of the GPU
        left free (at least 1 GiB more margin): the GPU tier becomes the count "auto" picks
        with that margin, and at least one block fewer while there are any; the "auto"
        settings (layer inputs, MLP tiles) follow the new margin.
        None, with nothing changed, when the smaller plan is the same as the current one.

        Changes this builder's config (memory.gpu_margin_gib, memory.gpu_state_blocks): the
        next engine it builds, and the config a checkpoint saves, are the smaller plan's.
        """
        cfg, mem = self.cfg, self.cfg.memory
        before, old_plan = self.engine_plan(), self.plan()
        more_gib = max(1.0, _quarter_gib(shortfall_bytes))
        margin = mem.gpu_margin_gib + more_gib
        # a given tier count proved too large: the new margin's "auto" count, if smaller
        self._replan(dataclasses.replace(mem, gpu_margin_gib=margin, gpu_state_blocks="auto"))
        tier = min(self.plan().gpu_state_blocks, max(before.gpu_state_blocks - 1, 0))
        self._replan(dataclasses.replace(self.cfg.memory, gpu_state_blocks=tier))
        after = self.engine_plan()
        if after == before:
            self._replan(mem, cfg)
            return None
        new_plan = self.plan()
        return StepDown(
            before,
            after,
            (mem.gpu_margin_gib, margin),
            (old_plan.estimate.gpu.peak_bytes, new_plan.estimate.gpu.peak_bytes),
            (old_plan.estimate.time.step_s, new_plan.estimate.time.step_s),
        )

    def step_up(self, memory: Any, grown_bytes: int = 0) -> StepDown | None:
        """Back to the plan of `memory` (the memory config before a transient step-down): the
        change, as a StepDown whose `before` is the smaller plan. `grown_bytes`: GPU memory
        held outside PyTorch's allocator beyond what the run started with (kernel modules and
        the driver's local memory that a kernel package's autotuning left behind); the plan
        then leaves that much more free (memory.gpu_margin_gib), and its GPU tier is the
        smaller of the count before and the count "auto" picks with that margin. None, with
        nothing changed, when that plan is the current one or has fewer tier blocks."""
        cfg, before, old_plan = self.cfg, self.engine_plan(), self.plan()
        margin = cfg.memory.gpu_margin_gib
        if grown_bytes > 0:
            self._replan(memory)
            planned = self.plan().gpu_state_blocks
            wider = memory.gpu_margin_gib + _quarter_gib(grown_bytes)
            self._replan(dataclasses.replace(memory, gpu_margin_gib=wider, gpu_state_blocks="auto"))
            tier = min(planned, self.plan().gpu_state_blocks)
            memory = dataclasses.replace(memory, gpu_margin_gib=wider, gpu_state_blocks=tier)
        self._replan(memory)
        after = self.engine_plan()
        if after == before or after.gpu_state_blocks < before.gpu_state_blocks:
            self._replan(cfg.memory, cfg)
            return None
        new_plan = self.plan()
        return StepDown(
            before,
            after,
            (margin, memory.gpu_margin_gib),
            (old_plan.estimate.gpu.peak_bytes, new_plan.estimate.gpu.peak_bytes),
            (old_plan.estimate.time.step_s, new_plan.estimate.time.step_s),
        )

    def _replan(self, memory: Any, cfg: TrainConfig | None = None) -> None:
        self.cfg = dataclasses.replace(cfg or self.cfg, memory=memory)
        self.__dict__.pop("_own_plan", None)
