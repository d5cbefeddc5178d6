"""bf16 master weights in real training runs of the demo (bf16 compute, CPU engine).

Checkpoints hold the bf16 master as stored and resume bit for bit with every state dtype; a
checkpoint of the other master dtype is refused; the HF export writes the master's values in
the dtype asked; every update the engine applies equals the
torch reference of the same arithmetic (fp32 AdamW, then stochastic rounding into bf16 with
the same bits) bit for bit, and torch.optim.AdamW to within one bf16 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatrain.checkpoint.export import export_hf
from megatrain.checkpoint.saving import latest_checkpoint
from megatrain.config import load_config
from megatrain.optim.adamw import AdamWHyper, CpuAdamW, StepScalars
from megatrain.optim.bf16_master import update_bf16_master_reference
from megatrain.recipes.sft import Trainer
from megatrain.store.blocks import ParamBlock
from megatrain.store.grads import POOL_LANDINGS, held_gradient
from run_helpers import FEW_SAMPLES, assert_resumes_exactly, checkpoint_blocks

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
BF16_MASTER = ("--optimizer.master_dtype", "bf16", "--model.compute_dtype", "bf16")


def _trainer(tmp: Path, *overrides: str) -> Trainer:
    quiet = ["--logging.progress_bar", "false", "--logging.report_to", "none"]
    cfg = load_config(DEMO, ["--training.output_dir", str(tmp), *quiet, *FEW_SAMPLES, *overrides])
    return Trainer(cfg)


def _train(tmp: Path, *overrides: str) -> tuple[list[float], Trainer]:
    trainer = _trainer(tmp, *overrides)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return summary.losses, trainer


# 2 rows a step, not the demo's 8: torch's CPU bf16 matmuls run at 1-2 GFLOP/s where the host
# has no native bf16 (AVX2), and what these runs check does not depend on the tokens
ROWS = ("--training.micro_batch_size", "2")
COMMON = (
    *ROWS,
    "--training.max_steps",
    "6",
    "--checkpoint.save_every",
    "3",
    "--checkpoint.keep_last",
    "2",
    "--checkpoint.export_hf",
    "false",
    "--data.val_size",
    "0",
)


INT8_GRADS = ("--optimizer.grad_dtype", "int8")
NO_CLIPPING = ("--optimizer.max_grad_norm", "0")  # the gradients land in a shared pool


@pytest.mark.parametrize(
    ("state_dtype", "hold"),
    [("fp32", ()), ("bf16", ()), ("int8", ()), ("int4", ()), ("int4", INT8_GRADS),
     ("int4", NO_CLIPPING)],
)  # fmt: skip
def test_bf16_master_checkpoint_as_stored_and_resume_exactly(
    tmp_path: Path, state_dtype: str, hold: tuple[str, ...]
) -> None:
    common = (*BF16_MASTER, "--optimizer.state_dtype", state_dtype, *hold, *COMMON)
    straight, trainer = _train(tmp_path / "a", *common)
    final = checkpoint_blocks(tmp_path / "a" / "checkpoints" / "step-00000006")
    block = trainer.store.layers[0]
    assert block.master.dtype == torch.bfloat16 and block.shadow is None
    if hold == NO_CLIPPING:  # every landing went back to the pool after its update
        assert block.grad is None and trainer.store.grad_pool is not None
        assert len(trainer.store.grad_pool.buffers()) == POOL_LANDINGS
    else:
        wanted = torch.int8 if hold == INT8_GRADS else torch.bfloat16
        assert block.grad is not None and block.grad.dtype == wanted  # gradient landing
    assert final["layer.0.safetensors"]["master"].dtype == torch.bfloat16
    for key, saved in final["layer.0.safetensors"].items():
        assert torch.equal({"master": block.master, **block.state_tensors()}[key], saved)
    assert_resumes_exactly(lambda out, *a: _train(out, *a)[0], tmp_path, common, straight)


def test_checkpoint_of_another_master_dtype_is_refused(tmp_path: Path) -> None:
    common = ("--training.max_steps", "1", "--checkpoint.export_hf", "false")
    _train(tmp_path, *common, *BF16_MASTER)
    assert latest_checkpoint(tmp_path) is not None
    with pytest.raises(ValueError, match=r"bf16 master weights but this run has optimizer"):
        _trainer(tmp_path, *common, "--model.compute_dtype", "bf16", "--checkpoint.resume_from",
                 "auto")  # fmt: skip


@dataclass
class _Update:
    before: ParamBlock  # a copy of the block as the update found it (gradient landed)
    after: dict[str, torch.Tensor]
    lr: float
    grad_scale: float


def _copy(block: ParamBlock) -> ParamBlock:
    copy = ParamBlock(
        name=block.name,
        entries=[],
        numel=block.numel,
        decay_numel=block.decay_numel,
        master=block.master.clone(),
        exp_avg=block.exp_avg.clone(),
        exp_avg_sq=block.exp_avg_sq.clone(),
        step=block.step,
        state_dtype=block.state_dtype,
    )
    assert block.grad is not None
    copy.grad = block.grad.clone()
    copy.grad_unit = block.grad_unit.clone() if block.grad_unit is not None else None
    return copy


@pytest.mark.parametrize("hold", [(), INT8_GRADS, NO_CLIPPING])
def test_engine_updates_equal_the_torch_reference(tmp_path: Path, hold: tuple[str, ...]) -> None:
    """Every update of a 3-step run with clipping (demo at 2 rows a step, bf16 compute, fp32
    states), replayed: `update_bf16_master_reference` on a copy of the block as the engine's
    update found it gives the same bf16 master and states bit for bit. Against
    torch.optim.AdamW (fp32, from the same master, states, step and clipped gradient), whose
    operations round in another order (each op within 2^-24 of its terms' magnitudes): m
    within 4 x 2^-24 (|m0| + |g|)
    (m0 + (1 - b1)(g - m0) may cancel: relative error is unbounded, absolute is not), v within
    1e-6 relative (a sum of positive terms), and the new master within one bf16 ulp of AdamW's
    fp32 weight (stochastic rounding picks one of its two bf16 neighbours) plus 16 units of
    2^-24 of the terms of that weight: |p| and the step, at most 3.2 lr for betas (0.9, 0.999)
    (|m_hat| / sqrt(v_hat) <= (1 - b1) / sqrt(1 - b2), Kingma & Ba sec. 2.1). The first loss
    equals an fp32-master run's: both start from the same bf16 weights (the fp32 weights
    rounded to nearest). int8 gradients: the same, the gradient being what the update read
    (codes x units); clipping off: the same on the gradient a shared landing held."""
    trainer = _trainer(
        tmp_path / "bf16", *BF16_MASTER, *ROWS, "--training.max_steps", "3",
        "--checkpoint.export_hf", "false", "--optimizer.weight_decay", "0.1",
        "--optimizer.max_grad_norm", "0.5", "--optimizer.learning_rate", "1e-3", *hold,
    )  # fmt: skip
    optimizer: CpuAdamW = trainer.engine.worker.optimizer
    real, seen = optimizer.update, []

    def recording(block: ParamBlock, *, lr: float, grad_scale: float = 1.0, **kw: bool) -> None:
        before = _copy(block)
        real(block, lr=lr, grad_scale=grad_scale, **kw)
        after = {"master": block.master.clone(), "m": block.exp_avg.clone(),
                 "v": block.exp_avg_sq.clone()}  # fmt: skip
        seen.append(_Update(before, after, lr, grad_scale))

    optimizer.update = recording  # type: ignore[method-assign]
    try:
        losses = trainer.train().losses
    finally:
        trainer.close()
    assert len(seen) == 3 * len(trainer.store.blocks)
    assert any(u.grad_scale < 1.0 for u in seen) == (hold != NO_CLIPPING)  # clipping took part
    hyper = optimizer.hyper
    assert hyper.betas == (0.9, 0.999)  # the step bound below is for these
    for u in seen:
        block = u.before
        block.step += 1
        beta1, beta2 = hyper.betas
        scalars = StepScalars(
            decay=1.0 - u.lr * hyper.weight_decay, beta2=beta2, one_minus_b1=1.0 - beta1,
            one_minus_b2=1.0 - beta2, step_size=u.lr / (1.0 - beta1**block.step),
            bc2_sqrt=(1.0 - beta2**block.step) ** 0.5, eps=hyper.eps, grad_scale=u.grad_scale,
        )  # fmt: skip
        m0, v0, p0 = block.exp_avg.clone(), block.exp_avg_sq.clone(), block.master.float()
        update_bf16_master_reference(block, scalars)
        assert torch.equal(block.master, u.after["master"]), block.name
        assert torch.equal(block.exp_avg, u.after["m"]) and torch.equal(
            block.exp_avg_sq, u.after["v"]
        )
        p_ref, m_ref, v_ref = _torch_adamw(block, p0, m0, v0, u, hyper)
        g = held_gradient(block, 0, block.numel) * u.grad_scale
        m_bound = 4 * 2.0**-24 * (m0.abs() + g.abs())
        assert bool(((u.after["m"] - m_ref).abs() <= m_bound).all()), block.name
        torch.testing.assert_close(u.after["v"], v_ref, rtol=1e-6, atol=0)
        ulp = torch.ldexp(torch.ones_like(p_ref), torch.frexp(p_ref)[1] - 8)
        p_bound = ulp + 16 * 2.0**-24 * (p_ref.abs() + 3.2 * u.lr)
        assert bool(((u.after["master"].float() - p_ref).abs() <= p_bound).all()), block.name
    fp32_losses, _ = _train(
        tmp_path / "fp32", "--model.compute_dtype", "bf16", *ROWS, "--training.max_steps", "1",
        "--checkpoint.export_hf", "false",
    )  # fmt: skip
    assert losses[0] == fp32_losses[0]


def _torch_adamw(
    block: ParamBlock,
    p0: torch.Tensor,
    m0: torch.Tensor,
    v0: torch.Tensor,
    u: _Update,
    hyper: AdamWHyper,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW's fp32 step from (p0, m0, v0) with the landed gradient x grad_scale."""
    out = []
    decayed = ((0, block.decay_numel, hyper.weight_decay), (block.decay_numel, block.numel, 0.0))
    for lo, hi, wd in decayed:
        p = torch.nn.Parameter(p0[lo:hi].clone())
        p.grad = held_gradient(u.before, lo, hi) * u.grad_scale
        opt = torch.optim.AdamW(
            [p], lr=u.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=wd, foreach=False
        )
        opt.state[p] = {
            "step": torch.tensor(float(block.step - 1)),
            "exp_avg": m0[lo:hi].clone(),
            "exp_avg_sq": v0[lo:hi].clone(),
        }
        opt.step()
        out.append((p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    return tuple(torch.cat(parts) for parts in zip(*out, strict=True))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_export_writes_the_bf16_master_in_the_dtype_asked(tmp_path: Path, dtype: str) -> None:
    """The HF export holds the master's values exactly: as they are (bf16) or cast (fp32)."""
    _, trainer = _train(tmp_path / "run", *BF16_MASTER, "--training.max_steps", "1",
                        "--checkpoint.export_hf", "false")  # fmt: skip
    out = export_hf(trainer.store, tmp_path / "hf", dtype=dtype)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    wanted = torch.bfloat16 if dtype == "bf16" else torch.float32
    checked = 0
    for block in trainer.store.blocks:
        for entry in block.entries:
            if entry.full_name in exported:  # a tied lm_head is written once
                tensor = exported[entry.full_name]
                assert tensor.dtype == wanted
                assert torch.equal(tensor, block.view(block.master, entry).to(wanted))
                checked += 1
    assert checked >= len(trainer.store.layers)
