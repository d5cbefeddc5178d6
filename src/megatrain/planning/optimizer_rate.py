"""The host's CPU AdamW rate per state format: each kernel's speed against the fp32 kernel's,
measured per host and thread count, and the node's rate for a run's states (what the step-time
model, the report and `megatrain estimate` take for the CPU update)."""

from __future__ import annotations

from megatrain.planning.hardware import Hardware

INT4_VS_INT8_CPU = 1.15
"""The int4 kernel's rate against the int8 kernel's on one CPU, a measurement of the 2-core
development VM (AMD EPYC, AVX-512; docs/performance.md, "int4 kernel"), not of a GPU host: 0.442
against 0.383 Gparams per CPU-second on 1 thread and 0.446 against 0.389 on 2 (bench/adamw.py,
2026-11-27, CPU time because the machine was shared). Both kernels do the same fp32 AdamW and
are compute-bound; int4 moves fewer bytes (1.06 instead of 2.00 of states per parameter) and
quantizes without table gathers."""
STATE_DTYPE_SPEED = {"fp32": 1.0, "bf16": 1.06, "int8": 0.60, "int4": 0.60 * INT4_VS_INT8_CPU}
"""CPU AdamW rate per state dtype relative to fp32 on the 16-vCPU H100 host (AdamW on
SPEED_REFERENCE_THREADS threads), used only where the hardware's rate is of another kernel (the
default, or a probe of fp32): `probe(state_dtype=...)` measures the run's own kernel, and then
its rate is taken as it is. bf16: the C kernels with a busy main thread beside them on that host
(docs/performance.md run 10: 4.10 vs 3.85 Gparams/s). int8: the in-run rates of the vectorised
kernel (run 46's; csrc/adamw.c `quantize`) there, run 47: 2.97 Gparams/s (GPT-OSS-20B cut to
17 layers, 15.15B) and 3.33 (Qwen3-Next cut to 8 layers, 13.80B), 0.57 and 0.64 of the default
fp32 rate (5.2, run 41); 0.60 gives 3.12. The kernel before it ran 0.45 (2.34). Elsewhere the
ratio follows the host's threads: STATE_DTYPE_THREADS_EXPONENT. int4: int8's times
INT4_VS_INT8_CPU, until an int4 run on a GPU host measures it."""
STATE_DTYPE_THREADS_EXPONENT = {"fp32": 0.0, "bf16": 0.38, "int8": 0.67, "int4": 0.67}
"""How a kernel's rate grows with the AdamW threads (`Hardware.optimizer_threads`): as
(threads / SPEED_REFERENCE_THREADS) ** exponent. fp32 reads and writes 28 B/param and is bound
by memory bandwidth, not cores: flat (the default 5.2 on every host; the 64-vCPU host of run 19
probed 5.41 on 62 threads, though the 32-vCPU host ran 6.0-6.9 on 30 in runs 14 and 30, a
faster memory system the thread count does not predict). The compressed kernels move 16-20
B/param and spend the rest dequantising and rounding, so cores help them. Fitted to their
in-run rates (CPU AdamW busy time over the host blocks' parameters):
- int8, least squares in log space, with 0.45 x 5.2 held at 14 threads, over three runs of the
  kernel before run 46's: 30 threads (32-vCPU host, run 43) 3.43 (Qwen3.5-27B, 26.9B; 3.90
  predicted then, +14%) and 4.29 Gparams/s (Qwen3-Next cut to 19 layers, 31.9B; -9%), 62
  threads (64-vCPU host, run 19, 56.9B) 6.5 (6.34, -2%). Kept for the vectorised kernel, whose
  one run on another host agrees: 5.29 Gparams/s on 30 threads (run 48, GPT-OSS-20B, 20.9B)
  against 5.20 from 0.60. The former kernel's rates x 1.46 (the two kernels on one host with a
  busy main thread, run 46) are 5.0, 6.3 and 9.5 against 5.20, 5.20 and 8.45;
- bf16, one run: 30 threads (run 43, GPT-OSS-20B) 7.39 Gparams/s (7.36 predicted). Part of
  it is that host's faster memory (its fp32 ran 1.2-1.3x the 16-vCPU host's), so beyond 30
  threads it is an extrapolation (62 threads: 9.7);
- int4: int8's, assumed (no run yet): a compute-bound kernel of the same arithmetic, whose
  rate per thread stayed the same from 1 to 2 threads on the development VM, as int8's did."""
SPEED_REFERENCE_THREADS = Hardware().optimizer_threads
"""AdamW threads of the host STATE_DTYPE_SPEED was measured on, the default hardware's (16
vCPUs less the two that drive the GPU: threads.optimizer_threads)."""


def state_dtype_speed(state_dtype: str, threads: int) -> float:
    """CPU AdamW rate of `state_dtype`'s kernel on `threads` threads against the fp32 kernel's
    (flat across hosts): STATE_DTYPE_SPEED scaled by STATE_DTYPE_THREADS_EXPONENT."""
    scale = (threads / SPEED_REFERENCE_THREADS) ** STATE_DTYPE_THREADS_EXPONENT[state_dtype]
    return STATE_DTYPE_SPEED[state_dtype] * scale


def optimizer_gparams_s(hw: Hardware, state_dtype: str) -> float:
    """The node's CPU AdamW rate with `state_dtype` states: the hardware's rate when it is that
    kernel's (the default fp32 one, or a probe of the run's own dtype, on the run's threads),
    else that rate scaled by the two kernels' speeds on `hw.optimizer_threads` threads."""
    if state_dtype == hw.optimizer_state_dtype:
        return hw.optimizer_gparams_s
    threads = hw.optimizer_threads
    ratio = state_dtype_speed(state_dtype, threads) / state_dtype_speed(
        hw.optimizer_state_dtype, threads
    )
    return hw.optimizer_gparams_s * ratio
