"""Optional kernel packages in a layer (model/kernels.py): the plan's meta profile runs their
torch reference instead (a Triton kernel launched on meta tensors reads address 0 on a GPU:
the illegal memory access the Qwen3.5 profile hit with flash-linear-attention installed).

A stand-in `fla` package (tests/fake_fla.py) takes the place of the real one, which needs a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch
from torch import nn

from fake_fla import run_with_fake_fla
from megatrain.model import kernels

_PROFILE = textwrap.dedent(
    """
    import torch

    from megatrain.distributed import Placement
    from megatrain.model.kernels import kernel_report
    from megatrain.planning.builder import PlanBuilder
    from megatrain.verify import verify_config

    cfg = verify_config(None, [], model_type="qwen3_5_text", tiny=True)
    builder = PlanBuilder(cfg, placement=Placement(torch.device("cpu")))
    plan = builder.plan()
    print("PEAK", plan.estimate.gpu.peak_bytes)
    print("REPORT", kernel_report(builder.spec.structure))
    """
)


_REFUSED = textwrap.dedent(
    """
    from megatrain.recipes.builder import RunBuilder
    from megatrain.model import kernels
    from megatrain.verify import make_batches, verify_config

    kernels.refusals = lambda: {"fla": "fla refuses this Triton"}  # as _fla_refusal on Hopper
    cfg = verify_config(None, [], model_type="qwen3_5_text", tiny=True)
    builder = RunBuilder(cfg)
    structure = builder.model()
    print("REPORT", kernels.kernel_report(structure))
    store = builder.store(structure)
    engine = builder.engine(structure, store)
    vocab = structure.causal_lm.config.vocab_size
    for micro in make_batches(cfg, 2, vocab, 0, *builder.batch()):
        print("LOSS", engine.train_step(micro, lr=1e-3).loss)
    engine.close()
    """
)


def test_a_refused_package_falls_back_to_the_torch_reference_for_the_run(
    tmp_path: Path,
) -> None:
    """fla installed but refusing (its guard would raise in the first backward): the engine's
    layers run transformers' torch reference, and the report says why."""
    out = run_with_fake_fla(tmp_path, _REFUSED, FAKE_FLA_REFUSES="1")
    assert "fla refuses this Triton" in out.split("REPORT ")[1].splitlines()[0]
    assert out.count("LOSS ") == 2


def test_plan_profiles_a_layer_whose_package_kernels_refuse_meta(tmp_path: Path) -> None:
    out = run_with_fake_fla(tmp_path, _PROFILE)
    assert int(out.split("PEAK ")[1].split()[0]) > 0
    report = out.split("REPORT ")[1]
    assert "flash-linear-attention kernels" in report and "upper bound" in report
    assert "their time as the fused kernels" in report


def _torch_rule(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_reference_kernels_swaps_bound_functions_and_restores_them() -> None:
    """transformers 5.0-5.17's form: the layer's attribute holds the package's function, the
    model's file defines `torch_<name>`; a package module runs as an elementwise stand-in."""
    package_fn = types.FunctionType(_torch_rule.__code__, {}, "chunk_rule")
    package_fn.__module__ = "fla.ops.gated_delta_rule"
    norm_cls = type("FusedRMSNormGated", (nn.Module,), {"__module__": "fla.modules"})
    norm_cls.forward = lambda self, x, g: (_ for _ in ()).throw(RuntimeError("kernel ran"))

    source = types.ModuleType("fake_modeling")
    source.torch_chunk_rule = _torch_rule  # type: ignore[attr-defined]
    sys.modules["fake_modeling"] = source
    layer_cls = type("Layer", (nn.Module,), {"__module__": "fake_modeling"})
    layer = layer_cls()
    layer.chunk_rule = package_fn
    layer.norm = norm_cls()
    try:
        assert kernels.kernel_calls(layer) == {"chunk_rule": "fla", "norm.FusedRMSNormGated": "fla"}
        x = torch.ones(3, device="meta")
        with kernels.reference_kernels(layer):
            assert layer.chunk_rule is _torch_rule
            out = layer.norm(x, x)
            assert out.shape == x.shape and out.is_meta
        assert layer.chunk_rule is package_fn and "forward" not in vars(layer.norm)
    finally:
        del sys.modules["fake_modeling"]


_CPU_RUN = textwrap.dedent(
    """
    import torch

    from megatrain.model.kernels import kernel_report
    from megatrain.model.loading import load_causal_lm
    from megatrain.model.structure import discover

    model = load_causal_lm(None, model_type="qwen3_5_text", tiny=True, seed=0)
    print("REPORT", kernel_report(discover(model)))
    model(torch.randint(0, 100, (1, 8)))  # transformers warns at the first call
    """
)


def test_an_installed_package_that_cannot_run_here_is_named_once(tmp_path: Path) -> None:
    """flash-linear-attention installed without Triton on a machine without a GPU (the
    megatrain[hybrid] extra on a laptop): one line of ours says why the torch reference runs;
    transformers' "is not installed" is not printed."""
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text(
        "import triton_not_here  # as fla without triton\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    run = subprocess.run(
        [sys.executable, "-c", _CPU_RUN], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.stdout.split("REPORT ")[1]
    assert (
        "chunk_gated_delta_rule, fused_recurrent_gated_delta_rule: flash-linear-attention is "
        "installed, but its Triton/CUDA kernels need a CUDA GPU and none is here" in report
    )
    assert "falling back" not in run.stderr and "is not installed" not in run.stderr
