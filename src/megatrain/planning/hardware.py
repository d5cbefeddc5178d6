"""The machine the estimate is for: memory sizes and the rates of the engine's three resources
(GPU compute, the PCIe link, the CPU optimizer).

Defaults are the H100 test host of the peers' baseline runs (docs/performance.md) and the
engine's own H200 run (2026-11-26): 789 TFLOP/s bf16 matmul of which the engine achieves about
half at 4k-32k tokens per step, 43-55 GB/s pinned copies each way, the C AdamW kernel (fp32
states) at 5.2 Gparams/s inside `megatrain train` runs on the 16-vCPU, 125 GiB H100 host
(docs/performance.md run 41, 2026-11-27: the host blocks' parameters over the step's AdamW busy
time, 4.9-5.4 in four rows, 5.25 pooled; run 17's micro-benchmark of the kernel gave 5.18
alone, 3.93 beside a synthetic busy thread, which the runs' main thread does not slow as much),
and about 1.7 GiB of process RSS that is not the store (python, torch, CUDA context and
libraries; 46.2 GiB RSS of that run minus the store with its pinned blocks rounded up).
`detect()` replaces the memory sizes with this machine's, and the CPU AdamW threads with the
count `megatrain train` gives the kernel here (threads.optimizer_threads: the cores of the
process's CPU affinity, i.e. vCPUs, less busy ones and the two that drive the GPU; not
`torch.get_num_threads()`, which counts physical cores where the CPU reports two threads a
core); `probe()` also measures the rates (a few seconds), the AdamW on those threads. A GPU
run plans with RATES measured so (memory.probe_rates, recipes/builder.py), as `megatrain
estimate --probe` does.
`measured` names the fields that came from this machine or from the user (`--gpu-gib`,
optimizer.threads); everything else is assumed. The default rate is the fp32 kernel's, which
is bound by memory bandwidth and taken as flat across hosts; the compressed (bf16, int8, int4)
kernels' rate is derived from it and grows with `optimizer_threads` (planning/timing.py
`state_dtype_speed`, fitted to runs on 14, 30 and 62 threads) unless probed with the run's
own state dtype. Two other defaults are fitted, not measured: `achieved_fraction_fp32` and
`op_launch_s` (tests/planning/test_resources.py holds the runs they were fitted to and the
held-out runs that check them).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from megatrain.threads import optimizer_threads as default_optimizer_threads

GIB = 1 << 30


def gib(nbytes: float) -> str:
    """Bytes as GiB text for messages: 21.3 GiB, 0.27 GiB."""
    value = nbytes / GIB
    return f"{value:.1f} GiB" if abs(value) >= 1 else f"{value:.2f} GiB"


@dataclass(frozen=True)
class Hardware:
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    gpu_bytes: int = 80 * GIB  # what torch.cuda reports as total memory
    host_bytes: int = 128 * GIB  # physical RAM
    h2d_gbps: float = 50.0  # pinned host -> device, GB/s (1e9 bytes)
    d2h_gbps: float = 50.0  # pinned device -> host
    gpu_tflops_bf16: float = 789.0  # dense bf16 matmul peak, as measured (8192^3)
    gpu_hbm_gbps: float = 3350.0  # GB/s, H100 SXM datasheet (detect: HBM_GBPS)
    gpu_tflops_fp32: float = 51.0  # dense fp32 matmul (no TF32), 4096^3 on the H200 host
    achieved_fraction: float = 0.5  # bf16: engine FLOPs / matmul peak (H200 run: 400 of 790)
    achieved_fraction_fp32: float = 0.75  # fitted to one H200 fp32 run (160M llama)
    # C AdamW kernel, fp32 states, inside runs on the H100 host (run 41: 4.9-5.4 Gparams/s)
    optimizer_gparams_s: float = 5.2
    optimizer_state_dtype: str = "fp32"  # the state dtype whose kernel that rate is of
    # OpenMP threads of the node's CPU AdamW (threads.optimizer_threads: the usable cores less
    # two); 14 on the 16-vCPU H100 host. The compressed kernels' rate follows it (timing.py)
    optimizer_threads: int = 14
    process_baseline_bytes: int = int(1.7 * GIB)  # RSS of the process besides the store
    op_launch_s: float = 1.5e-5  # host time per aten op of HF layer code (fitted: H200 MoE run)
    measured: tuple[str, ...] = field(default=())

    def flops_per_s(self, compute_dtype: torch.dtype, hidden_size: int = 2048) -> float:
        """What the engine achieves: matmul peak of the compute dtype x achieved fraction.

        In bf16 the fraction grows with the model's width (larger matmuls, relatively less
        elementwise work): `achieved_fraction` holds at hidden 2048 and scales as
        (hidden / 2048) ** 0.47, capped at 0.70 -- fitted to two H200 runs, 0.51 at 2048
        (Qwen2.5-3B) and 0.66 at 3584 (Qwen2.5-7B), eager layers.
        """
        if compute_dtype == torch.bfloat16:
            fraction = min(0.70, self.achieved_fraction * (hidden_size / 2048) ** 0.47)
            return self.gpu_tflops_bf16 * 1e12 * fraction
        return self.gpu_tflops_fp32 * 1e12 * self.achieved_fraction_fp32

    def source(self, name: str) -> str:
        return "measured" if name in self.measured else "assumed"

    def with_overrides(
        self,
        *,
        gpu_gib: float | None = None,
        host_gib: float | None = None,
        optimizer_threads: int | None = None,
    ) -> Hardware:
        """Memory sizes given by the user (e.g. MemTotal reads low right after boot), and the
        CPU AdamW threads (optimizer.threads)."""
        hw, measured = self, set(self.measured)
        if optimizer_threads is not None:
            hw = dataclasses.replace(hw, optimizer_threads=optimizer_threads)
            measured.add("optimizer_threads")
        if gpu_gib is not None:
            hw = dataclasses.replace(hw, gpu_bytes=int(gpu_gib * GIB))
            measured.add("gpu_bytes")
        if host_gib is not None:
            hw = dataclasses.replace(hw, host_bytes=int(host_gib * GIB))
            measured.add("host_bytes")
        return dataclasses.replace(hw, measured=tuple(sorted(measured)))


HBM_GBPS = (
    ("GH200", 4000.0),  # before H200: its name contains it
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("B200", 8000.0),
    ("B100", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
)
"""GPU memory bandwidth (GB/s, datasheets) by a part of the name CUDA reports, first match; a
GPU not listed keeps Hardware.gpu_hbm_gbps (the H100 SXM's)."""


def hbm_gbps(gpu_name: str) -> float | None:
    """The datasheet memory bandwidth of the GPU named `gpu_name` (HBM_GBPS), None if unknown."""
    return next((gbps for part, gbps in HBM_GBPS if part in gpu_name), None)


def detect(*, gpu_gib: float | None = None, host_gib: float | None = None) -> Hardware:
    """Defaults, with this machine's GPU memory (if CUDA is present), RAM and CPU AdamW threads
    (what `megatrain train` gives the kernel alone on the node), then overrides."""
    hw = Hardware(
        host_bytes=psutil.virtual_memory().total,
        optimizer_threads=default_optimizer_threads(1),
        measured=("host_bytes", "optimizer_threads"),
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        hw = dataclasses.replace(
            hw,
            gpu_name=props.name,
            gpu_bytes=props.total_memory,
            gpu_hbm_gbps=hbm_gbps(props.name) or hw.gpu_hbm_gbps,
            measured=(*hw.measured, "gpu_bytes", "gpu_name"),
        )
    return hw.with_overrides(gpu_gib=gpu_gib, host_gib=host_gib)


RATES = ("h2d_gbps", "d2h_gbps", "optimizer_gparams_s")
"""What `megatrain train` measures before it plans (memory.probe_rates): the rates that differ
between machines of one kind and decide the GPU tier, the update share and its staging sets.
Three machines of the 1-GPU H100 kind ran the int8 CPU AdamW at 2.62, 3.72 and 4.78 Gparams/s
(docs/performance.md runs 79-81), where the plan assumes 3.12. The matmul peak stays assumed:
the engine's achieved fractions (`achieved_fraction`) are fitted against it."""


def probe(
    *,
    optimizer_params: int = 200_000_000,
    optimizer_threads: int | None = None,
    state_dtype: str = "fp32",
    impl: str = "auto",
    matmul: bool = True,
    gpu_gib: float | None = None,
    host_gib: float | None = None,
) -> Hardware:
    """`detect()` plus measured rates: the engine's CPU AdamW (`impl`, optimizer.impl) over
    ~`optimizer_params` params in 25M blocks with a busy Python thread beside it, with the run's
    `state_dtype` (the compressed kernels are compute-bound where fp32 is bandwidth-bound, so
    their ratio to fp32 depends on the host: int8 0.60x fp32 on a 16-vCPU H100 host, more with
    more cores) and on `optimizer_threads` threads (None: the run's default, detect()'s count,
    not torch's intra-op default, which is the physical cores where the CPU reports two threads
    a core); on CUDA also pinned 1 GiB copies each way and, with `matmul`, an 8192^3 bf16 and a
    4096^3 fp32 matmul (`megatrain train` leaves them out: RATES). The process baseline stays
    the calibrated default: right after CUDA start-up a process holds 0.7 GiB (H200 host), a
    training process 1.7 GiB beside its store (kernels and modules loaded on first use)."""
    hw = detect()
    threads = optimizer_threads or hw.optimizer_threads
    values: dict[str, float | int] = {"optimizer_threads": threads}
    if torch.cuda.is_available():
        values.update(_probe_gpu() if matmul else _copy_gbps())
    values["optimizer_gparams_s"] = _probe_optimizer(
        optimizer_params, threads, hw.host_bytes, state_dtype, impl
    )
    measured = tuple(sorted({*hw.measured, *values}))
    hw = dataclasses.replace(
        hw,
        **values,  # type: ignore[arg-type]
        optimizer_state_dtype=state_dtype,
        measured=measured,
    )
    return hw.with_overrides(gpu_gib=gpu_gib, host_gib=host_gib)


def _cuda_seconds(fn: Callable[[], object], iters: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # sync point: warm-up done
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()  # sync point: timing done
    return start.elapsed_time(end) / 1e3 / iters


def _probe_gpu() -> dict[str, float | int]:
    return {
        "gpu_tflops_bf16": _matmul_tflops(8192, torch.bfloat16, iters=10),
        "gpu_tflops_fp32": _matmul_tflops(4096, torch.float32, iters=5),
        **_copy_gbps(),
    }


def _matmul_tflops(n: int, dtype: torch.dtype, iters: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2 * n**3 / _cuda_seconds(lambda: a @ a, iters) / 1e12


def _copy_gbps() -> dict[str, float | int]:
    """Pinned 1 GiB copies each way; the pinned block is handed back to the OS afterwards."""
    rates = _pinned_copies()
    _empty_host_cache()
    return rates


def _pinned_copies() -> dict[str, float | int]:
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    h2d = GIB / _cuda_seconds(lambda: dev.copy_(host, non_blocking=True), 5) / 1e9
    d2h = GIB / _cuda_seconds(lambda: host.copy_(dev, non_blocking=True), 5) / 1e9
    return {"h2d_gbps": h2d, "d2h_gbps": d2h}


def _empty_host_cache() -> None:
    """Free the pinned blocks PyTorch's host allocator keeps cached. Kept, the probe's 1 GiB
    block stayed in the run's RSS: 1.2 GiB above the estimate per process in docs/performance.md
    run 22, where every run probed first. torch names the call differently across versions."""
    torch.cuda.synchronize()
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def _probe_optimizer(
    params: int, threads: int, host_bytes: int, state_dtype: str, impl: str = "auto"
) -> float:
    """Gparams/s of the engine's CpuAdamW on bf16-shadow blocks with `state_dtype` states, a
    busy thread beside it."""
    from megatrain.optim.adamw import AdamWHyper, CpuAdamW
    from megatrain.store.blocks import ParamBlock

    block_numel = 25_000_000
    params = max(block_numel, min(params, host_bytes // 20 // 16))  # <= 5% of RAM
    blocks = []
    for i in range(max(1, params // block_numel)):
        n = min(block_numel, params)
        blocks.append(
            ParamBlock.with_states(
                name=f"probe.{i}",
                entries=[],
                numel=n,
                decay_numel=n,
                master=torch.full((n,), 0.02),
                state_dtype=state_dtype,
                shadow=torch.full((n,), 1e-3, dtype=torch.bfloat16),
            )
        )
    opt = CpuAdamW(AdamWHyper(weight_decay=0.1), impl=impl, num_threads=threads)
    stop = threading.Event()

    def busy() -> None:
        # The main thread's pattern: Python bursts (kernel launches) holding the GIL, then
        # waits that release it. A thread spinning on the GIL instead halves the measured rate
        # (1.3 vs 3.0 Gparams/s on the H200 host, where the engine's updates ran at 2.85).
        x = 0
        while not stop.is_set():
            for _ in range(2000):
                x += 1
            time.sleep(1e-3)

    for block in blocks:  # warm-up: kernel build, first touch of the zeroed states
        opt.update(block, lr=1e-4)
    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    try:
        t0 = time.perf_counter()
        for _ in range(3):
            for block in blocks:
                opt.update(block, lr=1e-4)
        seconds = time.perf_counter() - t0
    finally:
        stop.set()
        spinner.join()
    return 3 * sum(b.numel for b in blocks) / seconds / 1e9
