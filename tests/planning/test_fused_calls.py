"""A kernel package's call counted for time as its fused kernels (planning/fused.py): the ops of
the torch reference the meta profile runs in its place leave the time counts (launches and
traffic, forward and backward) but not the memory, which is the reference's, or fla's call's
where planning/kernel_memory.py models it; the call counts as FUSED_LAUNCHES kernels that move
its inputs and outputs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fake_fla import run_with_fake_fla
from megatrain.planning.activations import _LiveBytes
from megatrain.planning.fused import FUSED_LAUNCHES

_N = 1000


def _reference(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Many small ops; `a` and `y` used twice (the engine adds their gradients)."""
    y = a * w
    return (y.sin() + y.cos() + a).exp()


def _one_kernel(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One op moving exactly the inputs and output; its backward, twice that."""
    return a * w


def _track(fn: Callable[..., torch.Tensor], fused: bool) -> tuple[int, int, int, int, int]:
    """(forward ops, forward traffic, all ops, all traffic, peak) of `fn` between an op before
    it and one after, forward and backward, as the layer profile tracks them."""
    tracker = _LiveBytes()
    x = torch.empty(_N, device="meta", requires_grad=True)
    w = torch.empty(_N, device="meta", requires_grad=True)
    call = tracker.fused.wrap(fn) if fused else fn
    with torch.enable_grad(), tracker:
        out = call(x * 3, w).sum()
        forward = tracker.ops, tracker.traffic
        grads = torch.autograd.grad([out], [x, w])
        del out, grads
    return (*forward, tracker.ops, tracker.traffic, tracker.peak)


def test_a_fused_call_counts_its_kernels_not_its_reference() -> None:
    fused, plain = _track(_reference, fused=True), _track(_reference, fused=False)
    assert fused[:4] == _track(_one_kernel, fused=True)[:4]  # whatever the reference runs
    assert fused[4] == plain[4]  # memory: the reference's
    assert fused[3] < plain[3] / 3  # the reference's intermediates are not moved
    one = _track(_one_kernel, fused=False)  # a mul: its inputs and output, backward twice that
    forward, backward = FUSED_LAUNCHES
    assert fused[:4] == (one[0] - 1 + forward, one[1], one[2] - 3 + forward + backward, one[3])


_PROFILE = textwrap.dedent(
    """
    import torch

    from megatrain.distributed import Placement
    from megatrain.planning import activations
    from megatrain.planning.builder import PlanBuilder
    from megatrain.verify import verify_config

    cfg = verify_config(None, [], model_type="qwen3_5_text", tiny=True)
    spec = PlanBuilder(cfg, placement=Placement(torch.device("cpu"))).spec
    peaks = [0] * len(spec.layers)  # each layer group's first layer's peak
    measure = activations._measure

    def measured(spec, call, layer, rows, seq):
        m = measure(spec, call, layer, rows, seq)
        peaks[next(i for i, x in enumerate(spec.structure.layers) if x is layer)] = m.peak
        return m

    activations._measure = measured
    profile = activations.layer_profile(spec, 2, 512, "full")
    print("LINEAR", [la.attn_heads == 0 for la in spec.layers])
    print("PEAKS", peaks)
    print("OPS", profile.ops)
    print("TRAFFIC", [list(t) for t in profile.traffic])
    """
)


def _profile(out: str) -> tuple[Any, ...]:
    """(linear, peaks, ops, traffic) printed by _PROFILE."""
    keys = ("LINEAR", "PEAKS", "OPS", "TRAFFIC")
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(keys))
    linear, peaks, ops, traffic = (lines[k] for k in keys)
    return eval(linear), eval(peaks), eval(ops), [tuple(t) for t in eval(traffic)]


_REFUSED = 'from megatrain.model import kernels\nkernels.refusals = lambda: {"fla": "refused"}\n'


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="needs fla absent")
def test_a_layer_profiled_with_fla_counts_its_fused_kernels(tmp_path: Path) -> None:
    """Tiny Qwen3.5, 2 x 512 tokens: with (a stand-in for) flash-linear-attention installed the
    Gated DeltaNet layers' time counts drop and their memory is fla's call's
    (planning/kernel_memory.py), below the reference's; the full attention layers do not
    change; a refused fla (the run falls back to the reference) counts as the reference, as
    without it."""
    linear, peaks, ops, traffic = _profile(run_with_fake_fla(tmp_path, _PROFILE))
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # without it: the reference
        exec(_PROFILE, {})
    reference = _profile(printed.getvalue())
    assert _profile(run_with_fake_fla(tmp_path, _REFUSED + _PROFILE)) == reference
    linear_ref, peaks_ref, ops_ref, traffic_ref = reference
    assert linear == linear_ref and any(linear) and not all(linear)
    for i, is_linear in enumerate(linear):
        if not is_linear:
            assert (peaks[i], ops[i], traffic[i]) == (peaks_ref[i], ops_ref[i], traffic_ref[i])
            continue
        assert 0 < peaks[i] < peaks_ref[i] or peaks[i] == peaks_ref[i] == 0  # groups' first
        assert ops[i][1] < ops_ref[i][1] / 3 and traffic[i][1] < traffic_ref[i][1] / 3
        assert ops[i][0] < ops_ref[i][0] / 3 and traffic[i][0] < traffic_ref[i][0] / 2
