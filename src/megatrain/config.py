"""A run's configuration: one frozen dataclass per YAML section, loaded from YAML + CLI overrides.

    cfg = load_config("examples/qwen3_8b.yaml", ["--optimizer.learning_rate", "2e-5"])
    cfg.model, cfg.data, cfg.training, cfg.optimizer, cfg.memory, cfg.logging, cfg.checkpoint
    save_config(cfg, out_dir / "config.yaml")       # load_config(that file) == cfg

Sections map one to one onto YAML mappings (`model:`, `data:`, ...); `data` is
`megatrain.data.config.DataConfig`. Overrides are argv tokens `--section.key VALUE` or
`--section.key=VALUE` (a dict field also takes `--section.key.sub VALUE`); VALUE is read as a
YAML scalar or flow collection (`true`, `3`, `2e-5`, `[0.9, 0.95]`, `null`); when that does not
fit the field's type but the field takes a string, the raw text is used (`--data.system_prompt
"Note: be brief"`). Only the trainer and the CLI read this module.

Invariants:
- Every field has a default; every section's defaults validate except `model`, which needs
  exactly one of `name_or_path` / `model_type`.
- Values are type-checked against the field annotations on load: ints widen to float fields,
  YAML lists become tuples for tuple fields, nothing else is converted.
- Every error is a ValueError (FileNotFoundError for a missing file) that names the key as
  `section.key`, the offending value and what is allowed.
- `load_config(save_config(cfg))` gives back an equal `TrainConfig`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tempfile
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml

from megatrain.data.config import DataConfig

ATTN_IMPLEMENTATIONS = (None, "sdpa", "eager", "flash_attention_2", "flex_attention")
DTYPES = ("bf16", "fp32")
LR_SCHEDULERS = ("constant", "linear", "cosine")
OPTIMIZER_IMPLS = ("auto", "c", "torch")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str | None = None
    """Hub id (`Qwen/Qwen3-8B`) or local directory of a checkpoint. Exclusive with model_type."""
    model_type: str | None = None
    """Random-init architecture by transformers model type (`qwen3`) instead of a checkpoint."""
    tiny: bool = False
    """With model_type: a tiny random config of that architecture, for tests and the demo."""
    random_init: bool = False
    """With name_or_path: the checkpoint's config, but random weights."""
    tokenizer: str | None = None
    """Hub id or directory; None: name_or_path. Required with model_type; "demo": built-in one."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own Python code (config, model, tokenizer)."""
    attn_implementation: str | None = None
    """None (transformers' choice), "sdpa", "eager", "flash_attention_2" or "flex_attention"."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields set on the HF config before building the model, e.g. {output_router_logits: true}."""
    compute_dtype: str = "bf16"
    """Dtype of the GPU forward/backward: "bf16" or "fp32" (master weights are always fp32)."""

    def validate(self) -> None:
        _check_types("model", self)
        if self.name_or_path is not None and self.model_type is not None:
            raise ValueError(
                f"model.name_or_path={self.name_or_path!r} and model.model_type="
                f"{self.model_type!r} are both set; set exactly one: name_or_path for a "
                "checkpoint, model_type for a randomly initialised architecture"
            )
        if self.name_or_path is None and self.model_type is None:
            raise ValueError(
                "no model: set model.name_or_path (a hub id like Qwen/Qwen3-8B or a local "
                "directory) or model.model_type (e.g. qwen3, with model.tiny: true and "
                "model.tokenizer: demo for a tiny test model)"
            )
        for key in ("name_or_path", "model_type", "tokenizer"):
            if getattr(self, key) == "":
                raise ValueError(f"model.{key}='' is empty; give a value or null")
        if self.tiny and self.model_type is None:
            raise ValueError(
                f"model.tiny=True needs model.model_type (tiny random config of an architecture);"
                f" for random weights of model.name_or_path={self.name_or_path!r} set "
                "model.random_init: true instead"
            )
        if self.model_type is not None and self.tokenizer is None:
            raise ValueError(
                f"model.tokenizer=None: model.model_type={self.model_type!r} brings no tokenizer;"
                " set model.tokenizer to a hub id or directory, or to 'demo' for the built-in one"
            )
        _check_choice("model.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        _check_choice("model.compute_dtype", self.compute_dtype, DTYPES)


@dataclass(frozen=True)
class TrainingConfig:
    output_dir: str = "outputs/run"
    """Folder for config.yaml, metrics, checkpoints and the exported model."""
    seed: int = 42
    """Seed of random init and of everything random in training (data has its own `seed`)."""
    micro_batch_size: int | str = 1
    """Rows per forward/backward: an integer >= 1, or "auto" (the largest that fits the GPU)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    seq_len: int | None = None
    """Row length for packing / maximum padded length; None: data.cutoff_len (must be >= it)."""
    max_steps: int | None = None
    """Optimizer steps to run; overrides num_epochs. None: num_epochs of the training data."""
    num_epochs: float = 1.0
    """Passes over the training data (fractions allowed) when max_steps is None."""
    eval_every: int = 0
    """Optimizer steps between evaluations; 0: only at the end, when there is eval data."""
    max_eval_batches: int | None = None
    """Evaluate on at most this many micro-batches; None: the whole eval set."""
    device: str = "auto"
    """"auto" (the GPU if there is one), "cpu", "cuda" or "cuda:N"."""
    compile_layers: bool = False
    """torch.compile each decoder layer: about 17% faster layers on the GPU (measured, 7B
    shape), a minute or so of compiling at the start. Off on the CPU unless you ask."""

    def validate(self) -> None:
        _check_types("training", self)
        if self.output_dir == "":
            raise ValueError("training.output_dir='' is empty; give a folder, e.g. outputs/run")
        _check_int("training.seed", self.seed, minimum=0)
        mbs = self.micro_batch_size
        if (isinstance(mbs, str) and mbs != "auto") or (isinstance(mbs, int) and mbs < 1):
            raise ValueError(f"training.micro_batch_size={mbs!r} must be an integer >= 1 or 'auto'")
        _check_int(
            "training.gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1
        )
        _check_int("training.seq_len", self.seq_len, minimum=2, optional=True)
        _check_int("training.max_steps", self.max_steps, minimum=1, optional=True)
        _check_number("training.num_epochs", self.num_epochs, low=0.0, low_open=True)
        _check_int("training.eval_every", self.eval_every, minimum=0)
        _check_int("training.max_eval_batches", self.max_eval_batches, minimum=1, optional=True)
        if not DEVICE_PATTERN.fullmatch(self.device):
            allowed = ["auto", "cpu", "cuda", "cuda:N"]
            raise ValueError(f"training.device={self.device!r} must be one of {allowed}")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    """The optimizer; only "adamw" (fp32 AdamW on the CPU)."""
    learning_rate: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2); in YAML a list of two numbers."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the parameters that decay (see no_decay, decay_1d)."""
    no_decay: tuple[str, ...] = ("bias", "norm")
    """Regexes searched in parameter names; matching parameters get no weight decay."""
    decay_1d: bool = False
    """Also decay 1-D parameters (biases, norm weights), which otherwise never decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    lr_scheduler: str = "cosine"
    """Decay after warmup: "constant", "linear" or "cosine"."""
    warmup_steps: int = 0
    """Linear warmup steps. Exclusive with warmup_ratio."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of all optimizer steps, 0 <= r < 1. Exclusive with warmup_steps."""
    min_lr_ratio: float = 0.0
    """Floor of the linear/cosine decay as a fraction of learning_rate."""
    impl: str = "auto"
    """AdamW kernel: "c" (compiled C, OpenMP), "torch", or "auto" (c when it compiles)."""
    threads: int | None = None
    """CPU threads for the optimizer; None: all cores but two."""

    def validate(self) -> None:
        _check_types("optimizer", self)
        _check_choice("optimizer.name", self.name, ("adamw",))
        _check_number("optimizer.learning_rate", self.learning_rate, low=0.0)
        for i, beta in enumerate(self.betas):
            _check_number(f"optimizer.betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        _check_number("optimizer.eps", self.eps, low=0.0, low_open=True)
        _check_number("optimizer.weight_decay", self.weight_decay, low=0.0)
        for pattern in self.no_decay:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"optimizer.no_decay: {pattern!r} is not a valid regular expression ({e})"
                ) from e
        _check_number("optimizer.max_grad_norm", self.max_grad_norm, low=0.0)
        _check_choice("optimizer.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check_int("optimizer.warmup_steps", self.warmup_steps, minimum=0)
        _check_number("optimizer.warmup_ratio", self.warmup_ratio, low=0, high=1, high_open=True)
        if self.warmup_steps > 0 and self.warmup_ratio > 0:
            raise ValueError(
                f"optimizer.warmup_steps={self.warmup_steps!r} and optimizer.warmup_ratio="
                f"{self.warmup_ratio!r} are both set; set one of them and leave the other at 0"
            )
        _check_number("optimizer.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _check_choice("optimizer.impl", self.impl, OPTIMIZER_IMPLS)
        _check_int("optimizer.threads", self.threads, minimum=1, optional=True)


@dataclass(frozen=True)
class MemoryConfig:
    num_slots: int = 2
    """GPU weight slots: layers resident at once (prefetch depth + 1), >= 1."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the fused LM-head + loss; None: chosen from the vocabulary size."""
    pin_memory: bool = True
    """Pin the host bf16 weight shadow and transfer buffers (faster, asynchronous copies)."""
    gpu_margin_gib: float = 2.0
    """GPU memory micro_batch_size "auto" leaves free."""
    host_margin_gib: float = 4.0
    """Host memory the resource check keeps free for the OS and data loading."""

    def validate(self) -> None:
        _check_types("memory", self)
        _check_int("memory.num_slots", self.num_slots, minimum=1)
        _check_int("memory.loss_chunk_tokens", self.loss_chunk_tokens, minimum=1, optional=True)
        _check_number("memory.gpu_margin_gib", self.gpu_margin_gib, low=0.0)
        _check_number("memory.host_margin_gib", self.host_margin_gib, low=0.0)


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 1
    """Optimizer steps between metric lines (loss, lr, grad norm, tokens/s)."""
    jsonl: bool = True
    """Append metrics to output_dir/metrics.jsonl."""
    tensorboard: bool = True
    """Write TensorBoard event files to output_dir/tensorboard."""
    progress_bar: bool = True
    """Show a tqdm progress bar."""
    timeline: bool = False
    """Print where each step's time went (transfers, compute, optimizer, waits)."""

    def validate(self) -> None:
        _check_types("logging", self)
        _check_int("logging.log_every", self.log_every, minimum=1)


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 0
    """Optimizer steps between resumable checkpoints; 0: only at the end."""
    keep_last: int = 2
    """Checkpoints kept in output_dir/checkpoints (older ones deleted), >= 1."""
    resume_from: str | None = None
    """A checkpoint directory, or "auto": the latest in output_dir/checkpoints (none: fresh)."""
    export_hf: bool = True
    """Write a Hugging Face model folder (safetensors + config + tokenizer) at the end."""
    export_dtype: str = "bf16"
    """Dtype of the exported weights: "bf16" or "fp32"."""

    def validate(self) -> None:
        _check_types("checkpoint", self)
        _check_int("checkpoint.save_every", self.save_every, minimum=0)
        _check_int("checkpoint.keep_last", self.keep_last, minimum=1)
        if self.resume_from == "":
            raise ValueError(
                "checkpoint.resume_from='' is empty; give a checkpoint directory, 'auto', or null"
            )
        _check_choice("checkpoint.export_dtype", self.export_dtype, DTYPES)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        """Each section's checks, then the ones that span sections."""
        self.model.validate()
        _check_types("data", self.data)
        self.data.validate()
        self.training.validate()
        self.optimizer.validate()
        self.memory.validate()
        self.logging.validate()
        self.checkpoint.validate()
        t, d = self.training, self.data
        if t.seq_len is not None and t.seq_len < d.cutoff_len:
            raise ValueError(
                f"training.seq_len={t.seq_len} is shorter than data.cutoff_len={d.cutoff_len}; a "
                f"row must hold the longest sample: set seq_len >= {d.cutoff_len} or null"
            )
        if t.eval_every > 0 and d.val_size == 0 and not d.eval_dataset_names():
            raise ValueError(
                f"training.eval_every={t.eval_every} but there is no evaluation data; set "
                "data.val_size or data.eval_dataset, or training.eval_every: 0"
            )
        warmup = self.optimizer.warmup_steps
        if t.max_steps is not None and warmup > t.max_steps:
            raise ValueError(
                f"optimizer.warmup_steps={warmup} exceeds training.max_steps={t.max_steps}; "
                f"set warmup_steps <= {t.max_steps} (or use optimizer.warmup_ratio)"
            )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "memory": MemoryConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}
"""YAML section name -> its dataclass, in TrainConfig's field order."""


# ---- loading, overrides and saving ---------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` as a float (YAML 1.1 wants `1.0e-5`; 1.2 does not)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The validated config of YAML file `path` (None: all defaults) plus argv `overrides`."""
    raw = {} if path is None else _read_yaml(Path(path))
    for name, text in parse_overrides(overrides):
        _apply_override(raw, name, text)
    cfg = _build(raw)
    cfg.validate()
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


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain YAML-ready data: a mapping per section, tuples as lists."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg)}


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg` as YAML atomically (temp file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Resolved MegaTrain config: megatrain train --config <this file>\n" + yaml.safe_dump(
        config_to_dict(cfg), sort_keys=False, allow_unicode=True
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make the config unreadable to others
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(
            f"config file {path} does not exist (or is not a file); give the path of a YAML "
            "file, e.g. examples/demo.yaml"
        )
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
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
        owners = [f"--{s}.{section}" for s in SECTIONS if section in _hints(SECTIONS[s])]
        example = owners[0] if owners else "--optimizer.learning_rate"
        raise ValueError(f"override --{name} must name a field as --section.key, e.g. {example}")
    tp = _hints(_section_class(section))
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
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text
    if _convert(value, tp) is _MISMATCH and _convert(text, tp) is not _MISMATCH:
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
        hints = _hints(cls)
        kwargs = {}
        for key, value in body.items():
            if key not in hints:
                raise ValueError(_unknown_key(section, key))
            kwargs[key] = _coerce(f"{section}.{key}", value, hints[key])
        built[section] = cls(**kwargs)
    return TrainConfig(**built)


def _section_class(section: str) -> type:
    if section in SECTIONS:
        return SECTIONS[section]
    hint = _did_you_mean(str(section), list(SECTIONS))
    owners = [f"{s}.{section}" for s in SECTIONS if section in _hints(SECTIONS[s])]
    if not hint and owners:
        hint = f"did you mean {owners[0]}?"
    parts = [f"unknown section {section!r}", hint, f"sections: {', '.join(SECTIONS)}"]
    raise ValueError("; ".join(part for part in parts if part))


def _unknown_key(section: str, key: object) -> str:
    allowed = list(_hints(SECTIONS[section]))
    hint = _did_you_mean(str(key), allowed, prefix=f"{section}.")
    if not hint:
        elsewhere = {k: f"{s}.{k}" for s in SECTIONS if s != section for k in _hints(SECTIONS[s])}
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

_MISMATCH = object()


def _hints(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation, in field order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _coerce(key: str, value: Any, tp: Any) -> Any:
    out = _convert(value, tp)
    if out is _MISMATCH:
        raise ValueError(
            f"{key}={value!r} has the wrong type ({type(value).__name__}); "
            f"expected {_type_name(tp)}"
        )
    return out


def _convert(value: Any, tp: Any) -> Any:
    """`value` as `tp` (int -> float, list -> tuple), or _MISMATCH."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arm in get_args(tp):
            out = _convert(value, arm)
            if out is not _MISMATCH:
                return out
        return _MISMATCH
    if tp is type(None):
        return None if value is None else _MISMATCH
    if tp in (bool, str):
        return value if isinstance(value, tp) else _MISMATCH
    if tp in (int, float):
        ok = isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool)
        return tp(value) if ok else _MISMATCH
    if origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        return dict(value) if ok else _MISMATCH
    assert origin in (list, tuple), f"unsupported field type {tp}"
    args = get_args(tp)
    if not isinstance(value, (list, tuple)):
        return _MISMATCH
    variadic = origin is list or args[-1] is Ellipsis
    if not variadic and len(args) != len(value):
        return _MISMATCH
    arms = [args[0]] * len(value) if variadic else list(args)
    items = [_convert(v, arm) for v, arm in zip(value, arms, strict=True)]
    if any(item is _MISMATCH for item in items):
        return _MISMATCH
    return tuple(items) if origin is tuple else items


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(arm) for arm in get_args(tp))
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if tp is type(None):
        return "null"
    if origin is dict:
        return "a mapping"
    args = get_args(tp)
    if origin is list or args[-1] is Ellipsis:
        return f"a list of {_type_name(args[0]).split(' ', 1)[1]}s"
    return f"a list of {len(args)} {_type_name(args[0]).split(' ', 1)[1]}s"


def _check_types(section: str, obj: Any) -> None:
    for key, tp in _hints(type(obj)).items():
        _coerce(f"{section}.{key}", getattr(obj, key), tp)


def _check_int(key: str, value: int | None, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r} must be an integer >= {minimum}")


def _check_number(
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


def _check_choice(key: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r} must be one of {list(choices)}")
