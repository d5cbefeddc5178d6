"""Type checking and conversion of config values against the dataclass annotations."""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Union, get_args, get_origin, get_type_hints

MISMATCH = object()


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in field order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def coerce(key: str, value: Any, tp: Any) -> Any:
    out = convert(value, tp)
    if out is MISMATCH:
        raise ValueError(
            f"{key}={value!r} has the wrong type ({type(value).__name__}); expected {type_name(tp)}"
        )
    return out


def convert(value: Any, tp: Any) -> Any:
    """`value` as `tp` (int -> float, list -> tuple), or MISMATCH."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            out = convert(value, arm)
            if out is not MISMATCH:
                return out
        return MISMATCH
    if tp is type(None):
        return None if value is None else MISMATCH
    if tp in (bool, str):
        return value if isinstance(value, tp) else MISMATCH
    if tp in (int, float):
        ok = isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool)
        return tp(value) if ok else MISMATCH
    if origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        return dict(value) if ok else MISMATCH
    assert origin in (list, tuple), f"unsupported field type {tp}"
    args = get_args(tp)
    if not isinstance(value, (list, tuple)):
        return MISMATCH
    variadic = origin is list or args[-1] is Ellipsis
    if not variadic and len(args) != len(value):
        return MISMATCH
    arms = [args[0]] * len(value) if variadic else list(args)
    items = [convert(v, arm) for v, arm in zip(value, arms, strict=True)]
    if any(item is MISMATCH for item in items):
        return MISMATCH
    return tuple(items) if origin is tuple else items


def type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(arm) for arm in get_args(tp))
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if tp is type(None):
        return "null"
    if origin is dict:
        return "a mapping"
    args = get_args(tp)
    if origin is list or args[-1] is Ellipsis:
        return f"a list of {type_name(args[0]).split(' ', 1)[1]}s"
    return f"a list of {len(args)} {type_name(args[0]).split(' ', 1)[1]}s"


def check_types(section: str, obj: Any) -> None:
    for key, tp in field_types(type(obj)).items():
        coerce(f"{section}.{key}", getattr(obj, key), tp)


def check_int(key: str, value: int | None, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r} must be an integer >= {minimum}")


def check_number(
    key: str,
    value: float,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        lo = f"> {low}" if low_open else f">= {low}"
        hi = "" if high == math.inf else (f" and < {high}" if high_open else f" and <= {high}")
        raise ValueError(f"{key}={value!r} must be a number {lo}{hi}")


def check_choice(key: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} must be one of {list(choices)}")


def check_count_or_auto(key: str, value: int | str, zero_means: str) -> None:
    """A count of blocks a setting takes, or "auto" (the plan's choice)."""
    if (isinstance(value, str) and value != "auto") or (isinstance(value, int) and value < 0):
        raise ValueError(f"{key}={value!r} must be an integer >= 0 (0: {zero_means}) or 'auto'")
