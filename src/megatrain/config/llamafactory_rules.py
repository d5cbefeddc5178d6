"""The rules of config/llamafactory.py's table: how one LLaMA-Factory / TRL key's value becomes
MegaTrain keys, or is refused (Refused: what MegaTrain does not do, and what to set instead).

A rule gets the value and the whole flat file (TRL's names renamed to LLaMA-Factory's, its
defaults filled in) and returns {"section.key": value}; rules read other keys of the file, so
the table's order does not matter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatrain.config.dpo import LOSS_TYPES
from megatrain.data.config import PREFERENCE_STAGES

Flat = Mapping[str, Any]
"""A flat file's keys (aliases renamed, DEFAULTS filled in) -> values."""


class Refused(Exception):
    """A value asks for what MegaTrain does not do; the message says what to set instead."""


@dataclass(frozen=True)
class Rule:
    writes: str
    """The MegaTrain keys it may set, as the reference page shows them ("": none)."""
    convert: Callable[[Any, Flat], dict[str, Any]]
    """(value, the whole file) -> {section.key: value}; raises Refused."""
    note: str = ""
    """How the value converts, for the reference page."""


def to(target: str, note: str = "", convert: Callable[[Any], Any] | None = None) -> Rule:
    """The value goes to `target` (through `convert`)."""
    return Rule(target, lambda v, _: {target: v if convert is None else convert(v)}, note)


def off(reason: str) -> Rule:
    """A feature MegaTrain does not have: refused when the value is set (true, a path, ...)."""

    def convert(value: Any, flat: Flat) -> dict[str, Any]:
        if value not in (None, False, 0, "", [], {}):
            raise Refused(reason)
        return {}

    return Rule("", convert, f"refused when set ({reason.partition('(')[2].rstrip(')')})")


def read_by(owner: str) -> Rule:
    """A key whose value another key's rule reads (eval_steps by eval_strategy)."""
    return Rule("", lambda v, f: {}, f"read with `{owner}`")


def stage(value: Any, flat: Flat) -> dict[str, Any]:
    if value == "rm":
        raise Refused(
            "stage: rm (a reward model: a value head on the LM, which MegaTrain does not train; "
            "it trains the LM itself with sft, pt, dpo, kto or GRPO)"
        )
    if value == "ppo":
        raise Refused(
            "stage: ppo (MegaTrain's RL is GRPO, which needs no reward or value model: "
            "`megatrain grpo`, docs/grpo.md)"
        )
    return {"data.stage": value}


def finetuning_type(value: Any, flat: Flat) -> dict[str, Any]:
    if value != "full":
        raise Refused(
            f"finetuning_type: {value} (no adapter or frozen layers are needed to fit a model of "
            "any size: set finetuning_type: full)"
        )
    return {}


def batch(value: Any, flat: Flat) -> dict[str, Any]:
    # MegaTrain counts rows; a preference sample is two rows (chosen and rejected; KTO: a row
    # and its KL row), in one micro-batch.
    rows = 2 if flat["stage"] in PREFERENCE_STAGES and isinstance(value, int) else 1
    return {"training.micro_batch_size": value * rows}


def pref_loss(value: Any, flat: Flat) -> dict[str, Any]:
    if isinstance(value, list) and len(value) == 1:  # TRL's loss_type is a list of losses
        value = value[0]
    if flat["stage"] == "kto":
        return {"dpo.loss_type": "kto"}  # LLaMA-Factory's kto stage ignores pref_loss
    if flat["stage"] not in PREFERENCE_STAGES:  # TRL's SFT loss_type: nll, or dft
        if value == "dft":
            raise Refused("loss_type: dft (MegaTrain's SFT loss is cross-entropy: nll)")
        return {}
    if value not in LOSS_TYPES or value == "kto":
        allowed = [name for name in LOSS_TYPES if name != "kto"]
        raise Refused(f"pref_loss: {value} (MegaTrain's pair losses are {', '.join(allowed)})")
    return {"dpo.loss_type": value}


def neat_packing(value: Any, flat: Flat) -> dict[str, Any]:
    if not value:
        return {}
    # under sft MegaTrain's packing always keeps attention within each sample
    return {"data.neat_packing": True} if flat["stage"] == "pt" else {"data.packing": True}


def truncation_mode(value: Any, flat: Flat) -> dict[str, Any]:
    if value != "keep_start":
        raise Refused(
            f"truncation_mode: {value} (long samples keep their first tokens: keep_start)"
        )
    return {}


def media_dir(value: Any, flat: Flat) -> dict[str, Any]:
    if value not in (None, flat["dataset_dir"]):
        raise Refused(
            f"media_dir: {value} (images are read relative to dataset_dir: move them there, or "
            "give their paths in the data relative to it)"
        )
    return {}


def mix_strategy(value: Any, flat: Flat) -> dict[str, Any]:
    if value != "concat":
        raise Refused(f"mix_strategy: {value} (MegaTrain concatenates data sets: concat)")
    return {}


def whole_steps(key: str, value: Any) -> Any:
    if isinstance(value, float) and 0 < value < 1:
        raise Refused(f"{key}: {value} (a fraction of the run's steps; give a number of steps)")
    return value


def save_every(value: Any, flat: Flat) -> dict[str, Any]:
    if value == "steps":
        return {"checkpoint.save_every": whole_steps("save_steps", flat["save_steps"])}
    if value == "no":
        return {"checkpoint.save_every": 0}
    raise Refused(f"save_strategy: {value} (MegaTrain saves every save_steps steps: steps or no)")


def eval_every(value: Any, flat: Flat) -> dict[str, Any]:
    if value == "steps":
        every = flat.get("eval_steps") or flat["logging_steps"]  # as TrainingArguments does
        return {"training.eval_every": whole_steps("eval_steps", every)}
    if value == "no":
        return {"training.eval_every": 0}
    raise Refused(f"eval_strategy: {value} (MegaTrain evaluates every eval_steps: steps or no)")


def scheduler(value: Any, flat: Flat) -> dict[str, Any]:
    names = {"linear": "linear", "cosine": "cosine"}
    names |= {"constant": "constant", "constant_with_warmup": "constant"}
    if value not in names:
        raise Refused(f"lr_scheduler_type: {value} (MegaTrain has {', '.join(names)})")
    return {"optimizer.lr_scheduler": names[value]}


def warmup_ratio(value: Any, flat: Flat) -> dict[str, Any]:
    steps = flat.get("warmup_steps", 0)
    if flat["lr_scheduler_type"] == "constant" or (isinstance(steps, (int, float)) and steps >= 1):
        return {"optimizer.warmup_ratio": 0.0}  # TrainingArguments' constant has no warmup
    return {"optimizer.warmup_ratio": value}


def warmup_steps(value: Any, flat: Flat) -> dict[str, Any]:
    if flat["lr_scheduler_type"] == "constant":
        return {"optimizer.warmup_steps": 0}
    if isinstance(value, float) and 0 < value < 1:  # transformers 5: a fraction of the steps
        return {} if "warmup_ratio" in flat else {"optimizer.warmup_ratio": value}
    return {"optimizer.warmup_steps": value}


def betas(value: Any, flat: Flat) -> dict[str, Any]:
    return {"optimizer.betas": [flat.get("adam_beta1", 0.9), flat.get("adam_beta2", 0.999)]}


def optim(value: Any, flat: Flat) -> dict[str, Any]:
    if value in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused"):
        return {}
    if value in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit"):
        return {"optimizer.state_dtype": "int8"}
    raise Refused(
        f"optim: {value} (MegaTrain's optimizer is AdamW: adamw_torch, or adamw_8bit for "
        "block-wise 8-bit states)"
    )


def precision(value: Any, flat: Flat) -> dict[str, Any]:
    if flat.get("fp16"):
        raise Refused("fp16: true (MegaTrain computes in bf16 or fp32: set bf16: true instead)")
    return {"model.compute_dtype": "bf16" if value else "fp32"}


def seed(value: Any, flat: Flat) -> dict[str, Any]:
    owned = {"training.seed": value}
    return owned if "data_seed" in flat else {**owned, "data.seed": value}


def max_steps(value: Any, flat: Flat) -> dict[str, Any]:
    return {} if value is None or value == -1 else {"training.max_steps": value}


def resume(value: Any, flat: Flat) -> dict[str, Any]:
    if value is None or value is False:
        return {}
    return {"checkpoint.resume_from": "auto" if value is True else value}


def flash_attn(value: Any, flat: Flat) -> dict[str, Any]:
    names = {"auto": None, "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}
    if value not in names:
        raise Refused(f"flash_attn: {value} (MegaTrain runs {', '.join(names)})")
    return {"model.attn_implementation": names[value]}


def moe_aux(value: Any, flat: Flat) -> dict[str, Any]:
    if not value:
        return {}
    return {"model.config_overrides": {"router_aux_loss_coef": value, "output_router_logits": True}}


def precompute(value: Any, flat: Flat) -> dict[str, Any]:
    return {"dpo.reference": "precomputed" if value else "weights"}


def refuse_false(key: str, value: Any) -> dict[str, Any]:
    if value is False:
        raise Refused(f"{key}: false (MegaTrain trains: {key}: true)")
    return {}
