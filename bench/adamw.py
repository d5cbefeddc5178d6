"""CPU AdamW throughput on the host: our fused C kernel vs torch's fused AdamW, and bandwidth.

    python bench/adamw.py --params 1e9 --threads 16,12,8

For P parameters in blocks like the engine's (fp32 master/m/v, bf16 grad-in-shadow), reports
Gparams/s and the host memory bandwidth it implies (28 bytes per parameter: read p, m, v, g;
write p, m, v, shadow), alone and with a busy Python thread beside it (the engine's main thread
drives the GPU while the optimizer runs). Also a plain read+write bandwidth of the machine
(torch copy, all threads) as the ceiling. `--master-dtypes fp32,bf16` also times bf16 master
weights (optimizer.master_dtype: bf16: the master is the streamed copy, the gradient a bf16
buffer of its own, no shadow; 22 bytes per parameter with fp32 states).
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time

import torch
from common import result

from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import num_grad_blocks, quantize_gradient_
from megatrain.store.memory import host_zeros
from megatrain.store.states import allocate_states


def make_blocks(
    total: int,
    block: int,
    huge: bool,
    state_dtype: str = "fp32",
    master_dtype: str = "fp32",
    grad_dtype: str = "bf16",
) -> list[ParamBlock]:
    def zeros(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return host_zeros(n, dtype) if huge else torch.zeros(n, dtype=dtype)

    blocks = []
    for i in range(0, total, block):
        n = min(block, total - i)
        master = zeros(n)
        master.normal_(0, 0.02)
        b = ParamBlock(
            name=f"b{i}",
            entries=[],
            numel=n,
            decay_numel=n,
            master=master,
            **(
                {"exp_avg": zeros(n), "exp_avg_sq": zeros(n)}
                if state_dtype == "fp32"
                else allocate_states(n, state_dtype)
            ),
            state_dtype=state_dtype,
        )
        if master_dtype == "bf16":  # the master is the streamed copy; a gradient of its own
            b.master = zeros(n, torch.bfloat16)
            b.master.copy_(master)
            b.grad = torch.randn(n).to(torch.bfloat16)
            if grad_dtype == "int8":  # held as int8 codes and units (store/grads.py)
                g = b.grad.float()
                b.grad = zeros(n, torch.int8)
                b.grad_unit = zeros(num_grad_blocks(n))
                quantize_gradient_(g, b.grad, b.grad_unit, key=i)
        else:
            b.shadow = torch.randn(n).to(torch.bfloat16)
        blocks.append(b)
    return blocks


def timed(fn, reps: int) -> float:
    return timed_cpu(fn, reps)[0]


def timed_cpu(fn, reps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) per call. On a shared machine the CPU
    seconds are the steadier measure of a kernel's work: wall time also counts the time its
    threads wait for a core."""
    fn()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps, (time.process_time() - c) / reps


class Busy:
    """A Python thread spinning like the engine's main thread does while it drives the GPU."""

    def __enter__(self) -> None:
        self.stop = False

        def spin() -> None:
            x = 0
            while not self.stop:
                x += 1

        self.thread = threading.Thread(target=spin, daemon=True)
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()


DROPPED_FLAG = [""]  # the compiler flag this run's C kernel was built without (--drop-flag)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--block", type=float, default=80e6)
    ap.add_argument("--threads", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--huge",
        choices=["both", "yes", "no"],
        default="both",
        help="store buffers on madvise'd huge pages (megatrain's default), or not",
    )
    ap.add_argument(
        "--state-dtypes",
        default="fp32",
        help="optimizer.state_dtype layouts to time (fp32,bf16,int8,int4); compressed: C kernel "
        "only",
    )
    ap.add_argument(
        "--master-dtypes",
        default="fp32",
        help="optimizer.master_dtype layouts to time (fp32,bf16); bf16: C kernel only",
    )
    ap.add_argument(
        "--grad-dtypes",
        default="bf16",
        help="a bf16 master's held gradients to time (bf16,int8: optimizer.grad_dtype)",
    )
    ap.add_argument(
        "--drop-flag",
        default="",
        help="build the C kernel without this compiler flag (an A/B of one flag, e.g. "
        "-fno-math-errno; the kernel cache key includes the flags, so both builds coexist)",
    )
    a = ap.parse_args()
    if a.drop_flag:
        from megatrain import native

        native._FLAGS.remove(a.drop_flag)
        DROPPED_FLAG[0] = a.drop_flag
    total, block = int(a.params), int(a.block)
    src, dst = torch.empty(total // 2), torch.empty(total // 2)
    copy_s = timed(lambda: dst.copy_(src), a.reps)
    result(
        bench="host_copy",
        gbps=round(2 * src.numel() * 4 / copy_s / 1e9, 1),
        threads=torch.get_num_threads(),
    )
    counts = [int(t) for t in a.threads.split(",") if t] or [torch.get_num_threads()]
    for master_dtype in a.master_dtypes.split(","):
        grads = a.grad_dtypes.split(",") if master_dtype == "bf16" else ["bf16"]
        for state_dtype, grad_dtype in itertools.product(a.state_dtypes.split(","), grads):
            for huge in {"both": [True, False], "yes": [True], "no": [False]}[a.huge]:
                blocks = make_blocks(total, block, huge, state_dtype, master_dtype, grad_dtype)
                run_all(blocks, counts, a.reps, huge, state_dtype, master_dtype, grad_dtype)


def run_all(
    blocks: list[ParamBlock],
    counts: list[int],
    reps: int,
    huge: bool,
    state_dtype: str,
    master_dtype: str = "fp32",
    grad_dtype: str = "bf16",
) -> None:
    total = sum(b.numel for b in blocks)
    # the torch path of compressed states / a bf16 master is a bit-exact test reference,
    # ~1000x slower
    exact = state_dtype == "fp32" and master_dtype == "fp32"
    for impl in ("c", "torch") if exact else ("c",):
        for threads in counts if impl == "c" else [torch.get_num_threads()]:
            opt = CpuAdamW(AdamWHyper(weight_decay=0.01), impl=impl, num_threads=threads)
            for busy in (False, True):

                def run(opt: CpuAdamW = opt) -> None:
                    for b in blocks:
                        opt.update(b, lr=1e-5)

                if busy:
                    with Busy():
                        s, cpu_s = timed_cpu(run, reps)
                else:
                    s, cpu_s = timed_cpu(run, reps)
                result(
                    bench="adamw",
                    impl=impl,
                    state_dtype=state_dtype,
                    master_dtype=master_dtype,
                    grad_dtype=grad_dtype,
                    threads=threads,
                    busy_main_thread=busy,
                    dropped_flag=DROPPED_FLAG[0] if impl == "c" else "",
                    huge_pages=huge,
                    params=total,
                    seconds=round(s, 3),
                    gparams_per_s=round(total / s / 1e9, 2),
                    # per CPU-second of all threads (the busy thread's included when busy)
                    gparams_per_cpu_s=round(total / cpu_s / 1e9, 3),
                    gbps_at_28b=round(28 * total / s / 1e9, 1),
                )


if __name__ == "__main__":
    main()
