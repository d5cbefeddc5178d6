"""What the estimate and the plan say about the GPU tier of optimizer states.

Per tier parameter: 14 GPU bytes in bf16 compute (fp32 master, m, v + the bf16 weights, which
its gradient lands in as a host block's lands in its shadow) or 16 in fp32 compute (weights =
master, m, v, fp32 gradient), and the host store's 14 (bf16) or 16 (fp32) bytes gone; per tier
layer the step loses
two weight copies, one gradient copy and one CPU AdamW pass, and gains one GPU AdamW pass.
"auto" takes the most first layers that still fit the GPU with the margin free.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from transformers import Qwen2Config

from megatrain.cli import split_overrides
from megatrain.commands.estimate import add_arguments, run
from megatrain.config.memory import MemoryConfig
from megatrain.engine.layout import TIER
from megatrain.planning import Estimate, Hardware, model_spec
from megatrain.planning.hardware import GIB
from megatrain.planning.plan import plan_resources
from megatrain.planning.run_shape import RunShape
from megatrain.planning.spec import ModelSpec
from megatrain.planning.timing import GPU_ADAMW_GPARAMS_S
from predict import cli_row_plan, predict
from shapes import GPT_OSS_20B
from shapes import QWEN25_3B as QWEN3B

H100 = Hardware()
TIER_ITEM = TIER


@pytest.fixture(scope="module")
def qwen3b() -> ModelSpec:
    return model_spec(Qwen2Config(**QWEN3B))


def _est(
    spec: ModelSpec, tier: int, dtype: str = "bf16", clipping: bool = True, grad_accum: int = 2
) -> Estimate:
    return predict(
        spec,
        seq_len=4096,
        micro_batch_size=1,
        grad_accum=grad_accum,
        compute_dtype=dtype,
        padded=False,
        clipping=clipping,
        hardware=H100,
        pin_memory=False,
        gpu_state_blocks=tier,
    )


@pytest.mark.parametrize(("dtype", "gpu_b", "host_b"), [("bf16", 14, 14), ("fp32", 16, 16)])
def test_tier_bytes_move_from_host_to_gpu(
    qwen3b: ModelSpec, dtype: str, gpu_b: int, host_b: int
) -> None:
    base, tier = _est(qwen3b, 0, dtype), _est(qwen3b, 5, dtype)
    params = 5 * qwen3b.layers[0].params
    assert tier.gpu.items[TIER_ITEM] == gpu_b * params
    assert TIER_ITEM not in base.gpu.items
    # the streamed layers are as large as before: only the tier adds to the peak
    assert tier.gpu.peak_bytes - base.gpu.peak_bytes == gpu_b * params
    assert base.host.total_bytes - tier.host.total_bytes == host_b * params
    # a tier block goes to the GPU as the store builds it (store/host.py): loading needs the
    # host bytes of the blocks that stay, or the fp32 model itself, whichever is more
    assert base.host.load_peak_bytes - tier.host.load_peak_bytes == host_b * params
    # every block in the tier: the fp32 model and a moving block's copy, or the first block
    # built (the tied embedding, 311M) whole on the host beside the rest of the model
    whole, embed, total = _est(qwen3b, 38, dtype).host, qwen3b.embed_params, qwen3b.total_params
    first = 4 * (total - embed) + host_b * embed
    model = 4 * total + whole.load_moved_bytes
    assert whole.load_peak_bytes == whole.baseline_bytes + max(model, first) > model
    assert tier.settings["gpu_state_blocks"] == 5


def test_all_layers_in_the_tier_need_no_slots(qwen3b: ModelSpec) -> None:
    est = _est(qwen3b, 36)
    assert est.settings["gpu_state_blocks"] == 36 and est.settings["num_slots"] == 0
    items = est.gpu.items
    layer = qwen3b.layers[0].params
    assert items[TIER_ITEM] == 14 * 36 * layer
    # bf16 compute: a tier layer's gradient accumulates in the shared fp32 accumulator, then
    # lands in its weights at once; with nothing streamed one accumulator and no bf16 staging
    assert items["gradient accumulators (fp32)"] == 4 * layer
    assert "weight slots" not in items and "gradient staging (bf16)" not in items


def test_embedding_and_head_join_after_the_layers(qwen3b: ModelSpec) -> None:
    layers, whole = _est(qwen3b, 36), _est(qwen3b, 99)
    assert whole.settings["gpu_state_blocks"] == 38  # 36 layers, embedding, head
    table, head = qwen3b.embed_params, qwen3b.head_params  # tied: the head is the final norm
    # 14 B/param of tier, less the tied table's and the head's bf16 copies (2) the GPU had
    # already: +12 B/param; the fp32 gradients stay (bf16 compute: they land in the weights)
    assert whole.gpu.peak_phase == layers.gpu.peak_phase
    assert whole.gpu.peak_bytes - layers.gpu.peak_bytes == 12 * (table + head)
    for gone in ("head weights", "tied lm_head table"):
        assert gone not in whole.gpu.items
    assert whole.gpu.items["head gradient (fp32)"] == 4 * head
    assert whole.gpu.items["embedding gradient (fp32)"] == 4 * table
    assert layers.host.total_bytes - whole.host.total_bytes == 14 * (table + head)
    t = whole.time  # nothing crosses PCIe, nothing waits for the CPU
    assert t.optimizer_s == t.h2d_s == t.d2h_s == 0.0
    gpu_rate = GPU_ADAMW_GPARAMS_S * 1e9
    assert t.gpu_optimizer_s == pytest.approx(qwen3b.total_params / gpu_rate)
    assert t.step_s == pytest.approx(t.compute_s + t.gpu_optimizer_s, rel=0.05)


@pytest.mark.parametrize("clipping", [True, False])
def test_tier_takes_copies_and_cpu_updates_off_the_step(qwen3b: ModelSpec, clipping: bool) -> None:
    k, layer = 8, qwen3b.layers[0].params
    # 4k tokens per step: at 8k the default host's AdamW (5.2 Gparams/s) keeps up with compute
    base = _est(qwen3b, 0, clipping=clipping, grad_accum=1).time
    tier = _est(qwen3b, k, clipping=clipping, grad_accum=1).time
    cpu_rate, link = H100.optimizer_gparams_s * 1e9, H100.h2d_gbps * 1e9
    assert tier.optimizer_s == pytest.approx(base.optimizer_s - k * layer / cpu_rate)
    assert tier.h2d_s == pytest.approx(base.h2d_s - 2 * k * layer * 2 / link)  # up twice
    assert tier.d2h_s == pytest.approx(base.d2h_s - k * layer * 2 / (H100.d2h_gbps * 1e9))
    assert tier.gpu_optimizer_s == pytest.approx(k * layer / (GPU_ADAMW_GPARAMS_S * 1e9))
    assert base.gpu_optimizer_s == 0.0 and tier.compute_s == base.compute_s
    # 4k tokens per step of a 3B model wait on the CPU optimizer: the tier shortens the step
    assert base.bound == "CPU optimizer"
    assert tier.step_s < base.step_s - 0.5 * k * layer / cpu_rate


def _shape(tier: int | str, check_gpu: bool = True) -> RunShape:
    return RunShape(
        seq_len=4096,
        num_slots=2,
        layout="full",
        clip_norm=1.0,
        loss_chunk_tokens=None,
        pin_memory=False,
        check_gpu=check_gpu,
        state_dtype="fp32",
        gpu_state_blocks=tier,
    )


def test_auto_takes_the_most_layers_that_fit(qwen3b: ModelSpec) -> None:
    hw = dataclasses.replace(H100, gpu_bytes=24 * GIB)
    plan = plan_resources(
        qwen3b,
        _shape("auto"),
        hardware=hw,
        micro_batch_size=1,
        grad_accum=2,
        gpu_margin_gib=2,
        host_margin_gib=4,
    )
    k, budget = plan.gpu_state_blocks, hw.gpu_bytes - 2 * GIB
    assert 0 < k < 36 and plan.fits
    assert plan.estimate.gpu.peak_bytes <= budget
    one_more = _est(qwen3b, k + 1)
    assert one_more.gpu.peak_bytes > budget
    assert plan.tier_reason is not None and f"GPU tier: {k} of 38 blocks" in plan.tier_reason
    # on the CPU there is no tier; a given count is clamped to the model
    on_cpu = plan_resources(
        qwen3b,
        _shape("auto", False),
        hardware=hw,
        micro_batch_size=1,
        grad_accum=2,
        gpu_margin_gib=2,
        host_margin_gib=4,
    )
    assert on_cpu.gpu_state_blocks == 0
    given = plan_resources(
        qwen3b,
        _shape(99),
        hardware=hw,
        micro_batch_size=1,
        grad_accum=2,
        gpu_margin_gib=2,
        host_margin_gib=4,
    )
    assert given.gpu_state_blocks == 38 and given.tier_reason is None


def test_estimate_command_reports_the_tier(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model-type", "llama", "--tiny", "--seq-len", "64", "--gpu-gib", "80"]
    overrides, rest = split_overrides(argv)
    args = parser.parse_args(rest)
    args.overrides = overrides
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "GPU tier  5 blocks" in out  # the tiny llama fits whole: 3 layers, embed, head
    assert "auto GPU tier: 5 of 5 blocks" in out


@pytest.mark.parametrize("value", [-1, "many", 1.5])
def test_bad_gpu_state_blocks_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"memory\.gpu_state_blocks"):
        MemoryConfig(gpu_state_blocks=value).validate()  # type: ignore[arg-type]  # wrong on purpose


def test_the_tier_at_load_lets_gpt_oss_20b_whole_with_bf16_states_fit_an_h200_host() -> None:
    """GPT-OSS-20B whole (20.9B) with bf16 states on one H200 (139 GiB) and a 125 GiB host:
    10 B/param on the host would be 210 GB. Its tier blocks go to the GPU as the store builds
    them, so loading needs no more than the store keeps (and the fp32 model, 78 GiB), and "auto"
    trades tier blocks for the update share only while the host holds what they give up: the
    plan fits, where before both the load (200 GiB) and the traded tier (120 GiB) overran."""
    h200 = Hardware(gpu_name="NVIDIA H200").with_overrides(gpu_gib=139, host_gib=125)
    plan = cli_row_plan(
        GPT_OSS_20B,
        h200,
        **{"optimizer.state_dtype": "bf16", "optimizer.gpu_update_blocks": "auto"},
    )
    host, room = plan.estimate.host, (125 - MemoryConfig().host_margin_gib) * GIB
    assert plan.problems == ()
    assert host.total_bytes <= host.load_peak_bytes <= room
    assert 4 * plan.estimate.total_params < host.load_peak_bytes  # the store's, not the model's
    # fewer tier blocks would leave more on the host than it holds
    fewer = cli_row_plan(
        GPT_OSS_20B,
        h200,
        **{
            "optimizer.state_dtype": "bf16",
            "memory.gpu_state_blocks": plan.engine.gpu_state_blocks - 2,
        },
    )
    assert fewer.problems and "host RAM" in fewer.problems[0]
