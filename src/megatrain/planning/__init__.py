"""The planner: from a model's config and the hardware, what a training run needs, before it runs.

The resource estimate (host RAM, GPU peak, step time) and its table, the micro-batch choice and
the fit check, exported here; plan.py joins them into one resource plan and builder.py
(PlanBuilder) builds that plan from a TrainConfig. Beside them: disk.py (bytes a run writes),
ranks.py (a torchrun job's per-node and per-rank arithmetic), long_context.py (where layer inputs
wait, MLP tiles), rollout.py (GRPO's rollout phase).

    spec = model_spec(hf_config, "bf16")            # meta-device model, counted once
    hw = detect()  # or probe(), or Hardware(...)
    plan = EnginePlan(num_slots=2, clip_norm=1.0, loss_chunk_tokens=4096)   # engine/plan.py
    setup = Setup(plan, seq_len=2048, micro_batch_size=4, grad_accum=8)    # setup.py
    est = estimate(spec, setup, hw)
    check_fits(est, hw, host_margin_gib=4, gpu_margin_gib=2)   # ValueError if not
    print(format_estimate(est))                     # the table `megatrain estimate` prints
    b, ga, why = pick_micro_batch(spec, setup, tokens_per_step=65536, hardware=hw,
                                  gpu_margin_gib=2)

A run's own plan (every "auto" setting resolved from the config) comes from builder.py:
`PlanBuilder(cfg, placement=...).plan()` (a ResourcePlan; `.engine` is its EnginePlan).

`hf_config` is a transformers PretrainedConfig (AutoConfig, or model/tiny.py's tiny_config).
"""

from megatrain.planning.batch_size import pick_micro_batch
from megatrain.planning.estimate import (
    Estimate,
    GpuMemory,
    HostMemory,
    estimate,
    model_spec,
)
from megatrain.planning.fit import check_fits, gpu_problem, host_problem
from megatrain.planning.hardware import Hardware, detect, probe
from megatrain.planning.report import format_estimate
from megatrain.planning.spec import ModelSpec, build_spec
from megatrain.planning.timing import StepTime

__all__ = [
    "Estimate",
    "GpuMemory",
    "Hardware",
    "HostMemory",
    "ModelSpec",
    "StepTime",
    "build_spec",
    "check_fits",
    "detect",
    "estimate",
    "format_estimate",
    "gpu_problem",
    "host_problem",
    "model_spec",
    "pick_micro_batch",
    "probe",
]
