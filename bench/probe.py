"""(Copied from the team's shared/bench; baselines in docs/performance.md.)

Physical limits of a lent GPU host: PCIe, host memory, matmul, CPU AdamW.

Prints one JSON line per measurement, prefixed with 'RESULT '.
"""

import json
import os
import time

import torch
from common import timed_s


def out(name, **kv):
    print("RESULT " + json.dumps({"name": name, **kv}), flush=True)


def versions():
    import importlib

    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "nproc": os.cpu_count()}
    for m in [
        "transformers",
        "flash_attn",
        "deepspeed",
        "liger_kernel",
        "accelerate",
        "triton",
        "psutil",
    ]:
        try:
            v[m] = importlib.import_module(m).__version__
        except Exception as e:
            v[m] = f"missing ({type(e).__name__})"
    v["gpu"] = torch.cuda.get_device_name(0)
    v["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    with open("/proc/meminfo") as f:
        v["meminfo"] = f.readline().strip()
    out("versions", **v)


def pcie():
    n = 1 << 30
    h = torch.empty(n, dtype=torch.uint8).pin_memory()
    h2 = torch.empty(n, dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    d2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    t = timed_s(lambda: d.copy_(h, non_blocking=True))
    out("h2d_pinned", GBps=round(n / t / 1e9, 1))
    t = timed_s(lambda: h.copy_(d, non_blocking=True))
    out("d2h_pinned", GBps=round(n / t / 1e9, 1))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            d.copy_(h, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    t = timed_s(both)
    out("bidir_pinned", GBps_total=round(2 * n / t / 1e9, 1))
    hp = torch.empty(n, dtype=torch.uint8)
    hp.fill_(1)
    t0 = time.perf_counter()
    for _ in range(3):
        d.copy_(hp)
    torch.cuda.synchronize()
    out("h2d_pageable", GBps=round(3 * n / (time.perf_counter() - t0) / 1e9, 1))
    del h, h2, d, d2, hp


def matmul():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed_s(lambda: a @ b, iters=20, warmup=3)
    out("matmul_bf16_8192", TFLOPs=round(2 * 8192**3 / t / 1e12, 1))


def host_mem():
    n = 1 << 30  # 4 GiB of fp32
    a = torch.randn(n)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    t = (time.perf_counter() - t0) / 3
    out("host_copy_fp32", GBps_rw=round(2 * 4 * n / t / 1e9, 1), threads=torch.get_num_threads())
    t0 = time.perf_counter()
    c = a.to(torch.bfloat16)
    out("host_fp32_to_bf16", seconds_per_gparam=round((time.perf_counter() - t0) / (n / 1e9), 3))
    del a, b, c


def cpu_adam():
    n = 1 << 28  # 268M params
    for impl in ["fused", "foreach"]:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        kw = {"fused": True} if impl == "fused" else {"foreach": True}
        try:
            opt = torch.optim.AdamW([p], lr=1e-4, **kw)
            opt.step()
            t0 = time.perf_counter()
            for _ in range(3):
                opt.step()
            t = (time.perf_counter() - t0) / 3
            out(
                "cpu_adamw",
                impl=impl,
                Gparams_per_s=round(n / t / 1e9, 2),
                threads=torch.get_num_threads(),
            )
        except Exception as e:
            out("cpu_adamw", impl=impl, error=repr(e)[:300])
        del p


if __name__ == "__main__":
    for f in [versions, pcie, matmul, host_mem, cpu_adam]:
        try:
            f()
        except Exception as e:
            out(f.__name__, error=repr(e)[:500])
