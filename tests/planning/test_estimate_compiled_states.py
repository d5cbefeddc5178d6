"""The estimate models compiled layers and the CPU AdamW rate of compressed states."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import Qwen2Config

from megatrain.planning import Hardware, model_spec
from megatrain.planning.hardware import GIB
from megatrain.planning.layer_time import COMPILED_SPEEDUP, HBM_FRACTION
from megatrain.planning.optimizer_rate import STATE_DTYPE_SPEED
from megatrain.planning.spec import ModelSpec
from predict import predict

H100 = Hardware(gpu_bytes=80 * GIB, optimizer_gparams_s=3.85)
SHAPE = dict(
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=32000,
)


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return model_spec(Qwen2Config(**SHAPE))


def test_compiled_layers_divide_layer_compute_only(spec: ModelSpec) -> None:
    kwargs = dict(seq_len=4096, micro_batch_size=2, padded=False, hardware=H100)
    eager = predict(spec, **kwargs).time
    compiled = predict(spec, compiled=True, **kwargs).time
    assert compiled.loss_s == eager.loss_s  # the fused loss is not a compiled layer
    # nor is the gradient sum: 10 bytes a parameter (bf16 gradient read, fp32 sum read and
    # written), one micro-batch
    summed = 10 * sum(la.params for la in spec.layers) / (H100.gpu_hbm_gbps * 1e9 * HBM_FRACTION)
    layers = eager.compute_s - eager.loss_s - summed
    compiled_layers = compiled.compute_s - compiled.loss_s - summed
    assert compiled_layers == pytest.approx(layers / COMPILED_SPEEDUP)
    assert compiled.step_s < eager.step_s


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_state_dtype_scales_the_cpu_optimizer_time(spec: object, dtype: str) -> None:
    kwargs = dict(seq_len=2048, micro_batch_size=1, padded=False, hardware=H100)
    fp32 = predict(spec, **kwargs).time
    other = predict(spec, state_dtype=dtype, **kwargs).time
    assert other.optimizer_s == pytest.approx(fp32.optimizer_s / STATE_DTYPE_SPEED[dtype])
    assert predict(spec, state_dtype=dtype, **kwargs).settings["state_dtype"] == dtype


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_rate_probed_with_the_runs_kernel_is_taken_as_it_is(spec: object, dtype: str) -> None:
    kwargs = dict(seq_len=2048, micro_batch_size=1, padded=False, state_dtype=dtype)
    probed = dataclasses.replace(H100, optimizer_state_dtype=dtype)
    fp32 = predict(spec, **kwargs, hardware=H100).time  # the fp32 rate times the ratio
    own = predict(spec, **kwargs, hardware=probed).time  # the same number, this kernel's rate
    assert own.optimizer_s == pytest.approx(fp32.optimizer_s * STATE_DTYPE_SPEED[dtype])


def test_probe_times_the_state_dtypes_own_kernel() -> None:
    from megatrain.planning.hardware import probe

    hw = probe(optimizer_params=25_000_000, optimizer_threads=1, state_dtype="int8")
    assert hw.optimizer_state_dtype == "int8" and "optimizer_gparams_s" in hw.measured
    assert hw.optimizer_gparams_s > 0


def test_the_run_shape_carries_compile_layers_into_the_plan() -> None:
    from megatrain.config.shorthand import shorthand_config
    from megatrain.recipes.builder import RunBuilder

    values = {"model.model_type": "llama", "model.tiny": True, "training.device": "cpu"}
    for compiled in (False, True):
        cfg = shorthand_config(None, values={**values, "training.compile_layers": compiled})
        assert RunBuilder(cfg).plan().estimate.settings["compiled"] is compiled
