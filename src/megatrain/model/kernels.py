"""Optional kernel packages inside a model's layers: which ones run, and their torch reference.

Hybrid models' HF code calls a package's fused kernels when it is installed (Qwen3.5 and
Qwen3-Next: flash-linear-attention's chunked gated-delta-rule and its fused gated RMSNorm,
causal-conv1d's convolution) and its own torch reference code otherwise. Two forms exist:
- an attribute of a layer's submodule bound to the package's function (transformers 5.0-5.17:
  `self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule`);
  the reference is the module-level `torch_<name>` of the model's file, or None where the
  model's forward takes its own path for None (`causal_conv1d_fn`);
- a module-level wrapper that picked the package at import (later releases:
  `@use_kernel_func_from_hub_with_fallback`); the reference is the wrapped function
  (`__wrapped__`); with the `kernels` package installed (a dependency of transformers
  >= 5.25) that wrapper is itself wrapped in a hub-kernel module instance (`hub_function`);
and a submodule whose class is the package's (`FusedRMSNormGated`).

Triton and CUDA kernels cannot run on the meta device (launched on meta tensors they read
address 0: an illegal memory access), so the plan's layer profile (planning/activations.py)
measures such a layer with `reference_kernels`: functions swapped for their torch reference
and package modules for a stand-in with the memory of an elementwise op (the output like the
first input; the inputs kept for the backward). The torch reference materialises more than the
fused kernels (chunked [C x C] blocks in fp32): where a package runs, the plan counts each
such call's time as the package's few fused kernels and, where it models the call (fla's
chunk_gated_delta_rule: planning/kernel_memory.py), its memory as the package's buffers, else
as the reference's, an upper bound (planning/fused.py); a refused package's reference is what
the run really runs (`refusals`), counted in full. The report says so (`describe`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from megatrain.model.structure import ModelStructure

PACKAGES = ("fla", "causal_conv1d", "mamba_ssm", "flash_attn", "liger_kernel")
"""Import names of the optional kernel packages a layer may call (never required)."""

DISTRIBUTIONS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def _package(obj: Any) -> str | None:
    """The optional package `obj` (a function or class) comes from, if any."""
    root = str(getattr(obj, "__module__", "") or "").split(".")[0]
    return root if root in PACKAGES else None


def hub_function(value: Any) -> Any:
    """The function behind a hub-kernel module: with the `kernels` package installed,
    `use_kernel_forward_from_hub` turns a model file's decorated function into an `nn.Module`
    instance whose forward calls it (its closure's `func`); anything else is returned as is."""
    if isinstance(value, nn.Module):
        inner = _closure(type(value).forward).get("func")
        if callable(inner):
            return inner
    return value


def _wrapped_package(fn: Any) -> str | None:
    """The package a transformers kernel wrapper dispatches to (`__wrapped__` is the torch
    reference; the implementation it picked sits in its closure)."""
    fn = hub_function(fn)
    if not callable(fn) or not hasattr(fn, "__wrapped__"):
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            found = _package(cell.cell_contents)
            if found:
                return found
    return None


def kernel_calls(layer: nn.Module) -> dict[str, str]:
    """What of `layer` runs an optional package: {where: package}."""
    found: dict[str, str] = {}
    for name, module in layer.named_modules():
        where = f"{name}." if name else ""
        if _package(type(module)):
            found[f"{where}{type(module).__name__}"] = str(_package(type(module)))
        for attr, value in vars(module).items():
            if callable(value) and _package(value):
                found[f"{where}{attr}"] = str(_package(value))
        source = sys.modules.get(type(module).__module__)
        for attr, value in vars(source).items() if source is not None else ():
            package = _wrapped_package(value)
            if package:
                found[f"{type(module).__module__.rsplit('.', 1)[-1]}.{attr}"] = package
    return found


def reference_calls(layer: nn.Module) -> list[str]:
    """The layer's kernel slots bound to transformers' torch reference code (`torch_<name>`),
    because the package that would fill them is not installed."""
    return sorted(
        attr
        for module in layer.modules()
        for attr, value in vars(module).items()
        if callable(value)
        and str(getattr(value, "__name__", "")).startswith("torch_")
        and str(getattr(value, "__module__", "")).startswith("transformers.")
    )


def fallback_calls(layer: nn.Module) -> dict[str, str]:
    """{function: package} of the module-level kernel wrappers of `layer`'s model file
    (transformers >= 5.18) that picked their torch reference because the package could not be
    used (not installed, or not importable here)."""
    found: dict[str, str] = {}
    for module in layer.modules():
        source = sys.modules.get(type(module).__module__)
        for attr, value in vars(source).items() if source is not None else ():
            cells = _closure(hub_function(value))
            if cells.get("is_new_implementation") is False and "package" in cells:
                found[str(cells.get("func_name", attr))] = str(cells["package"])
    return found


def _closure(fn: Any) -> dict[str, Any]:
    """A function's free variables by name ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells, strict=True):
        with contextlib.suppress(ValueError):  # an empty cell
            out[name] = cell.cell_contents
    return out


def why_not_running(package: str) -> str:
    """Why an optional package's kernels do not run here, and what would make them run."""
    dist = DISTRIBUTIONS.get(package, package)
    extra = " (the megatrain[hybrid] extra)" if package == "fla" else ""
    if importlib.util.find_spec(package) is None:
        return f"{dist} is not installed: pip install {dist}{extra}; its kernels need a CUDA GPU"
    if not torch.cuda.is_available():
        return f"{dist} is installed, but its Triton/CUDA kernels need a CUDA GPU and none is here"
    try:
        importlib.import_module(package)
    except Exception as e:  # its own import error (e.g. no triton): the message says which
        return f"{dist} is installed but does not import ({type(e).__name__}: {e})"
    return f"{dist} is installed, but transformers did not take it (check its version)"


def describe(layer: nn.Module) -> str | None:
    """One line for the run's report: which optional kernels the layer runs, and which torch
    reference code runs in their place and why (None: the layer has no such slot)."""
    calls, reference = kernel_calls(layer), reference_calls(layer)
    name = type(layer).__name__
    refused = [why for package, why in refusals().items() if package in calls.values()]
    if refused:
        return f"{name}: {refused[0]}"
    parts = []
    if calls:
        packages = sorted({DISTRIBUTIONS.get(p, p) for p in calls.values()})
        parts.append(
            f"runs {', '.join(packages)} kernels ({', '.join(sorted(calls))}); the plan "
            "profiles their memory as the package's own buffers where it models the call "
            "(flash-linear-attention's chunk_gated_delta_rule), else as their torch reference "
            "code (an upper bound), and counts their time as the fused kernels"
        )
    fallbacks = fallback_calls(layer)
    if fallbacks:
        reasons = [
            f"{', '.join(sorted(f for f, p in fallbacks.items() if p == package))}: "
            f"{why_not_running(package)}"
            for package in sorted(set(fallbacks.values()))
        ]
        parts.append(
            "runs transformers' torch reference code (correct, slower than fused kernels) "
            f"for {'; for '.join(reasons)}"
        )
    elif reference:
        parts.append(
            f"runs transformers' torch reference code for {', '.join(reference)}, slower than "
            "the fused kernels: pip install flash-linear-attention (the megatrain[hybrid] "
            "extra) to run them"
        )
    return f"{name} " + "; it ".join(parts) if parts else None


class _TransformersFallbackLine(logging.Filter):
    """Drops transformers' "`f` is falling back to its reference PyTorch implementation because
    `package` is not installed": it says so also when the package is installed but cannot run
    here (no GPU, no Triton); `describe`'s line says which and why instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is falling back to its reference PyTorch implementation" not in record.getMessage()


logging.getLogger("transformers.integrations.hub_kernels").addFilter(_TransformersFallbackLine())


def kernel_report(structure: ModelStructure) -> list[str]:
    """`describe` of each layer group's first layer, where there is something to say; each
    line once (a hybrid's groups share one layer class, whose module-level kernels both find)."""
    lines = (describe(structure.layers[g.layer_indices[0]]) for g in structure.groups)
    return list(dict.fromkeys(line for line in lines if line))


class _Elementwise(torch.autograd.Function):
    """Memory of an opaque fused op on meta: an output like the first input, every input kept."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*inputs)
        return torch.empty_like(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def _stand_in(module: nn.Module) -> Callable[..., torch.Tensor]:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        params = [p for p in module.parameters(recurse=False)]
        return _Elementwise.apply(*tensors, *params)

    return forward


@contextlib.contextmanager
def reference_kernels(layer: nn.Module, fused: Wrap | None = None) -> Iterator[None]:
    """Within: `layer` runs torch code only (see the module docstring); restored on exit.
    `fused` wraps the reference of each package function that really runs on the GPU (a
    package not refused), for the plan to count it as the package's kernels
    (planning/fused.py)."""
    undo = _swap_to_reference(layer, stand_in_modules=True, fused=fused)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def fall_back_where_refused(structure: ModelStructure) -> None:
    """For the whole run, a refused package's functions (`refusal`) are replaced by their torch
    reference in every layer (its modules, such as a fused norm, keep running)."""
    if not refusals():
        return
    for layer in structure.layers:
        if any(p in refusals() for p in kernel_calls(layer).values()):
            _swap_to_reference(layer, stand_in_modules=False, only=set(refusals()))


def _swap_to_reference(
    layer: nn.Module,
    *,
    stand_in_modules: bool,
    only: set[str] | None = None,
    fused: Wrap | None = None,
) -> list[Callable[[], None]]:
    """Swap `layer`'s package kernels (those of `only`'s packages, or all) for their torch
    reference, wrapped by `fused` where the package is not refused (`refusals`); package
    modules for the elementwise stand-in if `stand_in_modules` (memory on meta only: it
    computes nothing). Returns the undo steps."""
    undo: list[Callable[[], None]] = []

    def reference(package: str | None, torch_code: Any) -> Any:
        """`torch_code` (None: the model's own path for a missing kernel), marked as fused."""
        if fused is None or torch_code is None or package in refusals():
            return torch_code
        return fused(torch_code)

    def swap(owner: dict[str, Any], attr: str, value: Any) -> None:
        """Set owner[attr] (a module's instance dict or a file's globals) until undone."""
        missing = object()
        old = owner.get(attr, missing)
        owner[attr] = value
        undo.append(lambda: owner.pop(attr) if old is missing else owner.__setitem__(attr, old))

    def chosen(package: str | None) -> bool:
        return package is not None and (only is None or package in only)

    for module in layer.modules():
        source = sys.modules.get(type(module).__module__)
        namespace = vars(source) if isinstance(source, types.ModuleType) else {}
        if stand_in_modules and chosen(_package(type(module))):
            swap(vars(module), "forward", _stand_in(module))
        for attr, value in list(vars(module).items()):
            if callable(value) and chosen(_package(value)):
                swap(vars(module), attr, reference(_package(value), namespace.get(f"torch_{attr}")))
        for attr, value in list(namespace.items()):
            package = _wrapped_package(value)
            if chosen(package):
                swap(namespace, attr, reference(package, hub_function(value).__wrapped__))
    return undo


@functools.cache
def refusals() -> dict[str, str]:
    """{package: why its kernels cannot train here}, for installed packages that would stop
    the run (the package's own guard raises in the first backward). Checked once."""
    found: dict[str, str] = {}
    reason = _fla_refusal()
    if reason:
        found["fla"] = reason
    return found


def _fla_refusal() -> str | None:
    """flash-linear-attention (0.6) raises in its gated kernels' backward on Hopper GPUs with
    Triton >= 3.4 and < 3.7.1 (wrong results there, its issue #640) unless tilelang is
    installed: the same test, made before the run instead of in its first step."""
    if importlib.util.find_spec("fla") is None or not torch.cuda.is_available():
        return None
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another release: its guard, if any, is its own
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    import triton

    return (
        f"flash-linear-attention refuses Triton {triton.__version__} on this Hopper GPU for its "
        "gated kernels' backward (wrong results, its issue #640), so the layers run "
        "transformers' torch reference code instead: upgrade triton to >= 3.7.1 or pip install "
        "tilelang to run its kernels"
    )
