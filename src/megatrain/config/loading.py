"""Reading a config from YAML + command-line overrides, and writing it back (atomically)."""

from __future__ import annotations

import difflib
import itertools
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_origin

import yaml

import megatrain.config.llamafactory as llamafactory
from megatrain.config.aliases import alias_hint
from megatrain.config.sections import SECTIONS, TrainConfig
from megatrain.config.types import MISMATCH, coerce, convert, field_types
from megatrain.files import umask_mode
from megatrain.yaml_values import YamlLoader

CONFIG_HEADER = "# Resolved MegaTrain config: megatrain train --config <this file>\n"
"""The first line of every config.yaml MegaTrain writes (how a run's own config is told apart)."""


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Mapping[str, Any]] | None = None,
) -> TrainConfig:
    """The validated config of YAML file `path` (None: all defaults) plus argv `overrides`.

    `base` (section -> {key: value}) replaces the dataclass defaults underneath the file: a
    command's own defaults (verify's small random batches), still overridable by both.
    A LLaMA-Factory / TRL file (flat keys) is read through config/llamafactory.py; its ignored
    keys are named in one line on stderr.
    """
    raw: dict[str, Any] = {section: dict(body) for section, body in (base or {}).items()}
    file = {} if path is None else _read_yaml(Path(path))
    flat = llamafactory.is_flat(file, SECTIONS)
    if flat:
        stage = raw.get("data", {}).get("stage", "sft")
        file, ignored = llamafactory.translate(file, str(path), SECTIONS, stage=stage)
        if ignored and os.environ.get("RANK", "0") == "0":  # once per job, not per rank
            print(llamafactory.ignored_line(str(path), ignored), file=sys.stderr, flush=True)
    for section, body in file.items():
        if isinstance(body, dict) and isinstance(raw.get(section), dict):
            raw[section].update(body)
        else:
            raw[section] = body
    for name, text in parse_overrides(overrides):
        _apply_override(raw, name, text)
    try:
        cfg = _build(raw)
        cfg.validate()
    except ValueError as e:
        if flat:  # the message names MegaTrain's keys: say where they came from
            raise ValueError(
                f"{path} (LLaMA-Factory / TRL keys, read as the MegaTrain keys "
                f"docs/configuration.md maps them to): {e}"
            ) from e
        raise
    return cfg


def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """argv tokens `--a.b VALUE` / `--a.b=VALUE` as (`a.b`, `VALUE`) pairs, in order."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(
                f"override {token!r} is not of the form --section.key VALUE or "
                "--section.key=VALUE (e.g. --optimizer.learning_rate 2e-5)"
            )
        name, eq, text = token[2:].partition("=")
        if not eq:
            if i + 1 == len(tokens) or tokens[i + 1].startswith("--"):
                raise ValueError(f"override --{name} has no value; write --{name} VALUE")
            i += 1
            text = tokens[i]
        pairs.append((name, text))
        i += 1
    return pairs


def config_to_dict(cfg: TrainConfig, *, changed_only: bool = False) -> dict[str, Any]:
    """Plain YAML-ready data: a mapping per section, tuples as lists. `changed_only`: only the
    keys whose values differ from the defaults, and only sections that have any (what
    `--print-config` prints; it loads back to the same config)."""
    full = {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg)}
    if not changed_only:
        return full
    defaults = {name: _plain(cls()) for name, cls in SECTIONS.items()}
    changed = {
        section: {k: v for k, v in body.items() if v != defaults[section][k]}
        for section, body in full.items()
    }
    return {section: body for section, body in changed.items() if body}


def config_yaml(cfg: TrainConfig, *, changed_only: bool = False) -> str:
    """`cfg` as MegaTrain YAML (sections of keys); `changed_only` as in config_to_dict."""
    data = config_to_dict(cfg, changed_only=changed_only)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg` as YAML atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = CONFIG_HEADER + config_yaml(cfg)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())  # mkstemp's 0600 would make it unreadable to others
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def setup_command(path: str | Path, missing: str) -> str | None:
    """The command in config file `path`'s header comment that makes the missing path
    `missing` (a command naming it or a folder above it, e.g. the warm start of
    examples/grpo_demo.yaml), or None."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    commands: list[str] = []
    for line in itertools.takewhile(lambda x: x.startswith("#"), lines):
        text = line.lstrip("#").strip()
        if commands and commands[-1].endswith("\\"):
            commands[-1] = f"{commands[-1][:-1].rstrip()} {text}"
        elif text.startswith("megatrain "):
            commands.append(text)
    target = Path(missing)
    for command in commands:
        for word in command.split()[2:]:
            made = Path(word)
            if made != Path(".") and (made == target or made in target.parents):
                return command
    return None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"config file {path} does not exist (or is not a file); give the path of a YAML "
            "file, e.g. examples/demo.yaml"
        )
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=YamlLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: invalid YAML: {e.problem or e.context}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(
            f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), "
            f"not a {type(raw).__name__}"
        )
    return raw


def _apply_override(raw: dict[str, Any], name: str, text: str) -> None:
    section, _, rest = name.partition(".")
    key, _, sub = rest.partition(".")
    if not section or not key:
        owners = [f"--{s}.{section}" for s in SECTIONS if section in field_types(SECTIONS[s])]
        example = owners[0] if owners else "--optimizer.learning_rate"
        raise ValueError(f"override --{name} must name a field as --section.key, e.g. {example}")
    tp = field_types(_section_class(section))
    if key not in tp:
        raise ValueError(_unknown_key(section, key))
    body = raw.get(section)
    if body is None:
        body = raw[section] = {}
    if not isinstance(body, dict):
        raise ValueError(_not_a_mapping(section, body))
    if not sub:
        body[key] = _parse_value(text, tp[key])
    elif get_origin(tp[key]) is dict and "." not in sub:
        inner = body.get(key)
        body[key] = {**(inner if isinstance(inner, dict) else {}), sub: _parse_value(text, Any)}
    else:
        raise ValueError(f"override --{name}: {section}.{key} has no sub-key {sub!r}")


def _parse_value(text: str, tp: Any) -> Any:
    """`text` read as YAML; the raw text instead if only that fits a string field."""
    try:
        value = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError:
        return text
    if convert(value, tp) is MISMATCH and convert(text, tp) is not MISMATCH:
        return text
    return value


def _build(raw: Mapping[str, Any]) -> TrainConfig:
    for section in raw:
        _section_class(section)
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        body = raw.get(section)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ValueError(_not_a_mapping(section, body))
        hints = field_types(cls)
        kwargs = {}
        for key, value in body.items():
            if key not in hints:
                raise ValueError(_unknown_key(section, key))
            kwargs[key] = coerce(f"{section}.{key}", value, hints[key])
        built[section] = cls(**kwargs)
    return TrainConfig(**built)


def _section_class(section: str) -> type:
    if section in SECTIONS:
        return SECTIONS[section]
    hint = alias_hint(str(section)) or _did_you_mean(str(section), list(SECTIONS))
    owners = [f"{s}.{section}" for s in SECTIONS if section in field_types(SECTIONS[s])]
    if not hint and owners:
        hint = f"did you mean {owners[0]}?"
    parts = [f"unknown section {section!r}", hint, f"sections: {', '.join(SECTIONS)}"]
    raise ValueError("; ".join(part for part in parts if part))


_REPLACED = {
    "logging.tensorboard": "logging.report_to replaced it: report_to: [tensorboard] (the "
    "default) writes TensorBoard events, report_to: none turns every tracker off",
}
"""Keys that were removed, and what replaced them (configs written before, e.g. a checkpoint's)."""


def _unknown_key(section: str, key: object) -> str:
    allowed = list(field_types(SECTIONS[section]))
    elsewhere = {k: f"{s}.{k}" for s in SECTIONS if s != section for k in field_types(SECTIONS[s])}
    hint = (
        _REPLACED.get(f"{section}.{key}")
        or (f"did you mean {elsewhere[key]}?" if key in elsewhere else "")
        or alias_hint(str(key))
        or _did_you_mean(str(key), allowed, prefix=f"{section}.")
    )
    if not hint:
        near = difflib.get_close_matches(str(key), list(elsewhere), n=1)
        hint = f"did you mean {elsewhere[near[0]]}?" if near else ""
    parts = [f"unknown key {section}.{key}", hint, f"{section} takes: {', '.join(allowed)}"]
    return "; ".join(part for part in parts if part)


def _did_you_mean(word: str, candidates: list[str], prefix: str = "") -> str:
    near = difflib.get_close_matches(word, candidates, n=1)
    return f"did you mean {prefix}{near[0]}?" if near else ""


def _not_a_mapping(section: str, body: object) -> str:
    return f"{section}={body!r} must be a mapping of {section} keys ({section}: {{key: value}})"


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---- types and checks ----------------------------------------------------------------------
