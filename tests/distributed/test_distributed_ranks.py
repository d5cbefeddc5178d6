"""Two ranks on the CPU (gloo, torchrun) against one process with the same global batch.

One 2-rank run of the demo (launched as users do: torchrun -m megatrain train) is compared
with a 1-process run whose gradient accumulation is twice as long, so both take the same
micro-batches in every step (data/ranks.py). Clipping is on (the gradient norm is ~3, clipped
to 0.5) and every rank accumulates over 2 micro-batches. Both are whole runs of num_epochs over
a shortened demo data set: an epoch of 5 micro-batches, which the job's 4 per step do not
divide, so the step count (3.75 -> 4) and with it the learning-rate schedule come from the same
rule on both sides (docs/multi_gpu.md, The batch).

Parity tolerance (fp32). The runs differ only in the order of fp32 sums: the gradient and
loss are summed over the step's A x W = 4 micro-batches in another order, and the two
processes may use different thread counts in their matrix products (torchrun sets one
thread), which reorders dot products of length K <= 384 (intermediate size). With unit
roundoff u = 2^-24, one dot product errs by at most K u relative, the 4 layers plus the head by
at most 5 K u (~1.1e-4): the loss tolerance. AdamW runs with eps = 1, where its update
m / (sqrt(v) + eps) is 1-Lipschitz in the gradient (no sign-like amplification of a
near-zero gradient), so a weight moves at most lr x 2 x |gradient error| per step; a clipped
gradient element is at most 0.5 in size: over S steps the weights agree to
S x lr x 2 x 0.5 x (5 K u + 4 u). A rank that skipped the reduction, read the wrong rows or
divided by its own token count would be off by ~lr x |g| ~ 1e-3, far outside.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.recipes.sft import Trainer
from run_helpers import assert_exports_close, free_port

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.yaml"
SAMPLES, EPOCHS = 64, 3  # 9 packed training rows: 5 micro-batches of 2 rows an epoch
STEPS = 4  # ceil(EPOCHS x 5 / 4 micro-batches a step); each rank's 2 of 5 would make it 3
LR, CLIP, K = 0.05, 0.5, 384
U = 2.0**-24
LOSS_RTOL = 5 * K * U
WEIGHT_ATOL = STEPS * LR * 2 * CLIP * (5 * K * U + 4 * U)
COMMON = [
    "--training.device", "cpu",
    "--data.max_samples", str(SAMPLES),
    "--training.num_epochs", str(EPOCHS),
    "--training.micro_batch_size", "2",
    "--optimizer.learning_rate", str(LR),
    "--optimizer.max_grad_norm", str(CLIP),
    "--optimizer.eps", "1.0",
    "--checkpoint.save_every", "2",
    "--checkpoint.keep_last", "2",
    "--logging.progress_bar", "false",
    "--logging.report_to", "none",
    "--logging.log_every", "1",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MEGATRAIN_COLLECTIVE_TIMEOUT_S="120")
    env.pop("WORLD_SIZE", None)
    return env


def megatrain_job(args: list[str], ranks: int, ok: bool = True) -> str:
    """`megatrain ARGS` as `ranks` processes: one runs in this one (the command's `main`,
    without a new interpreter's ~10 s of imports), more under torchrun (gloo on the CPU).
    Torchrun's output (stdout, then stderr); `ok` False: the job is expected to fail."""
    if ranks == 1:
        assert ok and main(args) == 0
        return ""
    run = _launch(args, ranks)
    assert (run.returncode == 0) == ok, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def _launch(args: list[str], ranks: int = 2) -> subprocess.CompletedProcess[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd = [*launch, "--standalone", "-m", "megatrain", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def _torchrun(out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    args = ["train", "--config", str(DEMO), "--training.output_dir", str(out), *COMMON]
    run = _launch([*args, *overrides])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _records(out: Path, kind: str) -> list[dict[str, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[float]]:
    """(2-rank output, 1-process output, 1-process losses)."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    run = _torchrun(two, "--training.gradient_accumulation_steps", "2")
    # progress and messages from rank 0 only
    assert run.stderr.count(f"step {STEPS}/{STEPS}") == 1 and run.stdout.count("done:") == 1
    cfg = load_config(
        DEMO,
        ["--training.output_dir", str(one), *COMMON, "--training.gradient_accumulation_steps", "4"],
    )
    trainer = Trainer(cfg)
    try:
        losses = trainer.train().losses
    finally:
        trainer.close()
    return two, one, losses


def test_two_ranks_match_one_process(runs: tuple[Path, Path, list[float]]) -> None:
    two, one, losses = runs
    train, alone = _records(two, "train"), _records(one, "train")
    assert [r["step"] for r in train] == [r["step"] for r in alone] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in train] == [r["lr"] for r in alone]  # one schedule
    assert [r["tokens"] for r in train] == [r["tokens"] for r in alone]  # the same rows
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in train], dtype=torch.float64),
        torch.tensor(losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0.0,
    )
    assert all(r["clip_coef"] < 1.0 for r in train)  # clipping was active
    # the job's tokens (both ranks'), the same as the 1-process run's; speed halved per GPU
    # (each figure rounded to 0.1: they agree to 0.05 / 2 + 0.05)
    assert [r["tokens"] for r in train] == [r["tokens"] for r in _records(one, "train")]
    for r in train:
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2, abs=0.075)
    (ev2,), (ev1,) = _records(two, "eval"), _records(one, "eval")
    assert ev2["eval_tokens"] == ev1["eval_tokens"]  # every eval row once, across the ranks
    torch.testing.assert_close(ev2["eval_loss"], ev1["eval_loss"], rtol=LOSS_RTOL, atol=0.0)
    assert_exports_close(one, two, WEIGHT_ATOL)


@pytest.fixture(scope="module")
def oom_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(output, stderr) of the 2-rank run planned with 2 GPU-tier blocks whose rank 1 fails in
    step 2 in a kernel launch out of memory twice, then in step 3 out of GPU memory
    (tests/distributed/oom_rank.py, PLANT=triton2+oom3): one launch serves both tests below."""
    out = tmp_path_factory.mktemp("oom")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        str(REPO / "tests" / "distributed" / "oom_rank.py"), "train", "--config", str(DEMO),
        "--training.output_dir", str(out), *COMMON,
        "--training.gradient_accumulation_steps", "2", "--memory.gpu_state_blocks", "2",
    ]  # fmt: skip
    env = dict(_env(), PLANT="triton2+oom3")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # rank 0 says it: step 2 and its rerun, step 3
    assert run.stderr.count("ran out of GPU memory and is run again") == 3
    return out, run.stderr


def _same_run(tmp_path: Path, planned: Path) -> None:
    """`tmp_path`'s run ended as `planned`'s: every step, the same losses and weights within
    the tier test's tolerances (step 1 ran the tier's AdamW, which differs from the host
    kernel in the last rounding of each weight)."""
    train, expected = _records(tmp_path, "train"), _records(planned, "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in train], dtype=torch.float64),
        torch.tensor([r["loss"] for r in expected], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0.0,
    )
    recovered = load_file(str(tmp_path / "hf_model" / "model.safetensors"))
    for name, ref in load_file(str(planned / "hf_model" / "model.safetensors")).items():
        torch.testing.assert_close(recovered[name], ref, rtol=0.0, atol=WEIGHT_ATOL)


def test_out_of_memory_on_one_rank_steps_every_rank_down(
    runs: tuple[Path, Path, list[float]], oom_run: tuple[Path, str]
) -> None:
    """Rank 1 runs out of GPU memory in step 3 (tests/distributed/oom_rank.py) of a run planned
    with 2 GPU-tier blocks (its tier back after step 2's kernel-launch failures: `oom_run`)
    while rank 0 waits for it in a reduce-scatter: both ranks abort the process group, undo the
    step, join a new group and step down to the CPU's "auto" plan (no tier) for good, and the
    run ends as the 2-rank run planned without a tier from the start (`runs`): the same losses
    and weights within the tier test's tolerances (step 1 ran the tier's AdamW, which differs
    from the host kernel in the last rounding of each weight)."""
    two, _, _ = runs
    out, _ = oom_run
    down = _records(out, "plan_step_down")
    assert [(d["step"], d["gpu_state_blocks"], d["transient"]) for d in down[1:]] == [
        (3, [2, 0], False)
    ]
    _same_run(out, two)


def test_kernel_launches_out_of_memory_on_one_rank_step_every_rank_down_for_one_step(
    runs: tuple[Path, Path, list[float]], oom_run: tuple[Path, str]
) -> None:
    """Rank 1's step 2 fails in a kernel launch outside PyTorch's allocator (Triton's out of
    memory), and again in its rerun: every rank undoes the step, joins a new group and runs it
    again on the same plan (`oom_retry`), then on a smaller plan for that step only (a
    transient `plan_step_down`), and after it every rank goes back up to the 2 tier blocks
    (`plan_step_up`, planned alike on each rank); the run ends as planned (step 3's
    out-of-memory error, the test above's, steps down again)."""
    two, _, _ = runs
    out, _ = oom_run
    (retry,) = _records(out, "oom_retry")
    down = _records(out, "plan_step_down")[0]
    (up,) = _records(out, "plan_step_up")
    assert retry["step"] == down["step"] == up["step"] == 2 and down["transient"]
    assert up["gpu_state_blocks"][1] == 2
    _same_run(out, two)


def test_an_error_on_one_rank_stops_the_other_without_waiting(tmp_path: Path) -> None:
    """Rank 1 stops with an error of its own in step 2 while rank 0 waits for it in a
    reduce-scatter: rank 0 learns it through the job's store and exits at once, quietly (no
    traceback from megatrain), long before the collective timeout (120 s here); rank 1's error
    reaches the user once, as its one line."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        str(REPO / "tests" / "distributed" / "oom_rank.py"), "train", "--config", str(DEMO),
        "--training.output_dir", str(tmp_path), *COMMON,
        "--training.gradient_accumulation_steps", "2",
    ]  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(
        cmd, env=dict(_env(), PLANT="error"), capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0
    assert time.monotonic() - started < 100  # the collective timeout alone is 120 s
    assert run.stderr.count("planted: a bad value on rank 1") == 1, run.stderr[-3000:]
    # torchrun prints its own launcher's traceback on any failure; none of megatrain's frames
    assert "src/megatrain/" not in run.stderr, run.stderr[-3000:]


def test_two_nodes_train_as_two_ranks_of_one(
    runs: tuple[Path, Path, list[float]], tmp_path: Path
) -> None:
    """The several-node launch of docs/multi_gpu.md (`--nnodes 2 --rdzv-backend c10d
    --rdzv-endpoint HOST:PORT`, the same command on every node), as two nodes of one rank each
    on this host: the same job as the 2-rank run, each node loading and accounting its own
    rank. Tolerances as the 2-rank run against one process (other thread counts: torchrun sets
    one thread per rank only with several ranks on a node)."""
    two, _, _ = runs
    out = tmp_path / "nodes"
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodes",
        "-m", "megatrain", "train", "--config", str(DEMO), "--training.output_dir", str(out),
        *COMMON, "--training.gradient_accumulation_steps", "2",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    done = [node.communicate(timeout=300) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, done, strict=True):
        assert node.returncode == 0, stdout[-3000:] + stderr[-3000:]
    stdout, stderr = ("".join(text[i] for text in done) for i in (0, 1))
    assert stdout.count("loading the model: 1 of each node's 1 ranks at once") == 1
    assert stderr.count(f"step {STEPS}/{STEPS}") == 1  # progress from rank 0 only
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in _records(out, "train")], dtype=torch.float64),
        torch.tensor([r["loss"] for r in _records(two, "train")], dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0.0,
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]
    w2 = load_file(str(two / "hf_model" / "model.safetensors"))
    wn = load_file(str(out / "hf_model" / "model.safetensors"))
    assert wn.keys() == w2.keys()
    for name, ref in w2.items():  # each against one process to WEIGHT_ATOL: twice that here
        torch.testing.assert_close(wn[name], ref, rtol=0.0, atol=2 * WEIGHT_ATOL)


def test_sharded_checkpoint_exports_the_run_weights(
    runs: tuple[Path, Path, list[float]], tmp_path: Path
) -> None:
    two, _, _ = runs
    ckpt = two / "checkpoints" / f"step-{STEPS:08d}"
    assert sorted(p.name for p in (ckpt / "blocks").glob("layer.0.*")) == [
        "layer.0.rank000-of-002.safetensors",
        "layer.0.rank001-of-002.safetensors",
    ]
    out = tmp_path / "hf"
    export = ["export", "--checkpoint", str(ckpt), "--out", str(out), "--dtype", "fp32"]
    cmd = [sys.executable, "-m", "megatrain", *export]
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    exported = load_file(str(out / "model.safetensors"))
    in_run = load_file(str(two / "hf_model" / "model.safetensors"))
    assert exported.keys() == in_run.keys()
    for name, ref in in_run.items():
        assert torch.equal(exported[name], ref), name  # the same fp32 masters, reassembled


def test_resume_under_two_ranks_is_loss_exact(
    runs: tuple[Path, Path, list[float]], tmp_path: Path
) -> None:
    two, _, _ = runs
    resumed = tmp_path / "resumed"
    ckpt = resumed / "checkpoints" / "step-00000002"
    shutil.copytree(two / "checkpoints" / "step-00000002", ckpt)  # as if killed after step 2
    # ... while saving step 3: rank 1's part written, nothing committed
    stale = resumed / "checkpoints" / ".step-00000003.tmp-ranks" / "blocks"
    stale.mkdir(parents=True)
    (stale / "layer.0.rank001-of-002.safetensors").write_bytes(b"partial")
    _torchrun(
        resumed, "--training.gradient_accumulation_steps", "2", "--checkpoint.resume_from", "auto"
    )
    first = {r["step"]: r["loss"] for r in _records(two, "train")}
    again = {r["step"]: r["loss"] for r in _records(resumed, "train")}
    assert sorted(again) == [3, 4]
    assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]  # bit for bit
    assert not stale.parent.exists()  # the next save cleared the uncommitted part
    assert (resumed / "checkpoints" / "step-00000004" / "trainer_state.json").is_file()


@pytest.mark.slow  # two torchrun launches, ~55 s on 2 cores; by default its parts run apart:
# a 2-rank resume's sharded checkpoint, test_resume_under_two_ranks_is_loss_exact; each rank's
# part of int8 / int4 states read back as written, tests/checkpoint/test_checkpointer.py; rank
# shards of them, tests/distributed/test_distributed_shard.py; their sharded update against the
# whole block's, test_distributed_shard_states.py; a one-process int8 resume,
# tests/optim/test_optim_states_training.py
@pytest.mark.parametrize("state_dtype", ["int8"])
def test_compressed_states_shard_and_resume_exactly(tmp_path: Path, state_dtype: str) -> None:
    """Each rank keeps its shard of m and v in the state dtype; resuming from a sharded
    checkpoint of them continues bit for bit."""
    dtype = ["--optimizer.state_dtype", state_dtype, "--checkpoint.save_every", "1"]
    steps = ["--training.max_steps", "2", "--training.gradient_accumulation_steps", "1"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    _torchrun(first, *dtype, *steps, "--checkpoint.export_hf", "false")
    step1 = first / "checkpoints" / "step-00000001"
    with safe_open(str(step1 / "blocks" / "layer.0.rank001-of-002.safetensors"), "pt") as f:
        assert f.metadata()["state_dtype"] == state_dtype
        assert f.get_tensor("exp_avg").dtype == torch.uint8
    shutil.copytree(step1, resumed / "checkpoints" / step1.name)
    _torchrun(resumed, *dtype, *steps, "--checkpoint.resume_from", "auto")
    again = {r["step"]: r["loss"] for r in _records(resumed, "train")}
    assert again == {2: _records(first, "train")[1]["loss"]}  # bit for bit


def test_resume_with_another_world_size_is_refused(
    runs: tuple[Path, Path, list[float]], tmp_path: Path
) -> None:
    two, _, _ = runs
    out = tmp_path / "one"
    shutil.copytree(two / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000002")
    cfg = load_config(
        DEMO, ["--training.output_dir", str(out), *COMMON, "--checkpoint.resume_from", "auto"]
    )
    with pytest.raises(ValueError, match=r"written by 2 rank\(s\) and this run has 1"):
        Trainer(cfg)


def test_a_setup_error_reaches_the_user_once(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("someone else's folder")  # a new run here is refused
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
        "-m", "megatrain", "train", "--config", str(DEMO),
        "--training.output_dir", str(tmp_path), *COMMON,
    ]  # fmt: skip
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.count("is not empty") == 1, run.stderr[-3000:]
