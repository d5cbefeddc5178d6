"""Resource estimate: host RAM, GPU peak and step time of a training setup, from the config.

spec = model_spec(hf_config, "bf16")            # meta-device model, counted once
hw = detect()  # or probe(), or Hardware(...)
est = estimate(spec, seq_len=2048, micro_batch_size=4, grad_accum=8, hardware=hw)
check_fits(est, hw, host_margin_gib=4, gpu_margin_gib=2)   # ValueError if not
b, ga, why = pick_micro_batch(spec, seq_len=2048, tokens_per_step=65536, hardware=hw)
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
