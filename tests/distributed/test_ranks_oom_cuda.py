"""Two ranks on two GPUs (NCCL; skipped with fewer): rank 1 runs out of memory in step 2
(tests/distributed/oom_rank.py plants the error) while rank 0 waits for it inside an NCCL
reduce-scatter. Both ranks abort the NCCL communicator, join a new process group, step down
together, and the run ends as a 2-rank run planned with the smaller tier from the start.

fp32 compute and torch's AdamW on host and device: the runs differ only in where step 1's
update of one block ran (the GPU's fused AdamW or the CPU's), each exact to fp32 rounding, so
after 4 steps the losses agree far inside 1e-5 relative (tests/engine/test_oom_cuda.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed.test_distributed_ranks import COMMON, DEMO, REPO, STEPS, _env, _records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]
CUDA = [
    *("--training.device", "cuda", "--model.compute_dtype", "fp32"),
    *("--optimizer.impl", "torch", "--training.compile_layers", "false"),
    *("--training.gradient_accumulation_steps", "2"),
]


def _torchrun(entry: list[str], out: Path, tier: int) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        *entry, "train", "--config", str(DEMO), "--training.output_dir", str(out), *COMMON,
        *CUDA, "--memory.gpu_state_blocks", str(tier),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_nccl_ranks_step_down_together(tmp_path: Path) -> None:
    entry = [str(REPO / "tests" / "distributed" / "oom_rank.py")]
    _torchrun(entry, tmp_path / "recovered", 2)
    (down,) = _records(tmp_path / "recovered", "plan_step_down")
    before, after = down["gpu_state_blocks"]
    assert down["step"] == 2 and before == 2 and after < 2
    _torchrun(["-m", "megatrain"], tmp_path / "planned", after)
    losses = [r["loss"] for r in _records(tmp_path / "recovered", "train")]
    expected = [r["loss"] for r in _records(tmp_path / "planned", "train")]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5)
