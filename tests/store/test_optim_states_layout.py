"""The store's AdamW state layouts: bytes per parameter (store, estimator and fit check agree),
the bf16 stochastic rounding, and the optimizer.state_dtype key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatrain.config import load_config
from megatrain.model.loading import load_causal_lm
from megatrain.model.structure import discover
from megatrain.model.tiny import tiny_config
from megatrain.planning import Hardware, host_problem, model_spec
from megatrain.planning.hardware import GIB
from megatrain.store.host import HostStore
from megatrain.store.states import (
    QUANT_BLOCK,
    bf16_stochastic,
    rounding_keys,
    state_bytes_per_param,
    state_nbytes,
)
from predict import predict

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
# m + v bytes of one parameter: fp32 exact; bf16; int8 codes + two fp32 scales per 2048; int4
# codes (two a byte) + two fp32 scales per 128
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2 + 8 / 2048, "int4": 1 + 8 / 128}


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8", "int4"])
def test_store_bytes_equal_the_estimate(state_dtype: str) -> None:
    assert state_bytes_per_param(state_dtype) == STATE_BYTES[state_dtype]
    model = load_causal_lm(None, model_type="llama", tiny=True)
    store = HostStore(discover(model), compute_dtype=torch.bfloat16, state_dtype=state_dtype)
    assert all(b.state_dtype == state_dtype for b in store.blocks)
    numels = [b.numel for b in store.blocks]
    expected = sum(
        (4 + 2) * n + (8 * n if state_dtype == "fp32" else 4 * n if state_dtype == "bf16" else 0)
        for n in numels
    )
    if state_dtype == "int8":  # codes, and one fp32 absmax per (partial) block for m and v
        expected += sum(2 * n + 8 * math.ceil(n / QUANT_BLOCK) for n in numels)
    if state_dtype == "int4":  # 64 bytes of codes and one fp32 absmax per (partial) 128, each
        expected += sum(2 * (64 + 4) * math.ceil(n / 128) for n in numels)
    assert store.host_bytes() == expected
    spec = model_spec(tiny_config("llama"))
    est = predict(spec, seq_len=32, micro_batch_size=1, state_dtype=state_dtype)
    assert est.host.store_bytes == store.host_bytes()
    assert est.settings["state_dtype"] == state_dtype


def test_bytes_per_parameter_of_a_large_model() -> None:
    """bf16 compute: 14, 10, 8 (+ 8/2048 for the scales) and 7 (+ 8/128) bytes per parameter."""
    spec = model_spec(tiny_config("llama", hidden_size=1024, intermediate_size=4096))
    per_param = {}
    for state_dtype in ("fp32", "bf16", "int8", "int4"):
        est = predict(spec, seq_len=32, micro_batch_size=1, state_dtype=state_dtype)
        per_param[state_dtype] = est.host.store_bytes / est.total_params
    assert per_param["fp32"] == 14 and per_param["bf16"] == 10
    assert 8 < per_param["int8"] <= 8 + 8 / 2048 + 1e-6  # partial blocks: at most one each
    assert 7 + 8 / 128 <= per_param["int4"] <= 7 + 8 / 128 + 1e-4


def test_fit_check_counts_the_state_dtype_and_suggests_it() -> None:
    spec = model_spec(tiny_config("llama", hidden_size=1024, intermediate_size=4096))
    params = spec.total_params
    # a host that holds the int8 store but not the fp32 one (both with a 1 GiB margin)
    hw = Hardware(host_bytes=11 * params + GIB, process_baseline_bytes=0)
    kwargs = dict(seq_len=32, micro_batch_size=1, hardware=hw, pin_memory=False)
    fp32 = predict(spec, state_dtype="fp32", **kwargs)  # type: ignore[arg-type]
    int8 = predict(spec, state_dtype="int8", **kwargs)  # type: ignore[arg-type]
    assert host_problem(int8, hw, margin_gib=1.0) is None
    problem = host_problem(fp32, hw, margin_gib=1.0)
    assert problem is not None and "14 B/param" in problem
    # the least compressed store that fits: bf16 states, 4 + 4 + 2 bytes a parameter
    assert "Use optimizer.state_dtype: bf16 (10.00 B/param, predicted " in problem
    assert "the least compressed store that fits" in problem
    # a host short of the int8 store (8.004 B/param): int4 states (7.0625) are the least
    # compressed store that fits; with a bf16 master 6.004 and 5.0625 would too
    small = Hardware(host_bytes=int(7.5 * params) + GIB, process_baseline_bytes=0)
    kwargs["hardware"] = small
    int8 = predict(spec, state_dtype="int8", **kwargs)  # type: ignore[arg-type]
    problem = host_problem(int8, small, margin_gib=1.0)
    assert problem is not None and "Use optimizer.state_dtype: int4 (7.06 B/param" in problem
    # a host that holds none: the most compact store (bf16 master, int4 states, int8 held
    # gradients: 2 + 1.0625 + 1.002) named with what it would need
    tiny = Hardware(host_bytes=4 * params + GIB, process_baseline_bytes=0)
    kwargs["hardware"] = tiny
    problem = host_problem(predict(spec, **kwargs), tiny, margin_gib=1.0)  # type: ignore[arg-type]
    assert problem is not None and problem.endswith(
        "(the most compact store, optimizer.state_dtype: int4 and optimizer.master_dtype: bf16 "
        "and optimizer.grad_dtype: int8 "
        f"(4.06 B/param, predicted {problem.split('predicted ')[-1].split(')')[0]}), does not "
        "fit either)"
    )


def test_stochastic_rounding_brackets_is_unbiased_and_deterministic() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-20, 20, (4096,)).float()
    x[:3] = torch.tensor([1.0, -0.5, 2.0**127])  # exactly representable: unchanged
    down = x.bfloat16()  # round to nearest; the neighbours in bf16 bracket x
    lo = torch.minimum(down.float(), x)
    key_m, key_v = rounding_keys("layer.0", 7)
    assert key_m != key_v and rounding_keys("layer.0", 7) == (key_m, key_v)
    assert rounding_keys("layer.1", 7) != (key_m, key_v) != rounding_keys("layer.0", 8)
    r = bf16_stochastic(x, key_m).float()
    assert torch.equal(bf16_stochastic(x, key_m).float(), r)  # deterministic
    assert torch.equal(r[:3], x[:3])
    # r is one of the two bf16 values around x (same sign, magnitude within one bf16 ulp)
    ulp = torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8)
    assert bool(((r - x).abs() < ulp).all()) and bool((torch.sign(r) == torch.sign(x)).all())
    assert bool((r.abs() >= lo.abs() - ulp).all())
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out = bf16_stochastic(special, key_m).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan()
    # unbiased: one value rounded at 20,000 element indices (independent bits); the mean's
    # standard deviation is <= ulp / 2 / sqrt(n); allow 5 of them
    n, value = 20_000, torch.tensor(1.0 + 2**-9 + 2**-11)  # 5/8 of the way to the next bf16
    rounded = bf16_stochastic(value.repeat(n), key_v).double()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - value.item()) <= 5 * 2**-7 / 2 / math.sqrt(n)
    # an offset continues the same stream: element i of a block is element i wherever it starts
    assert torch.equal(bf16_stochastic(x[100:], key_m, start=100), bf16_stochastic(x, key_m)[100:])


def test_state_nbytes_of_partial_blocks() -> None:
    assert state_nbytes(1, "int8") == 2 + 8
    assert state_nbytes(QUANT_BLOCK + 1, "int8") == 2 * (QUANT_BLOCK + 1) + 16
    assert state_nbytes(10, "bf16") == 40 and state_nbytes(10, "fp32") == 80
    assert state_nbytes(1, "int4") == 2 * (64 + 4) and state_nbytes(257, "int4") == 6 * (64 + 4)
    with pytest.raises(ValueError, match=r"optimizer\.state_dtype must be one of"):
        state_nbytes(10, "fp8")


def test_state_dtype_config_key() -> None:
    assert load_config(DEMO, []).optimizer.state_dtype == "fp32"
    assert load_config(DEMO, ["--optimizer.state_dtype", "int8"]).optimizer.state_dtype == "int8"
    with pytest.raises(ValueError, match=r"optimizer.state_dtype='fp16' must be one of"):
        load_config(DEMO, ["--optimizer.state_dtype", "fp16"])
