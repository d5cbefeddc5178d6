"""The ranks a run is planned for, and the arithmetic of a sharded store (store/shard.py).

`Ranks(nproc_per_node, nnodes)`: one process per GPU, `nproc_per_node` of them on each of
`nnodes` hosts. What changes from one process (planning/estimate.py, planning/timing.py):

- host, per node: each rank keeps 1/world of every block (padded to whole int8 quantization
  blocks), so a node holds nproc_per_node shards plus nproc_per_node process baselines; while
  loading, the node's ranks take turns, so one whole fp32 model (4 B/param) exists at a time;
- GPU, per rank: as one process, plus the all-gathered embedding table (every rank gathers it
  for its rows) and the reduce-scatter's fp32 output shard; a GPU-tier block's fp32 states
  are the rank's shard, its weights whole (planning/estimate.py);
- step time, per rank: each block's weights are the rank's shard over PCIe, then an all-gather
  of the whole block; each gradient a reduce-scatter (on the compute stream), then the shard
  over PCIe; the CPU AdamW updates the shard at the node's rate shared by its ranks (the
  fp32 kernel is bound by the host's memory bandwidth, the compressed ones by the node's
  AdamW threads, which the ranks split: ranks on one node split the parameters and the rate,
  so the optimizer's seconds per step stay; across nodes they halve).

Collectives are timed as NCCL rings: an all-gather or reduce-scatter of a B-byte buffer moves
B x (W - 1) / W bytes through each rank's link at the bus bandwidth: NVLINK_GBPS inside a node,
INTERNODE_GBPS (one NIC per GPU) once the job spans nodes. Both are assumptions, not
measurements: bench/run.py's ranks_compare scenario measures the real step.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.store.states import QUANT_BLOCK

NVLINK_GBPS = 150.0
"""Assumed NCCL all-gather / reduce-scatter bus bandwidth between GPUs of one H100 node (GB/s;
NVLink 4 is 450 GB/s per direction, NCCL reaches less at 2-8 ranks and layer-sized buffers)."""
INTERNODE_GBPS = 25.0
"""Assumed bus bandwidth per GPU between nodes (GB/s): one 200 Gb/s NIC per GPU."""


NCCL_GPU_GIB = 1.5
"""GPU memory per rank that a job of several ranks needs beyond one process's margin: NCCL's
communicator buffers and streams live outside PyTorch's allocator. Measured (run 22, 2 x H100,
7B shape, GPU tier planned with the 2 GiB margin): rank 0's process used 1.54 GiB outside
PyTorch (CUDA context, cuBLAS, NCCL) and PyTorch held 0.86 GiB reserved but unallocated, so the
planned peak ran out of memory. The plan adds this to memory.gpu_margin_gib when the world has
more than one rank."""

NCCL_HOST_GIB = 0.45
"""Host memory per rank that a process under torchrun holds beyond one process's baseline (NCCL's
host-side buffers, the process group's threads). Measured (run 25, 4 x H100, 7B shape, every
block's states on the GPUs so the host held only the processes): 8.6 GiB for the node against
4 x 1.7 GiB of baseline, as the one-process runs beside them measured it; run 22's 2 ranks
showed the same once the probe's pinned block (since freed) is taken off."""


@dataclass(frozen=True)
class Ranks:
    nproc_per_node: int = 1
    nnodes: int = 1

    def __post_init__(self) -> None:
        for name, value in (("nproc_per_node", self.nproc_per_node), ("nnodes", self.nnodes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    def shard(self, numel: int) -> int:
        """Parameters of one rank's shard of a block of `numel` (store/shard.py shard_range)."""
        if self.world == 1:
            return numel
        return -(-numel // (self.world * QUANT_BLOCK)) * QUANT_BLOCK

    @property
    def host_extra_bytes(self) -> int:
        """Host bytes each rank holds beyond one process's baseline (NCCL_HOST_GIB)."""
        return int(NCCL_HOST_GIB * 2**30) if self.world > 1 else 0

    def gpu_margin_gib(self, configured: float) -> float:
        """memory.gpu_margin_gib, plus NCCL's share when there are several ranks."""
        return configured + (NCCL_GPU_GIB if self.world > 1 else 0.0)

    @property
    def bus_gbps(self) -> float:
        return NVLINK_GBPS if self.nnodes == 1 else INTERNODE_GBPS

    def collective_s(self, nbytes: float) -> float:
        """Seconds of one all-gather or reduce-scatter of a whole `nbytes` buffer (0 alone)."""
        w = self.world
        return nbytes * (w - 1) / w / (self.bus_gbps * 1e9)


ONE_PROCESS = Ranks()
