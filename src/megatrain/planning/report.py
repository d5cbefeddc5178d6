"""A human-readable table of an Estimate (what `megatrain estimate` prints)."""

from __future__ import annotations

from megatrain.disk_space import EXPORT_BYTES_PER_PARAM
from megatrain.engine.tiling import TilePolicy
from megatrain.planning.disk import checkpoint_bytes_per_param
from megatrain.planning.estimate import Estimate
from megatrain.planning.hardware import GIB
from megatrain.planning.optimizer_rate import optimizer_gparams_s
from megatrain.planning.store_table import StoreTable
from megatrain.store.grads import gradient_hold

_W = 44  # label column


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<{_W}}{value:>10}  {note}".rstrip()


def format_estimate(
    est: Estimate, export_dtype: str | None = "bf16", layouts: StoreTable | None = None
) -> str:
    """The table: the setup, then host RAM, GPU peak, step time, the host store's layouts (when
    given: planning/store_table.py) and disk, then the notes. `export_dtype`:
    checkpoint.export_dtype of the Hugging Face export (None: no export)."""
    lines = [
        *_setup_lines(est),
        "",
        *_host_lines(est),
        "",
        *_gpu_lines(est),
        "",
        *_time_lines(est),
        "",
        *([*layouts.lines(), ""] if layouts else []),
        *_disk_lines(est, export_dtype),
        "",
        *(f"note: {n}" for n in (*est.advice, *est.notes)),
    ]
    return "\n".join(lines)


def _setup_lines(est: Estimate) -> list[str]:
    s = est.settings
    layout = {"full": "full rows", "padded": "padded rows (4-D masks)", "packed": "packed rows"}[
        s["layout"]
    ]
    return [
        f"model  {est.model}",
        f"setup  {s['micro_batch_size']} x {s['seq_len']} tokens x {s['grad_accum']} "
        f"micro-batches = {s['tokens_per_step']} tokens/step; {s['compute_dtype']} compute, "
        f"{s['num_slots']} slots, {layout}, clipping {'on' if s['clipping'] else 'off'}, "
        f"AdamW states {s['state_dtype']}, master weights {s['master_dtype']}"
        + (", compiled layers" if s.get("compiled") else ""),
        _ranks_line(s),
        f"GPU tier  {s['gpu_state_blocks']} blocks (layers from the first, then embedding, head) "
        "keep their optimizer states on the GPU: no copies, AdamW there",
        f"GPU update share  {s.get('gpu_update_blocks', 0)} streamed blocks (the head, then "
        "layers from the last) updated on the GPU: their states copied up and back"
        + (f", {s['gpu_update_sets']} staging sets" if s.get("gpu_update_sets", 1) > 1 else ""),
        f"long rows  {s['activations']}; {TilePolicy(s['mlp_tiles']).describe(s['seq_len'])}",
    ]


# the store's gradient hold (store/grads.py) -> what its pageable and pinned bytes are
_STORE_PARTS = {
    "shadow": ("fp32 master + Adam m, v", "bf16 shadow = gradient landing"),
    "bf16": ("Adam m, v", "bf16 master + bf16 gradient landing"),
    "int8": ("Adam m, v", "bf16 master + int8 gradient landing"),
    "pool": ("Adam m, v", "bf16 master + shared bf16 gradient landings"),
    "fp32": ("Adam m, v", "fp32 master + gradient"),
}


def _host_lines(est: Estimate) -> list[str]:
    hw, h, s = est.hardware, est.host, est.settings
    hold = gradient_hold(
        s["master_dtype"],
        s.get("grad_dtype", "bf16"),
        clipping=s["clipping"],
        bf16_compute=s["compute_dtype"] == "bf16",
    )
    pageable, pinned = _STORE_PARTS[hold]
    return [
        f"{'host RAM':<{_W + 2}}{'GiB':>10}",
        _row(f"pageable ({pageable})", _gib(h.pageable_bytes)),
        _row(
            f"pinned ({pinned})",
            _gib(h.pinned_bytes),
            f"pinned as {_gib(h.pinned_reserved_bytes)} GiB after allocation rounding",
        ),
        _row(
            "process baseline (python, torch, CUDA)",
            _gib(h.baseline_bytes),
            hw.source("process_baseline_bytes"),
        ),
        _row("tokenized data", _gib(h.data_bytes)),
        _row("offloaded layer inputs", _gib(h.offload_bytes), "pinned, reused every step"),
        _row(
            "total",
            _gib(h.total_bytes),
            f"of {_gib(hw.host_bytes)} GiB ({hw.source('host_bytes')})",
        ),
        _row(
            "peak while loading the model",
            _gib(h.load_peak_bytes),
            f"a node's ranks one at a time; each more at once +{_gib(h.load_extra_bytes)} GiB"
            if h.load_extra_bytes
            else "",
        ),
    ]


def _gpu_lines(est: Estimate) -> list[str]:
    hw, g = est.hardware, est.gpu
    return [
        f"{'GPU peak (at: ' + g.peak_phase + ')':<{_W + 2}}{'GiB':>10}",
        *(_row(name, _gib(n)) for name, n in g.items.items()),
        _row(
            "total (torch.cuda.max_memory_reserved)",
            _gib(g.peak_bytes),
            f"of {_gib(hw.gpu_bytes)} GiB ({hw.source('gpu_bytes')}); allocated "
            f"{_gib(g.allocated_bytes)}",
        ),
    ]


def _optimizer_note(est: Estimate) -> str:
    """The CPU AdamW rate the step is timed with, and where it comes from."""
    hw, state = est.hardware, est.settings["state_dtype"]
    rate = optimizer_gparams_s(hw, state)
    source = hw.source("optimizer_gparams_s")
    if state != hw.optimizer_state_dtype:  # scaled from another kernel's rate
        source = f"{hw.optimizer_state_dtype} {hw.optimizer_gparams_s:.2f} {source}, scaled"
    return f"{rate:.2f} Gparams/s, {state} states, {hw.optimizer_threads} threads ({source})"


def _time_lines(est: Estimate) -> list[str]:
    s, hw, t = est.settings, est.hardware, est.time
    peak_field = "gpu_tflops_bf16" if s["compute_dtype"] == "bf16" else "gpu_tflops_fp32"
    return [
        f"{'step time (predicted)':<{_W + 2}}{'s':>10}",
        _row(
            "GPU compute (forward, recompute, backward)",
            f"{t.compute_s:.3f}",
            f"loss {t.loss_s:.3f} s; {t.flops / 1e12:.0f} TFLOP at "
            f"{t.flops / max(t.compute_s, 1e-12) / 1e12:.0f} TFLOP/s achieved (peak "
            f"{hw.source(peak_field)})",
        ),
        _row("H2D weights", f"{t.h2d_s:.3f}", f"{hw.h2d_gbps:.0f} GB/s ({hw.source('h2d_gbps')})"),
        _row(
            "D2H gradients", f"{t.d2h_s:.3f}", f"{hw.d2h_gbps:.0f} GB/s ({hw.source('d2h_gbps')})"
        ),
        _row("CPU optimizer", f"{t.optimizer_s:.3f}", _optimizer_note(est)),
        _row(
            "  the next forward waits for its updates",
            f"{t.wait_optimizer_s:.3f}",
            "in the step; with clipping updates start after the backward (more tokens a step "
            "spread them)",
        ),
        _row(
            "GPU AdamW (GPU tier, on the compute stream)",
            f"{t.gpu_optimizer_s:.3f}",
            "assumed rate",
        ),
        *(
            [_row("  vision modules (in GPU compute)", f"{t.vision_s:.3f}", "per image token")]
            if t.vision_s
            else []
        ),
        _row(
            "step (overlapped)",
            f"{t.step_s:.3f}",
            f"bound by {t.bound}; GPU busy {t.gpu_busy:.0%} of the step",
        ),
        _row(
            "collectives (all-gather, reduce-scatter)",
            f"{t.collective_s:.3f}",
            "in the rows above; assumed bus bandwidth (planning/ranks.py)",
        ),
        _row("tokens/s", f"{t.tokens_per_s:,.0f}", _per_gpu(s, t.tokens_per_s)),
        _row("model TFLOPS (6 x active params x tokens/s)", f"{t.model_tflops:.1f}"),
    ]


def _disk_lines(est: Estimate, export_dtype: str | None) -> list[str]:
    s = est.settings
    export = (
        _row(
            f"Hugging Face export ({export_dtype})",
            _gib(EXPORT_BYTES_PER_PARAM[export_dtype] * est.total_params),
        )
        if export_dtype
        else _row("Hugging Face export", "none", "checkpoint.export_hf: false")
    )
    return [
        f"{'disk (training.output_dir)':<{_W + 2}}{'GiB':>10}",
        _row(
            f"one checkpoint ({s['master_dtype']} master + Adam m, v)",
            _gib(
                checkpoint_bytes_per_param(s["state_dtype"], s["master_dtype"]) * est.total_params
            ),
            "x keep_last, + 1 while the next one is written",
        ),
        export,
    ]


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _ranks_line(s: dict[str, object]) -> str:
    n, m = int(str(s["nproc_per_node"])), int(str(s["nnodes"]))
    if n * m == 1:
        return "ranks  one process"
    return (
        f"ranks  {n} per node x {m} node(s) = {n * m}: GPU numbers per rank, host per node, "
        "step per rank (tokens/s of the job)"
    )


def _per_gpu(s: dict[str, object], tokens_per_s: float) -> str:
    world = int(str(s["nproc_per_node"])) * int(str(s["nnodes"]))
    return f"{tokens_per_s / world:,.0f} per GPU" if world > 1 else ""
