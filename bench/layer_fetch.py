"""How a streamed layer should reach N GPUs of one node: all-gather or a PCIe pull per rank.

    python -m torch.distributed.run --standalone --nproc-per-node 4 bench/layer_fetch.py

Issue 10's open question. One layer's bf16 weights (Qwen2.5-7B shape by default: 233M
parameters, 466 MB) reach every GPU of the node in two ways, every rank at once:

- gather: each rank copies its 1/N part from pinned host memory into its place in the
  layer's GPU buffer, then NCCL's all-gather assembles the whole layer on every GPU (what the
  engine does under ranks: each PCIe link carries 1/N of the layer, NVLink the rest);
- pull: each rank copies the whole layer from its own pinned host buffer (each PCIe link
  carries the whole layer; no collective).

Prints per way the median time per layer over the ranks' slowest (each timed iteration starts
after a barrier and ends when the last rank is done) and the layer bytes per second each GPU
received, then one RESULT line. Run with one rank it times one GPU's pull alone (the PCIe
link with no other rank beside it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from common import result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=233.0, help="layer parameters, millions")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    torchrun = "LOCAL_RANK" in os.environ
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    if torchrun:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size() if torchrun else 1
    numel = int(a.params_m * 1e6) // (world * 128) * world * 128  # a multiple of world
    part = numel // world
    layer = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    host_part = torch.randn(part).to(torch.bfloat16).pin_memory()
    host_whole = torch.randn(numel).to(torch.bfloat16).pin_memory()

    def gather() -> None:
        layer[rank * part : (rank + 1) * part].copy_(host_part, non_blocking=True)
        if world > 1:
            dist.all_gather_into_tensor(layer, layer[rank * part : (rank + 1) * part])

    def pull() -> None:
        layer.copy_(host_whole, non_blocking=True)

    report: dict[str, float] = {}
    for name, fn in (("gather", gather), ("pull", pull)):
        times = []
        for i in range(a.iters + 3):
            if world > 1:
                dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()  # sync point: this rank's copy (and collective) done
            took = torch.tensor([time.perf_counter() - t], device="cuda")
            if world > 1:
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank
            if i >= 3:  # warm-up: NCCL's first collectives set up their channels
                times.append(float(took))
        s = statistics.median(times)
        report[f"{name}_ms"] = round(s * 1e3, 2)
        report[f"{name}_gbps"] = round(numel * 2 / s / 1e9, 1)  # layer bytes into each GPU
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"{world} x {name}, layer {numel * 2 / 1e6:.0f} MB bf16")
        for way in ("gather", "pull"):
            ms, gbps = report[f"{way}_ms"], report[f"{way}_gbps"]
            print(f"| {way} | {ms} ms per layer | {gbps} GB/s into each GPU |")
        result(bench="layer_fetch", gpus=world, layer_mb=round(numel * 2 / 1e6), **report)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
