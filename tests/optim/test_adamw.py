"""CPU AdamW (C kernel and torch fallback) against torch.optim.AdamW in float64 + clip scaling,
within the error bound of fp32 arithmetic; the C kernel's exactness and its fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.native import load_adamw_kernel, reference_step, self_test
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.blocks import ParamBlock, to_bf16_
from state_blocks import host_block

IMPLS = ["torch"] + (["c"] if load_adamw_kernel() is not None else [])


def _block(n: int, decay_numel: int, bf16: bool, seed: int = 0) -> ParamBlock:
    return host_block(n, decay_numel, "fp32", bf16, seed=seed, name="b")


# fp32 unit roundoff: a correctly rounded +, -, *, / or sqrt errs by at most U relative.
U = 2.0**-24


def _error_bounds(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    decay: torch.Tensor,
    lr: float,
    step: int,
    hyper: AdamWHyper,
) -> dict[str, torch.Tensor]:
    """Per element, how far one fp32 AdamW step may be from the exact (float64) one.

    Counting one U per rounding (operations and fp32 constants), on exact float64 magnitudes:
      g' = g*s                      2U|g'|
      m' = m + c1 (g' - m)          U(|m'| + 5 c1 (|g'| + |m|))               (= E_m)
      v' = b2 v + c2 g' g'          8U v'   (non-negative terms: no cancellation)
      d  = sqrt(v')/bc2 + eps       9U d    (sqrt halves v's relative error)
      u  = step_size m' / d         step_size E_m / d + 12U |u|
      p' = p*decay - u              2U |p decay| + U |p'| + E_u
    torch's fused kernel orders or fuses some of these differently (lerp, addcdiv, FMA), which
    only removes roundings, so the same bound holds for both implementations.
    """
    beta1, beta2 = hyper.betas
    c1 = 1 - beta1
    g, m, p = (old[k].abs() for k in ("grad", "exp_avg", "master"))
    m_new, v_new, p_new = (new[k] for k in ("exp_avg", "exp_avg_sq", "master"))
    e_m = U * (m_new.abs() + 5 * c1 * (g + m))
    denom = v_new.sqrt() / (1 - beta2**step) ** 0.5 + hyper.eps
    step_size = lr / (1 - beta1**step)
    update = step_size * m_new.abs() / denom
    e_update = step_size * e_m / denom + 12 * U * update
    return {
        "master": 2 * U * p * decay + U * p_new.abs() + e_update,
        "exp_avg": e_m,
        "exp_avg_sq": 8 * U * v_new,
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bf16_grads", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_float64_adamw_with_decay_ranges_and_clip_scale(
    impl: str, bf16_grads: bool, threads: int
) -> None:
    """Each step, from our own state, against torch.optim.AdamW in float64 (the exact result),
    within the error bound fp32 arithmetic can promise (_error_bounds): no tolerance depends on
    the CPU, its vector width or the thread count."""
    n, n_decay, lr = 10_007, 6_000, 3e-3
    block = _block(n, n_decay, bf16_grads)
    hyper = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref_decay = torch.nn.Parameter(torch.zeros(n_decay, dtype=torch.float64))
    ref_plain = torch.nn.Parameter(torch.zeros(n - n_decay, dtype=torch.float64))
    groups = [{"params": [ref_decay], "weight_decay": 0.1}, {"params": [ref_plain]}]
    ref = torch.optim.AdamW(groups, lr=lr, betas=hyper.betas, eps=hyper.eps, weight_decay=0.0)
    decay = torch.cat([torch.full((n_decay,), 1 - lr * 0.1), torch.ones(n - n_decay)]).double()
    ours = CpuAdamW(hyper, impl=impl, num_threads=threads)
    gen = torch.Generator().manual_seed(1)
    for step, scale in enumerate([1.0, 0.37, 1.0, 0.05], start=1):
        grad = torch.randn(n, generator=gen) * (10 ** -(step % 3))
        if bf16_grads:
            grad = grad.bfloat16().float()  # what lands in the shadow
        old = {k: getattr(block, k).double() for k in ("master", "exp_avg", "exp_avg_sq")}
        old["grad"] = grad.double() * scale
        for part, sl in ((ref_decay, slice(0, n_decay)), (ref_plain, slice(n_decay, n))):
            part.data.copy_(old["master"][sl])
            part.grad = old["grad"][sl].clone()
            if step > 1:  # start from our state, so only this step's rounding is measured
                ref.state[part]["exp_avg"].copy_(old["exp_avg"][sl])
                ref.state[part]["exp_avg_sq"].copy_(old["exp_avg_sq"][sl])
        ref.step()
        block.grad_landing.copy_(grad)
        ours.update(block, lr=lr, grad_scale=scale)
        exact = {
            k: torch.cat([ref.state[ref_decay][k], ref.state[ref_plain][k]])
            for k in ("exp_avg", "exp_avg_sq")
        }
        exact["master"] = torch.cat([ref_decay.detach(), ref_plain.detach()])
        bounds = _error_bounds(old, exact, decay, lr, step, hyper)
        for key, bound in bounds.items():
            err = (getattr(block, key).double() - exact[key]).abs()
            worst = int((err / bound).argmax())
            assert bool((err <= bound).all()), (
                f"step {step} {key}[{worst}]: error {float(err[worst]):.3e} > bound "
                f"{float(bound[worst]):.3e}"
            )
        if block.shadow is not None:
            assert torch.equal(block.shadow, block.master.bfloat16())
    assert block.step == 4


@pytest.mark.skipif("c" not in IMPLS, reason="no C compiler with OpenMP")
def test_c_kernel_is_ieee_fp32_and_independent_of_thread_count() -> None:
    """Bit-identical to the operations done one by one in fp32 (no FMA contraction, no fast-math
    reassociation: the same on AVX2 and AVX-512), with 1, 2 or 5 threads over several chunks."""
    n = 200_003  # 4 chunks of 2**16 and a ragged tail
    gen = torch.Generator().manual_seed(3)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    v, g = torch.rand(n, generator=gen) * 1e-6, torch.randn(n, generator=gen)
    consts = dict(
        decay=1 - 3e-4, beta2=0.999, one_minus_b1=0.1, one_minus_b2=1e-3, step_size=1e-3,
        bc2_sqrt=0.0447, eps=1e-8, grad_scale=0.5,
    )  # fmt: skip
    expected = reference_step(p, m, v, g, **consts)
    lib = load_adamw_kernel()
    assert lib is not None and self_test(lib)
    for threads in (1, 2, 5):
        pc, mc, vc = p.clone(), m.clone(), v.clone()
        lib.mt_adamw(
            pc.data_ptr(), mc.data_ptr(), vc.data_ptr(), g.data_ptr(), 0, None, n,
            *consts.values(), threads,
        )  # fmt: skip
        for ours, theirs in zip((pc, mc, vc), expected, strict=True):
            assert torch.equal(ours, theirs), threads


def test_kernel_falls_back_to_torch_when_the_build_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that answers --version but cannot build: a warning, then the torch path."""
    broken = tmp_path / "cc"
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && echo broken-cc 1.0 && exit 0\nexit 1\n')
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEGATRAIN_NO_C_KERNEL", raising=False)
    load_adamw_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not build the C AdamW kernel"):
            assert load_adamw_kernel() is None
        assert CpuAdamW(AdamWHyper()).impl == "torch"
        with pytest.raises(ValueError, match=r"optimizer\.impl: c needs a C compiler"):
            CpuAdamW(AdamWHyper(), impl="c")
    finally:
        load_adamw_kernel.cache_clear()


def test_c_kernel_bf16_cast_rounds_like_torch() -> None:
    src = torch.cat(
        [
            torch.randn(100_000) * 10 ** torch.randint(-30, 30, (100_000,)).float(),
            torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0]),
        ]
    )
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    to_bf16_(dst, src)
    expected = src.bfloat16()
    same = (dst == expected) | (dst.isnan() & expected.isnan())
    assert bool(same.all())


def test_unknown_impl_is_refused() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.impl"):
        CpuAdamW(AdamWHyper(), impl="cuda")
