"""Does a predicted run fit this machine? The verdicts of host RAM and GPU memory, each with
the numbers and what to change (megatrain.planning.plan collects them)."""

from __future__ import annotations

from typing import NamedTuple

from megatrain.choices import GRAD_DTYPES, MASTER_DTYPES, STATE_DTYPES
from megatrain.planning.estimate import Estimate
from megatrain.planning.hardware import GIB, Hardware, gib
from megatrain.store.grads import gradient_hold
from megatrain.store.master import weight_bytes_per_param
from megatrain.store.states import state_bytes_per_param


def check_fits(
    est: Estimate,
    hardware: Hardware | None = None,
    *,
    host_margin_gib: float,
    gpu_margin_gib: float,
) -> None:
    """Raise ValueError, with the numbers and what to change, when host RAM or GPU won't do."""
    hw = hardware or est.hardware
    problems = [
        p
        for p in (host_problem(est, hw, host_margin_gib), gpu_problem(est, hw, gpu_margin_gib))
        if p
    ]
    if problems:
        raise ValueError("this setup does not fit: " + "; ".join(problems))


def host_problem(est: Estimate, hw: Hardware, margin_gib: float) -> str | None:
    """What is wrong with host RAM, or None when the prediction fits."""
    h, free = est.host, hw.host_bytes - margin_gib * GIB
    if h.total_bytes <= free < h.load_peak_bytes:
        return (
            f"host RAM while the model loads: predicted peak {gib(h.load_peak_bytes)} > "
            f"{gib(free)} available ({gib(hw.host_bytes)} total - margin {margin_gib:g} GiB), "
            f"though training needs {gib(h.total_bytes)}: the fp32 model moves into the store "
            "block by block (each block exists twice while it moves), and under ranks the rank "
            "loading holds its whole fp32 model beside the others' shards. Use a machine with "
            "more RAM, or more nodes"
        )
    if h.total_bytes <= free:
        return None
    per_param = h.store_bytes / est.total_params
    smaller, note = _smaller_store(est, free)
    advice = [*smaller, "a machine with more RAM", "a smaller model"]
    if est.settings["compute_dtype"] == "fp32":
        states = state_bytes_per_param(est.settings.get("state_dtype", "fp32"))
        advice.append(f"bf16 compute ({6 + states:.0f} instead of {8 + states:.0f} B/param)")
    return (
        f"host RAM: predicted {gib(h.total_bytes)} (store {gib(h.store_bytes)} = "
        f"{per_param:.0f} B/param x {est.total_params / 1e9:.2f}B params, pinned blocks "
        f"rounded up to {gib(h.pinned_reserved_bytes)}, process {gib(h.baseline_bytes)}, "
        f"data {gib(h.data_bytes)}) > {gib(free)} available ({gib(hw.host_bytes)} "
        f"total - margin {margin_gib:g} GiB). Use " + ", or ".join(advice) + note
    )


class StoreChoice(NamedTuple):
    """One layout of the host store: its optimizer keys and host bytes per parameter."""

    master: str
    state: str
    grad: str  # a bf16 master's held gradients (store/grads.py); "bf16" otherwise
    per_param: float

    def keys(self, now: StoreChoice) -> list[str]:
        """The optimizer keys to change to go from `now` to this layout."""
        pairs = [("state_dtype", self.state, now.state), ("master_dtype", self.master, now.master)]
        pairs += [("grad_dtype", self.grad, now.grad)]
        return [f"optimizer.{key}: {new}" for key, new, old in pairs if new != old]


def store_choices(bf16_compute: bool, *, clipping: bool = True) -> list[StoreChoice]:
    """Every store layout with its host store bytes per parameter, the least compressed first
    (the order `_smaller_store` offers them in). Held gradients differ only with a bf16 master
    and clipping on (store/grads.py gradient_hold)."""
    masters = MASTER_DTYPES if bf16_compute else ("fp32",)
    choices = []
    for master in masters:
        grads = GRAD_DTYPES if master == "bf16" and clipping else ("bf16",)
        for grad in grads:
            hold = gradient_hold(master, grad, clipping=clipping, bf16_compute=bf16_compute)
            weights = weight_bytes_per_param(master, bf16_compute=bf16_compute, grad_hold=hold)
            for state in STATE_DTYPES:
                choices.append(
                    StoreChoice(master, state, grad, weights + state_bytes_per_param(state))
                )
    return sorted(choices, key=lambda c: -c.per_param)


def store_of(
    choices: list[StoreChoice], master: str, state: str, grad: str, *, clipping: bool
) -> StoreChoice:
    """The layout of `choices` a run's optimizer keys select (optimizer.grad_dtype counts only
    with a bf16 master and clipping on: store/grads.py gradient_hold)."""
    grad = grad if master == "bf16" and clipping else "bf16"
    return next(c for c in choices if (c.master, c.state, c.grad) == (master, state, grad))


def _smaller_store(est: Estimate, free: float) -> tuple[list[str], str]:
    """(advice, note): the least compressed store layout that fits `free` bytes with its bytes
    per parameter (everything else of the prediction as it is), or, when none does, a note of
    what the most compact one would need."""
    s = est.settings
    clipping = bool(s.get("clipping", True))
    choices = store_choices(s["compute_dtype"] == "bf16", clipping=clipping)
    now = store_of(
        choices,
        s.get("master_dtype", "fp32"),
        s.get("state_dtype", "fp32"),
        s.get("grad_dtype", "bf16"),
        clipping=clipping,
    )
    smaller = [c for c in choices if c.per_param < now.per_param]
    if not smaller:
        return [], ""
    others = est.host.total_bytes - est.host.store_bytes

    def total(b: float) -> float:
        return others + est.host.store_bytes * b / now.per_param

    def named(c: StoreChoice) -> str:
        keys = " and ".join(c.keys(now))
        return f"{keys} ({c.per_param:.2f} B/param, predicted {gib(total(c.per_param))})"

    fitting = [c for c in smaller if total(c.per_param) <= free]
    if fitting:
        return [named(fitting[0]) + ", the least compressed store that fits"], ""
    return [], f" (the most compact store, {named(smaller[-1])}, does not fit either)"


def gpu_problem(est: Estimate, hw: Hardware, margin_gib: float) -> str | None:
    """What is wrong with GPU memory, or None when the prediction fits."""
    gpu_free = hw.gpu_bytes - margin_gib * GIB
    if est.gpu.peak_bytes <= gpu_free:
        return None
    s, items = est.settings, est.gpu.items
    top = sorted(items.items(), key=lambda kv: -kv[1])[:3]
    advice = [
        f"fewer tokens per step (now {s['tokens_per_step']}: the boundary activations "
        "grow with them)"
    ]
    masks = items.get("captured masks + rotary", 0)
    if masks > GIB and s["layout"] != "full":
        advice.insert(
            0,
            f"full rows (the {s['layout']} rows' attention masks are [rows, 1, S, S] under sdpa: "
            f"{gib(masks)}; packed long rows need a kernel that takes per-document positions "
            "instead of a mask: model.attn_implementation flash_attention_2, with the flash-attn "
            "package)",
        )
    if s["micro_batch_size"] > 1:
        advice.append(
            f"a smaller micro_batch_size (now {s['micro_batch_size']}) with more "
            "gradient accumulation"
        )
    if s["num_slots"] > 1:
        advice.append(f"fewer memory.num_slots (now {s['num_slots']})")
    if s["compute_dtype"] == "fp32":
        advice.append("bf16 compute (halves slots and activations)")
    return (
        f"GPU: predicted peak {gib(est.gpu.peak_bytes)} > {gib(gpu_free)} available "
        f"({gib(hw.gpu_bytes)} - margin {margin_gib:g} GiB); largest: "
        + ", ".join(f"{k} {gib(v)}" for k, v in top)
        + ". Try "
        + ", or ".join(advice)
    )
