"""`megatrain grpo` on two ranks on the CPU (gloo, torchrun) against one process, same config.

The tiny model and reward of tests/recipes/grpo (test_grpo_command.py's TINY and reward file),
4 prompts x 3 completions per generation batch, 2 generation batches (2 optimizer steps of
one iteration each): each rank samples 2 prompts' groups and trains their 6 sequences in 2
micro-batches of 4 rows (the one process: 12 sequences, 3 micro-batches, grouped by length
across every prompt). Both run through grpo_groups.py, which samples each prompt group on its
own (seeded by its prompt): sampling a whole batch draws from one random stream and pads to the
batch's longest prompt, so the completions of a batch split over ranks would differ from one
process's by construction; sampled per group they are the same, and everything after the
rollout is compared. The loss type is dapo (the token mean over the whole batch: a rank that
divided by its own tokens would double its gradient), clipping is on (grad norm ~2 against 1).

Exact (bit for bit), since only which rank holds a row differs: the rewards and their metrics
(gathered from every rank, then reduced as one process does), the completion lengths, and
every sequence's advantage and per-token loss weight (recorded by grpo_groups.py; the same
multiset of rows on both sides).

Bounded by the order of fp32 sums, as tests/distributed/test_distributed_ranks.py derives it:
the gradient is summed over other micro-batches in another order and over the ranks, and the
micro-batches pad to other widths. With u = 2^-24 and K = 128 (the intermediate size, the
longest dot product) the 3 layers plus the head err by at most 5 K u relative, so the loss's
entropy agrees to that; AdamW runs with eps = 1 (its update 1-Lipschitz in the gradient), a
clipped gradient element is at most 1 in size, so over 2 steps the weights agree to
2 x lr x 2 x 1 x (5 K u + 4 u). (The second step's gradient is also taken at weights that
differ by the first step's bound, which moves it by a second-order amount at this scale.)
The loss (one iteration, beta 0) is -sum_t w_t A_t in value, whatever the logits: it agrees to
n u sum_t |w_t A_t| for n summed tokens. A rank that skipped a reduction or normalised over its
own tokens would be off by ~lr x |g| ~ 1e-2 in the weights, far outside.

The 2-rank runs keep the first TIER_BLOCKS blocks in the GPU tier (engine/tier.py, its device
code path on the CPU): those layers' weights are whole on every rank, their fp32 masters and
states sharded; the others stream from the sharded store. So the reference pass swaps the
reference's shards into the tier's resident weights and all-gathers them (engine.serving), and
the rollout reads the tier's layers where they are and all-gathers the streamed ones. The tier's
update is torch's AdamW where the store's is the C kernel: the same operations on the same
values, the last rounding of a weight apart (the 4 u term of the weight bound). A swap that
left a rank's part of the policy in place would show in the second batch's reference
log-probs (off by ~lr), one that did not restore it in the weights (off by ~lr x |g|).

Resume: the 2-rank run resumed from its step-1 checkpoint repeats step 2 bit for bit (each
rank's sampling seed is a function of the batch and the rank alone; each rank reloads its own
part of the KL reference).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from run_helpers import assert_exports_close

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "grpo_demo.yaml"
ENTRY = Path(__file__).resolve().parent / "grpo_groups.py"
GROUP, LR, CLIP, K, STEPS, BETA, TIER_BLOCKS = 3, 1e-2, 1.0, 128, 2, 0.5, 2
U = 2.0**-24
RTOL = 5 * K * U
WEIGHT_ATOL = STEPS * LR * 2 * CLIP * (5 * K * U + 4 * U)
REWARD = (
    "def short(completions, completion_ids, **kwargs):\n"
    "    return [-float(len(ids)) + 0.1 * ids[0] for ids in completion_ids]\n"
)  # test_grpo_command.py's reward file
COMMON = [
    "--model.name_or_path", "null", "--model.model_type", "llama", "--model.tiny", "true",
    "--model.tokenizer", "demo", "--model.config_overrides.vocab_size", "512",
    "--grpo.num_generations", str(GROUP), "--grpo.prompts_per_step", "4",
    "--grpo.max_completion_length", "5", "--training.micro_batch_size", "4",
    "--optimizer.learning_rate", str(LR), "--optimizer.max_grad_norm", str(CLIP),
    "--optimizer.eps", "1.0", "--training.max_steps", str(STEPS),
    "--checkpoint.save_every", "1", "--checkpoint.keep_last", "2",
    "--checkpoint.export_hf", "true", "--checkpoint.export_dtype", "fp32",
    "--grpo.beta", str(BETA),
    "--logging.progress_bar", "false", "--logging.report_to", "none", "--logging.log_every", "1",
]  # fmt: skip


def _rows_dir(out: Path) -> Path:
    """Where grpo_groups.py records the rows of run `out` (beside it: the output folder of a
    new run must be empty)."""
    return out.with_name(out.name + "-rows")


def _run(out: Path, ranks: int, reward: Path, *extra: str) -> None:
    rows = _rows_dir(out)
    rows.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MEGATRAIN_COLLECTIVE_TIMEOUT_S="120")
    env |= {"GROUP": str(GROUP), "ROWS_DIR": str(rows), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
        extra = ("--memory.gpu_state_blocks", str(TIER_BLOCKS), *extra)
    cmd = [*launch, str(ENTRY), "grpo", "--config", str(DEMO), *COMMON]
    cmd += ["--grpo.reward_funcs", f"[{reward}:short]", "--training.output_dir", str(out), *extra]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def _rows(out: Path, batch: int) -> list[dict]:
    """Every rank's recorded rows of generation batch `batch`, in a canonical order."""
    rows = []
    for file in sorted(_rows_dir(out).glob(f"batch-{batch}-rank*.json")):
        rows += json.loads(file.read_text())
    return sorted(rows, key=lambda r: json.dumps([r["tokens"], r["advantages"], r["weights"]]))


def _split(rows: list[dict]) -> tuple[list[dict], torch.Tensor]:
    """(the rows without their reference log-probs, those log-probs flat, float64)."""
    logps = [x for r in rows for x in r["ref_logps"]]
    return [{k: v for k, v in r.items() if k != "ref_logps"} for r in rows], torch.tensor(
        logps, dtype=torch.float64
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(2-rank output, 1-process output, the reward file: one path, which names its metric)."""
    reward = tmp_path_factory.mktemp("reward") / "rewards.py"
    reward.write_text(REWARD)
    two, one = tmp_path_factory.mktemp("two") / "run", tmp_path_factory.mktemp("one") / "run"
    _run(two, 2, reward)
    _run(one, 1, reward)
    return two, one, reward


def test_two_ranks_match_one_process(runs: tuple[Path, Path, Path]) -> None:
    two, one, reward = runs
    train, alone = _records(two), _records(one)
    assert [r["step"] for r in train] == [r["step"] for r in alone] == [1, 2]
    for batch in range(STEPS):
        files = list(_rows_dir(two).glob(f"batch-{batch}-rank*.json"))
        mine = [json.loads(f.read_text()) for f in files]
        assert [len(m) for m in mine] == [2 * GROUP, 2 * GROUP]  # 2 prompts' groups each
        (rows, logps), (ref, ref_logps) = _split(_rows(two, batch)), _split(_rows(one, batch))
        assert rows == ref  # the same sequences, advantages and token weights, bit for bit
        assert sum(w for r in ref for w in r["weights"]) == pytest.approx(1.0)  # dapo's mean
        assert any(a != 0.0 for r in ref for a in r["advantages"])  # a learning signal
        # the reference pass on the ranks' all-gathered reference shards
        torch.testing.assert_close(logps, ref_logps, rtol=RTOL, atol=0.0)
    exact = ["reward", "reward_std", f"rewards/{reward}:short/mean", "std_zero_share", "lr"]
    exact += ["completion_length", "completion_length_max", "clipped_share", "target_tokens"]
    assert [[r[k] for k in exact] for r in train] == [[r[k] for k in exact] for r in alone]
    assert all(r["clip_coef"] < 1.0 for r in alone)  # clipping was active
    assert alone[0]["kl"] < 1e-9 < alone[1]["kl"]  # step 1 trains the reference weights
    for step, (r2, r1) in enumerate(zip(train, alone, strict=True)):
        rows, logps = _split(_rows(one, step))
        pairs = [zip(r["weights"], r["advantages"], strict=True) for r in rows]
        terms = [abs(w * a) for pair in pairs for w, a in pair]
        kl_bound = (2 * r1["kl"]) ** 0.5 * 2 * RTOL * float(logps.abs().max())
        assert r2["kl"] == pytest.approx(r1["kl"], rel=0, abs=kl_bound)
        loss_bound = len(terms) * U * sum(terms) + BETA * kl_bound
        assert r2["loss"] == pytest.approx(r1["loss"], rel=0, abs=loss_bound)
        assert r2["entropy"] == pytest.approx(r1["entropy"], rel=RTOL, abs=0)
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=RTOL, abs=0)
    assert_exports_close(one, two, WEIGHT_ATOL)


def test_resume_under_two_ranks_is_exact(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    two, _, reward = runs
    resumed = tmp_path / "resumed"
    step1 = two / "checkpoints" / "step-00000001"
    # each rank's part of the KL reference: the copies of its own shards
    parts = sorted(step1.glob("reference.rank*.safetensors"))
    assert [f.name for f in parts] == [f"reference.rank00{r}-of-002.safetensors" for r in (0, 1)]
    for r, part in enumerate(parts):
        for name, copy in load_file(str(part)).items():
            block = load_file(str(step1 / "blocks" / f"{name}.rank00{r}-of-002.safetensors"))
            assert copy.shape == block["master"].shape  # fp32 compute: the master is copied
    first, second = (load_file(str(f))["layer.0"] for f in parts)
    assert not torch.equal(first, second)
    shutil.copytree(step1, resumed / "checkpoints" / step1.name)  # as if stopped after step 1
    _run(resumed, 2, reward, "--checkpoint.resume_from", "auto")
    keys = ["loss", "reward", "entropy", "grad_norm", "completion_length", "kl"]
    (again,) = _records(resumed)
    assert again["step"] == 2
    assert [again[k] for k in keys] == [_records(two)[1][k] for k in keys]  # bit for bit
    assert _rows(resumed, 1) == _rows(two, 1)
    w = load_file(str(resumed / "hf_model" / "model.safetensors"))
    for name, ref in load_file(str(two / "hf_model" / "model.safetensors")).items():
        assert torch.equal(w[name], ref), name
