"""Resource estimate: byte arithmetic against hand-computed numbers, the H200 measurements of
the Qwen2.5-3B shape, the automatic micro-batch size, the fit check, and real RSS / GPU peaks
of the engine (CPU here; the `gpu` test on a CUDA machine)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from megatrain.model.tiny import TESTED_MODEL_TYPES, tiny_config
from megatrain.planning import (
    Hardware,
    check_fits,
    detect,
    model_spec,
    probe,
)
from megatrain.planning.activations import layer_profile, loss_chunk
from megatrain.planning.hardware import GIB, gib, hbm_gbps
from megatrain.planning.layer_time import attention_flops_per_token
from predict import pick_batch, predict
from shapes import QWEN25_3B as QWEN3B

# tiny llama (model/tiny.py): V=256, D=64, FF=128, L=3, 4 heads, 2 kv heads, head_dim 16
V, D, FF, L = 256, 64, 128, 3
LAYER = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 3 * D * FF + 2 * D  # q, k+v, o, MLP, two norms
EMBED = V * D

# the H200 run the Qwen2.5-3B shape (QWEN3B) was measured on, 2026-11-26 (brief of the estimator)
H200_RUN = Hardware(
    gpu_name="NVIDIA H200",
    gpu_bytes=139 * GIB,
    gpu_tflops_bf16=790.0,
    achieved_fraction=400 / 790,
    optimizer_gparams_s=2.2,
)


@pytest.fixture(scope="module")
def qwen3b() -> object:
    return model_spec(Qwen2Config(**QWEN3B))


def _llama(**overrides: object) -> object:
    return model_spec(tiny_config("llama", **overrides))


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_of_tiny_llama(tied: bool) -> None:
    spec = _llama(tie_word_embeddings=tied)
    head = D + (0 if tied else V * D)  # final norm (+ untied lm_head)
    assert [la.params for la in spec.layers] == [LAYER] * L
    assert (spec.embed_params, spec.head_params, spec.tied) == (EMBED, head, tied)
    assert spec.total_params == EMBED + L * LAYER + head == spec.active_params
    assert (spec.vocab_size, spec.hidden_size, spec.layer_params_max) == (V, D, LAYER)


def test_moe_counts_routed_experts_at_top_k_over_experts() -> None:
    spec = model_spec(tiny_config("qwen3_moe"))  # 4 experts, 2 per token, expert I=32
    attention = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16  # + q/k norms of head_dim 16
    experts = 4 * (2 * 32 * 64) + 4 * (64 * 32)  # fused gate_up and down
    router, norms = 4 * 64, 2 * 64
    layer = attention + experts + router + norms
    assert [la.params for la in spec.layers] == [layer] * 3
    assert [la.active_params for la in spec.layers] == [layer - experts + experts // 2] * 3
    assert spec.total_params - spec.active_params == 3 * experts // 2


@pytest.mark.parametrize("dtype,per_param", [("bf16", 14), ("fp32", 16)])
def test_host_store_bytes_per_parameter(dtype: str, per_param: int) -> None:
    spec = _llama()
    hw = Hardware(process_baseline_bytes=GIB)
    est = predict(
        spec, seq_len=32, micro_batch_size=2, compute_dtype=dtype, hardware=hw, data_bytes=123
    )
    host = est.host
    assert host.store_bytes == per_param * spec.total_params
    assert host.pinned_bytes == (2 if dtype == "bf16" else 8) * spec.total_params
    blocks = [EMBED, LAYER, LAYER, LAYER, D + V * D]
    pinned = [2 * n for n in blocks] if dtype == "bf16" else [4 * n for n in blocks] * 2
    pow2 = [1 << (b - 1).bit_length() for b in pinned]  # torch's pinned caching allocator
    assert host.pinned_reserved_bytes == sum(pow2)
    assert host.total_bytes == host.pageable_bytes + sum(pow2) + GIB + 123
    unpinned = predict(
        spec, seq_len=32, micro_batch_size=2, compute_dtype=dtype, hardware=hw, pin_memory=False
    ).host
    assert unpinned.pinned_reserved_bytes == unpinned.pinned_bytes


@pytest.mark.parametrize("dtype,c", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("tied", [False, True])
def test_gpu_persistent_and_boundary_bytes(dtype: str, c: int, tied: bool) -> None:
    spec = _llama(tie_word_embeddings=tied)
    rows, seq, ga, slots = 2, 32, 3, 2
    tokens = rows * seq * ga
    items = predict(
        spec,
        seq_len=seq,
        micro_batch_size=rows,
        grad_accum=ga,
        compute_dtype=dtype,
        num_slots=slots,
        padded=False,
    ).gpu.items
    assert items["weight slots"] == slots * LAYER * c
    assert items["gradient accumulators (fp32)"] == 2 * LAYER * 4
    assert items.get("gradient staging (bf16)", 0) == (2 * LAYER * 2 if c == 2 else 0)
    assert items.get("tied lm_head table", 0) == (EMBED * c if tied else 0)
    assert items["head gradient (fp32)"] == spec.head_params * 4
    assert items["embedding gradient (fp32)"] == EMBED * 4
    assert items["boundary activations"] == L * tokens * D * c
    assert items["last hidden / its gradient"] == tokens * D * c
    assert items["embedding rows"] == ga * min(rows * seq, V) * D * c


def test_padding_masks_cost_rows_x_seq_squared_per_micro_batch() -> None:
    spec = _llama()
    rows, seq = 3, 40
    full = layer_profile(spec, rows, seq, "full").captured_bytes
    padded = layer_profile(spec, rows, seq, "padded").captured_bytes
    assert padded - full == rows * seq * seq  # one bool [rows, 1, seq, seq] mask (sdpa)
    cos_sin = 2 * seq * 16 * 2  # [1, seq, head_dim] bf16, shared by the rows
    assert full == cos_sin + seq * 8  # + position ids [1, seq] int64


def test_layer_transient_holds_the_mlp_and_grows_with_tokens() -> None:
    spec = _llama(intermediate_size=1024)  # MLP-dominated layer
    rows, seq = 2, 256
    peak = layer_profile(spec, rows, seq, "full").peak_bytes
    layer = spec.layer_params_max
    saved_mlp = 4 * rows * seq * 1024 * 2  # gate, up, act(gate), act * up in bf16
    assert saved_mlp + layer * 2 < peak < 2 * saved_mlp + 20 * rows * seq * D * 2 + layer * 2
    twice = layer_profile(spec, 2 * rows, seq, "full").peak_bytes
    assert 1.8 * (peak - layer * 2) < twice - layer * 2 < 2.2 * (peak - layer * 2)


@pytest.mark.parametrize("model_type", TESTED_MODEL_TYPES)
def test_every_tested_architecture_estimates(model_type: str) -> None:
    config = tiny_config(model_type)
    real = AutoModelForCausalLM.from_config(config)
    est = predict(config, seq_len=32, micro_batch_size=2, grad_accum=2, padded=True)
    assert est.total_params == sum(p.numel() for p in real.parameters())
    assert est.host.store_bytes == 14 * est.total_params
    assert est.gpu.peak_bytes > 0 and est.time.step_s > 0


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral", "gemma2", "phi3"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["full", "padded", "packed"])
def test_every_attention_path_measures(model_type: str, dtype: str, layout: str) -> None:
    """fp32 and bf16, with and without masks, grouped-query or not (tiny phi3 has 4 kv heads
    for 4 heads): each sdpa backend branch runs on meta and keeps at least the saved MLP."""
    spec = model_spec(
        tiny_config(model_type, num_key_value_heads=4 if model_type == "phi3" else 2), dtype
    )
    c = 2 if dtype == "bf16" else 4
    rows, seq = 2, 64
    profile = layer_profile(spec, rows, seq, layout)
    assert profile.peak_bytes > 3 * rows * seq * FF * c
    assert all(f > 10 and b > f for f, b in profile.ops)


def test_loss_chunk_holds_logits_and_the_head_gradient() -> None:
    spec = _llama()
    chunk = 100
    peak, ops, largest = loss_chunk(spec, chunk)
    assert 10 < ops < 200
    head_grad = V * D * 2
    assert chunk * V * 4 * 2 + head_grad < peak < chunk * V * 20 + head_grad * 2
    assert largest == max(chunk * V * 4, head_grad)  # the fp32 logits or the head's gradient


def test_qwen25_3b_matches_the_h200_measurements(qwen3b: object) -> None:
    cases = [(1, 5.77, 1.52), (4, 9.33, 2.21)]  # micro-batches of 4 x 2048, full rows
    for grad_accum, gpu_gib, step_s in cases:
        # that run's engine cut the loss into 1 GiB chunks (588 tokens at this vocabulary)
        est = predict(
            qwen3b,
            seq_len=2048,
            micro_batch_size=4,
            grad_accum=grad_accum,
            padded=False,
            clipping=False,
            hardware=H200_RUN,
            loss_chunk_tokens=588,
        )
        assert est.gpu.peak_bytes / GIB == pytest.approx(gpu_gib, rel=0.15)
        assert est.host.total_bytes / GIB == pytest.approx(46.2, rel=0.15)
        assert est.time.step_s == pytest.approx(step_s, rel=0.25)
    assert est.total_params == pytest.approx(3.086e9, rel=1e-3)
    assert est.time.bound == "GPU compute"
    one = predict(
        qwen3b, seq_len=2048, micro_batch_size=4, padded=False, clipping=False, hardware=H200_RUN
    )
    assert one.time.bound == "CPU optimizer"
    assert one.time.compute_s == pytest.approx(0.52, rel=0.1)
    assert one.time.optimizer_s == pytest.approx(3.086 / 2.2, rel=0.01)
    assert one.time.model_tflops == pytest.approx(
        6 * one.active_params * one.time.tokens_per_s / 1e12
    )


def test_clipping_delays_the_optimizer_and_slows_an_optimizer_bound_step(qwen3b: object) -> None:
    kwargs = dict(seq_len=2048, micro_batch_size=4, padded=False, hardware=H200_RUN)
    free = predict(qwen3b, clipping=False, **kwargs).time
    clipped = predict(qwen3b, clipping=True, **kwargs).time
    assert clipped.step_s > free.step_s + 0.2
    fast_cpu = dataclasses.replace(H200_RUN, optimizer_gparams_s=100.0)
    compute_bound = predict(
        qwen3b, clipping=False, grad_accum=8, **{**kwargs, "hardware": fast_cpu}
    ).time
    assert compute_bound.step_s == pytest.approx(compute_bound.compute_s, rel=0.08)


def test_attention_flops_cap_sliding_windows() -> None:
    spec = model_spec(tiny_config("gemma3_text"))  # sliding window 8 on some layers
    windowed = [la for la in spec.layers if la.window is not None]
    full = [la for la in spec.layers if la.window is None]
    assert windowed and full
    heads, dim = full[0].attn_heads, full[0].attn_qk_dim + full[0].attn_v_dim
    assert attention_flops_per_token(full[0], 1000) == pytest.approx(2 * 500.5 * heads * dim)
    w = windowed[0].window
    assert w is not None
    per = attention_flops_per_token(windowed[0], 1000)
    assert per == pytest.approx(2 * (w * (w + 1) / 2 + (1000 - w) * w) / 1000 * heads * dim)


def test_pick_micro_batch_is_monotonic_and_keeps_the_margin() -> None:
    spec = _llama(hidden_size=256, intermediate_size=1024, vocab_size=4096, head_dim=64)
    seq, tokens = 512, 512 * 64

    def peak(b: int) -> int:
        return predict(
            spec, seq_len=seq, micro_batch_size=b, grad_accum=64 // b, padded=True
        ).gpu.peak_bytes

    margin = 0.25
    exact = Hardware(gpu_bytes=int(peak(8) + margin * GIB))
    b, ga, reason = pick_batch(
        spec, seq_len=seq, tokens_per_step=tokens, hardware=exact, gpu_margin_gib=margin
    )
    assert (b, ga) == (8, 8)
    assert f"predicted GPU peak {gib(peak(8))}" in reason
    assert f"16 would need {gib(peak(16))}" in reason
    short = dataclasses.replace(exact, gpu_bytes=exact.gpu_bytes - 1)
    assert pick_batch(
        spec, seq_len=seq, tokens_per_step=tokens, hardware=short, gpu_margin_gib=margin
    )[:2] == (4, 16)
    picks = [
        pick_batch(
            spec,
            seq_len=seq,
            tokens_per_step=tokens,
            gpu_margin_gib=margin,
            hardware=Hardware(gpu_bytes=int(g * GIB)),
        )[0]
        for g in (0.45, 0.6, 1.0, 1.5, 2.5)
    ]
    assert picks == sorted(picks) and picks[0] < picks[-1] == 64
    for g, b in zip((0.45, 0.6, 1.0, 1.5, 2.5), picks, strict=True):
        assert peak(b) <= (g - margin) * GIB
    b, ga, _ = pick_batch(
        spec,
        seq_len=seq,
        grad_accum=2,
        hardware=exact,
        gpu_margin_gib=margin,
        max_micro_batch_size=32,
    )
    assert ga == 2 and b in (1, 2, 4, 8, 16, 32)
    with pytest.raises(ValueError, match="no micro-batch size fits"):
        pick_batch(
            spec,
            seq_len=seq,
            tokens_per_step=tokens,
            gpu_margin_gib=margin,
            hardware=Hardware(gpu_bytes=int(0.3 * GIB)),
        )


def test_pick_micro_batch_on_the_cpu_sizes_against_host_ram() -> None:
    """A CPU run's step buffers are host memory: they must fit beside the store and data."""
    spec = _llama(hidden_size=256, intermediate_size=1024, vocab_size=4096, head_dim=64)
    seq, tokens, margin = 512, 512 * 64, 4.0

    def need(b: int) -> int:
        est = predict(spec, seq_len=seq, micro_batch_size=b, grad_accum=64 // b, padded=True)
        return est.gpu.peak_bytes + est.host.total_bytes

    host = Hardware(gpu_bytes=1, host_bytes=int(need(8) + margin * GIB))  # no GPU: 1 byte
    b, ga, reason = pick_batch(
        spec, seq_len=seq, tokens_per_step=tokens, hardware=host, gpu_margin_gib=2,
        on_host=True, host_margin_gib=margin,
    )  # fmt: skip
    assert (b, ga) == (8, 8)
    assert f"predicted host RAM (a CPU run) peak {gib(need(8))} of {gib(host.host_bytes)}" in reason
    assert f"16 would need {gib(need(16))}" in reason and "GPU" not in reason
    _, _, on_gpu = pick_batch(
        spec, seq_len=seq, tokens_per_step=tokens, hardware=Hardware(), gpu_margin_gib=2
    )
    assert "predicted GPU peak" in on_gpu and "of an assumed 80.0 GiB" in on_gpu


def test_check_fits_names_the_numbers_and_the_fix(qwen3b: object) -> None:
    est = predict(qwen3b, seq_len=2048, micro_batch_size=4, padded=False, hardware=H200_RUN)
    check_fits(est, H200_RUN, host_margin_gib=4, gpu_margin_gib=2)  # fits: no error
    small = dataclasses.replace(H200_RUN, host_bytes=32 * GIB, gpu_bytes=5 * GIB)
    with pytest.raises(ValueError) as err:
        check_fits(est, small, host_margin_gib=4, gpu_margin_gib=2)
    msg = str(err.value)
    assert f"predicted {est.host.total_bytes / GIB:.1f} GiB" in msg
    assert "14 B/param x 3.09B params" in msg and "28.0 GiB available" in msg
    assert f"predicted peak {est.gpu.peak_bytes / GIB:.1f} GiB > 3.0 GiB available" in msg
    assert "micro_batch_size" in msg and "num_slots" in msg
    fp32 = predict(
        qwen3b, seq_len=2048, micro_batch_size=4, compute_dtype="fp32", hardware=H200_RUN
    )
    with pytest.raises(ValueError, match=r"bf16 compute \(14 instead of 16 B/param\)"):
        check_fits(fp32, small, host_margin_gib=4, gpu_margin_gib=2)


def test_hardware_detect_and_probe_on_this_machine() -> None:
    hw = detect(host_gib=64.0)
    assert hw.host_bytes == 64 * GIB and "host_bytes" in hw.measured
    if not torch.cuda.is_available():
        assert hw.gpu_bytes == 80 * GIB and hw.source("gpu_bytes") == "assumed"
    measured = probe(optimizer_params=25_000_000)
    assert measured.optimizer_gparams_s > 0.01
    assert "optimizer_gparams_s" in measured.measured


@pytest.mark.parametrize(
    ("name", "gbps"),
    [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H100 NVL", 3900.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA GH200 480GB", 4000.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100-SXM4-40GB", 1555.0),
        ("NVIDIA GeForce RTX 4090", None),  # unknown: detect keeps the default (H100 SXM)
    ],
)
def test_detect_takes_the_gpus_datasheet_bandwidth(name: str, gbps: float | None) -> None:
    assert hbm_gbps(name) == gbps
    assert Hardware().gpu_hbm_gbps == hbm_gbps(Hardware().gpu_name)  # the default is the H100's


# Runs the engine in a fresh process (clean RSS) and prints what it measured, one JSON line.
_ENGINE_RUN = """
import json, statistics, sys, time
import psutil, torch, transformers
from megatrain.batch import Batch
from megatrain.engine.engine import StreamingEngine
from megatrain.engine.head import default_chunk_tokens
from megatrain.engine.plan import EnginePlan
from megatrain.model.structure import discover
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.store.host import HostStore

a = json.loads(sys.argv[1])
cuda = a["device"] == "cuda"
cfg = getattr(transformers, a["config_class"])(**a["config"])
proc = psutil.Process()
base = proc.memory_info().rss
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
store = HostStore(discover(model), compute_dtype=getattr(torch, a["dtype"]), pin_memory=cuda)
if cuda:
    torch.cuda.reset_peak_memory_stats()
plan = EnginePlan(num_slots=2, clip_norm=a["max_grad_norm"] or None,
                  loss_chunk_tokens=default_chunk_tokens(cfg.vocab_size))
engine = StreamingEngine(store.structure, store, CpuAdamW(AdamWHyper()), plan, device=a["device"],
                         threaded_optimizer=cuda)
gen = torch.Generator().manual_seed(0)
phases = []
for rows, seq, micro in a["phases"]:
    batches = []
    for _ in range(micro):
        ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=gen)
        labels, mask = ids.clone(), None
        if a["padded"]:
            mask = torch.ones_like(ids)
            mask[-1, seq - seq // 4:] = 0
            labels[-1, seq - seq // 4:] = -100
        batches.append(Batch(ids, labels, mask))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, opt = [], []
    for _ in range(a["steps"]):
        t0 = time.perf_counter()
        opt.append(engine.train_step(batches, lr=1e-5).timeline.optimizer_s)
        times.append(time.perf_counter() - t0)
    phases.append(dict(step_s=statistics.median(times[2:]), rss=proc.memory_info().rss,
                       optimizer_s=statistics.median(opt[2:]),
                       rss_delta=proc.memory_info().rss - base,
                       gpu_peak=torch.cuda.max_memory_allocated() if cuda else 0))
engine.close()
print(json.dumps(dict(phases=phases)))
"""


def _run_engine(**kwargs: object) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE_RUN, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


_SMALL_LLAMA = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_engine_on_cpu_uses_the_predicted_host_ram(dtype: str) -> None:
    """On the CPU the store is all host RAM and so are the 'GPU' buffers: after the steps the
    process's RSS growth (the allocator keeps what the step's peak took) is the store plus the
    GPU-side peak, within 15%. Not before the first step: the Adam states are zero pages that
    the first update touches (store/memory.py). bf16 with 8x fewer tokens: torch's CPU bf16
    matmuls run at 0.4-2 GFLOP/s on hosts without native bf16 (AMD EPYC, AVX2, 2026-11-29;
    fp32 60-100), and the case took 430 s at fp32's shape; the store, which this checks, is
    the same."""
    rows, seq, micro = (2, 128, 2) if dtype == "fp32" else (1, 64, 1)
    r = _run_engine(
        config_class="LlamaConfig",
        config=_SMALL_LLAMA,
        device="cpu",
        dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
        max_grad_norm=0.0,
        padded=False,
        steps=3,
        phases=[[rows, seq, micro]],
    )
    est = predict(
        LlamaConfig(**_SMALL_LLAMA),
        seq_len=seq,
        micro_batch_size=rows,
        grad_accum=micro,
        compute_dtype=dtype,
        padded=False,
        pin_memory=False,
    )
    assert est.host.store_bytes + est.gpu.peak_bytes == pytest.approx(
        r["phases"][0]["rss_delta"], rel=0.15
    )


_GPU_CASES = [  # (config class, config, dtype, padded, max_grad_norm, [(rows, seq, micro)])
    ("Qwen2Config", QWEN3B, "bf16", False, 0.0, [(4, 2048, 1), (4, 2048, 4)]),
    (
        "Qwen3MoeConfig",
        dict(
            hidden_size=1024,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=32000,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=512,
        ),
        "bf16",
        True,
        1.0,
        [(2, 1024, 2)],
    ),
    (
        "LlamaConfig",
        dict(_SMALL_LLAMA, hidden_size=1024, intermediate_size=2816),
        "fp32",
        True,
        1.0,
        [(2, 1024, 2)],
    ),
    # held out: not used to set any default (op_launch_s, achieved_fraction_fp32)
    (
        "MixtralConfig",
        dict(
            hidden_size=1024,
            intermediate_size=1792,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "bf16",
        True,
        1.0,
        [(2, 2048, 2)],
    ),
    (
        "Qwen3Config",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32000,
        ),
        "fp32",
        False,
        0.0,
        [(1, 4096, 2)],
    ),
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("case", _GPU_CASES, ids=[c[0] for c in _GPU_CASES])
def test_estimate_matches_the_engine_on_this_gpu(case: tuple, probed: Hardware) -> None:
    """Predicted GPU peak and host RSS within 15% of the measured ones, step time within 25%
    (30% for MoE: the host time of the routing code is under-modelled, see below), with this
    machine's probed rates. Last run, H200, 2026-11-26, measured / predicted: Qwen2.5-3B
    4x2048x1 7.19/7.11 GiB, RSS 46.4/46.2 GiB, 1.34/1.39 s; x4 10.76/10.68 GiB, 2.16/2.27 s;
    Qwen3-MoE 1.91/1.99 GiB, 8.48/8.29 GiB, 0.330/0.298 s; llama fp32 1.44/1.59 GiB,
    4.26/4.39 GiB, 0.162/0.164 s; held out: Mixtral 2.57/2.75 GiB, 7.89/7.73 GiB,
    0.358/0.266 s (-26%; -22% the run before); Qwen3 fp32 6.64/5.81 GiB, 10.56/10.68 GiB,
    1.01/0.96 s."""
    config_class, config, dtype, padded, max_grad_norm, phases = case
    r = _run_engine(
        config_class=config_class,
        config=config,
        device="cuda",
        dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
        max_grad_norm=max_grad_norm,
        padded=padded,
        steps=6,
        phases=phases,
    )
    import transformers

    spec = model_spec(getattr(transformers, config_class)(**config), dtype)
    for (rows, seq, micro), got in zip(phases, r["phases"], strict=True):
        est = predict(
            spec,
            seq_len=seq,
            micro_batch_size=rows,
            grad_accum=micro,
            padded=padded,
            clipping=max_grad_norm > 0,
            hardware=probed,
        )
        print(
            f"{config_class} {rows}x{seq}x{micro}: GPU {got['gpu_peak'] / GIB:.2f} GiB "
            f"(predicted {est.gpu.peak_bytes / GIB:.2f}), RSS {got['rss'] / GIB:.2f} GiB "
            f"({est.host.total_bytes / GIB:.2f}), step {got['step_s']:.3f} s "
            f"({est.time.step_s:.3f}); optimizer {got['optimizer_s']:.3f} s "
            f"({est.time.optimizer_s:.3f})"
        )
        assert est.gpu.peak_bytes == pytest.approx(got["gpu_peak"], rel=0.15)
        assert est.host.total_bytes == pytest.approx(got["rss"], rel=0.15)
        moe = spec.active_params < spec.total_params
        assert est.time.step_s == pytest.approx(got["step_s"], rel=0.30 if moe else 0.25)


@pytest.fixture(scope="module")
def probed() -> Hardware:
    hw = probe()
    print(f"probed: {hw}")
    return hw
