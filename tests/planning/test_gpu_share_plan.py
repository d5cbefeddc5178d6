"""The GPU update share in the plan (planning/timing.py, planning/plan.py `_share`).

On the assumed H100 test host (no GPU needed), the Qwen3-30B-A3B shape cut to 12 layers,
64k tokens a step, compiled layers, int8 states (the CPU update bounds the step: the issue's
case): the share takes its blocks' gradients off the link down and their AdamW off the CPU,
and puts their states on the link up and back, in exactly the bytes the store holds; "auto"
gives the count with the shortest predicted step, and none where the CPU does not bound it.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest

from megatrain.engine import gpu_share
from megatrain.engine.gpu_share import WORK_BYTES
from megatrain.engine.layout import SHARE_GRADS, SHARE_STAGING
from megatrain.optim.triton_adamw import takes
from megatrain.planning.estimate import SHARE_WORK
from megatrain.planning.hardware import Hardware
from megatrain.planning.layer_time import HBM_FRACTION
from megatrain.planning.optimizer_rate import optimizer_gparams_s
from megatrain.planning.ranks import Ranks
from megatrain.planning.replay import Replay
from megatrain.planning.run_shape import RunShape
from megatrain.planning.share_time import (
    GPU_FUSED_BYTES_PER_S,
    GPU_REFERENCE_BYTES_PER_PARAM,
    SHARE_CPU_SLOWDOWN,
)
from megatrain.recipes.records import report_plan
from predict import cli_row_plan
from shapes import LLAMA31_8B, QWEN3_30B_A3B_12

H100 = Hardware().with_overrides(gpu_gib=79.2, host_gib=125)
# no GPU tier: run 59's int8 rows had none (the tier took fp32 states only then), and a tier
# of int8 blocks would leave the CPU too little to bound the step
INT8 = {
    "training.compile_layers": True,
    "optimizer.state_dtype": "int8",
    "memory.gpu_state_blocks": 0,
}


def _plan(share: int | str, shape: dict[str, Any] = QWEN3_30B_A3B_12, **settings: Any) -> Any:
    return cli_row_plan(shape, H100, **{**INT8, "optimizer.gpu_update_blocks": share, **settings})


@pytest.mark.parametrize(
    "fused",
    [
        pytest.param(True, marks=pytest.mark.skipif(not takes("fp32", "int8"), reason="Triton")),
        False,
    ],
)
def test_share_moves_its_blocks_from_the_cpu_to_the_link(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two blocks (the head, then layer 11): the CPU AdamW loses exactly their time (and the
    rest runs up to SHARE_CPU_SLOWDOWN slower while the share copies), the
    gradient copies down their bf16 bytes; the share's time is their master (4 B/param), int8
    m and v (1 B/param each) and their scales (4 B per 2048 each) up at the pinned rate, the
    same and the bf16 weights back, and their AdamW:
    the fused kernel's reads and writes of all of it and of the bf16 held gradient (Triton is
    in the dev extras), or the GPU reference's bytes per parameter (REFERENCE_ONLY)."""
    monkeypatch.setattr(gpu_share, "REFERENCE_ONLY", not fused)
    base, two = _plan(0), _plan(2)
    spec = base.estimate.settings
    assert (base.engine.gpu_update_blocks, two.engine.gpu_update_blocks) == (0, 2)
    assert two.estimate.settings["gpu_update_blocks"] == 2 and spec["gpu_update_blocks"] == 0
    head = 151936 * 2048 + 2048  # lm_head and the final norm
    layer = two.estimate.layer_params_max  # every layer of the shape is the same
    params = head + layer
    rate = optimizer_gparams_s(H100, "int8") * 1e9
    t0, t2 = base.estimate.time, two.estimate.time
    h2d, d2h, hbm = H100.h2d_gbps * 1e9, H100.d2h_gbps * 1e9, H100.gpu_hbm_gbps * 1e9
    # the host updates the rest, slower over the part of its time the share's copies overlap
    rest = t0.optimizer_s - params / rate
    slower = 1 + (SHARE_CPU_SLOWDOWN - 1) * min(1.0, t2.share_s / rest)
    assert t2.optimizer_s == pytest.approx(rest * slower, rel=1e-9)
    assert t0.d2h_s - t2.d2h_s == pytest.approx(params * 2 / d2h, rel=1e-9)
    scales = sum(2 * 4 * -(-n // 2048) for n in (head, layer))
    if fused:  # master, codes, scales and the bf16 shadow read and written, the gradient read
        work = (2 * (8 * params + scales) + 2 * params) / GPU_FUSED_BYTES_PER_S
    else:
        work = params * GPU_REFERENCE_BYTES_PER_PARAM["fp32", "int8"] / (HBM_FRACTION * hbm)
    expected = (
        (6 * params + scales) / h2d  # master, codes and scales up, pinned
        + (6 * params + scales) / d2h  # and back
        + 2 * params / d2h  # the bf16 weights back (pinned)
        + work
    )
    assert t2.share_s == pytest.approx(expected, rel=1e-9)
    # the GPU: held gradients, one staging set, the reference's temporaries (none fused)
    items = two.estimate.gpu.items
    assert items.get(SHARE_WORK, 0) == (0 if fused else WORK_BYTES)
    assert SHARE_WORK not in base.estimate.gpu.items
    assert items[SHARE_GRADS] >= 2 * params and items[SHARE_STAGING] >= 6 * head
    assert t2.compute_s == t0.compute_s


def test_auto_takes_the_shortest_predicted_step() -> None:
    auto = _plan("auto")
    n = auto.engine.gpu_update_blocks
    assert n > 0 and auto.share_reason.startswith(f"GPU update share: {n} blocks")
    steps = {k: _plan(k).estimate.time.step_s for k in (0, n - 1, n, n + 1)}
    assert auto.estimate.time.step_s == steps[n] < steps[n - 1] <= steps[0]
    assert steps[n + 1] >= steps[n]  # one more no longer shortens it


def test_auto_is_none_where_the_cpu_does_not_bound_the_step() -> None:
    """Llama-3.1-8B at 64k tokens, fp32 states: GPU compute bounds the step (docs/performance.md
    run 41); on the CPU there is no GPU to share with."""
    dense = _plan(
        "auto", {"model_type": "llama", **LLAMA31_8B}, **{"optimizer.state_dtype": "fp32"}
    )
    assert dense.engine.gpu_update_blocks == 0
    on_cpu = cli_row_plan(QWEN3_30B_A3B_12, H100, "cpu", **{"optimizer.gpu_update_blocks": "auto"})
    assert on_cpu.engine.gpu_update_blocks == 0
    assert on_cpu.share_reason == "GPU update share: none (no GPU)"


def test_a_share_under_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"optimizer.gpu_update_blocks=2 under 2 ranks.*set"):
        RunShape(
            seq_len=2048,
            num_slots=2,
            layout="full",
            clip_norm=1.0,
            loss_chunk_tokens=None,
            pin_memory=True,
            check_gpu=True,
            state_dtype="fp32",
            ranks=Ranks(2),
            gpu_update_blocks=2,
        )


def test_the_printed_plan_names_the_bound_and_the_share(capsys: pytest.CaptureFixture[str]) -> None:
    """The `resources:` line a run prints names what bounds the predicted step: the CPU's
    AdamW without a share; the share's copies and GPU AdamW once it takes most blocks."""
    none, most = _plan(0), _plan(13)
    assert none.estimate.time.bound == "CPU optimizer"
    assert most.estimate.time.bound == "GPU update share"
    report_plan(_plan("auto"), gpu=True)
    out = capsys.readouterr().out
    assert "optimizer.gpu_update_blocks auto: GPU update share:" in out
    assert re.search(r"step [\d.]+ s \(predicted\), bound by (CPU optimizer|GPU update share)", out)
    report_plan(none, gpu=False)
    assert "bound by" not in capsys.readouterr().out


@pytest.mark.parametrize(("sets", "ends"), [(1, [3.0, 6.0, 9.0]), (2, [3.0, 5.0, 7.0])])
def test_replay_sends_a_share_block_up_once_its_staging_set_is_back(
    sets: int, ends: list[float]
) -> None:
    """A staging set takes a block once its previous block's copies back are done (engine/
    gpu_share.py "Staging sets"): three blocks of 1 s up and 2 s back. One set: each goes up
    after the previous one is back (3, 6, 9 s). Two: block 2 goes up while block 1 comes back,
    block 3 once block 1 is back (at 3 s, up by 4); the D2H stream then paces them (3, 5, 7)."""
    costs = SimpleNamespace(
        fwd_s=[0.0, 0.0, 0.0],
        schedule=SimpleNamespace(num_slots=1),
        share_up_s=[0.0, 1.0, 1.0, 1.0, 0.0],
        share_down_s=[0.0, 2.0, 2.0, 2.0, 0.0],
        share_sets=sets,
    )
    replay = Replay(costs)  # only the fields the share's replay reads
    replay._share_updates([(1, 0.0, 0.0), (2, 0.0, 0.0), (3, 0.0, 0.0)])
    assert replay.updated[1:4] == ends and replay.share_worker == ends[-1]
