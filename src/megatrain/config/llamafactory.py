"""LLaMA-Factory's and TRL's flat training YAML -> MegaTrain's config sections, by one table.

A LLaMA-Factory file (`llamafactory-cli train F`) or a TRL one (`trl sft --config F`) is one flat
mapping: Hugging Face TrainingArguments names plus the tool's own (`stage`, `dataset`,
`cutoff_len`, `pref_beta`, ...). The config loader (loading.py) tells it from a MegaTrain file by
its top-level keys (a MegaTrain file has only section names) and reads it through `translate`, so
`megatrain train --config F` runs it as written; `--print-config` prints the MegaTrain config it
becomes. docs/configuration.md lists the table (rendered from it by config/reference.py).

- KEYS: a key with a MegaTrain meaning -> the Rule writing it (llamafactory_rules.py: the MegaTrain
  keys it sets, how the value converts, which values are refused: what MegaTrain does not do,
  e.g. finetuning_type: lora, stage: ppo; all of a file's refusals make one paragraph).
- ALIASES: TRL's names for LLaMA-Factory's keys (`beta` is `pref_beta`, `max_length` `cutoff_len`).
- IGNORED: keys that configure only what MegaTrain replaces (DeepSpeed, dataloader workers, the
  chat template's name: the tokenizer's own template is used), named once in one line.
- DEFAULTS: LLaMA-Factory's / TrainingArguments' defaults that differ from MegaTrain's, filled in
  for keys a file leaves out, so that the file means what it means there (dataset_dir: data, ...).

Invariants: every key of a flat file is in KEYS, ALIASES or IGNORED, else one error names it (with
the nearest known key); every refused value of a file is named in one paragraph; the rules see the
file with DEFAULTS filled in, so their order does not matter, and two keys setting one MegaTrain
key to different values (packing: false, neat_packing: true) are an error naming both.
No torch, no transformers: config errors answer at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import megatrain.config.llamafactory_rules as rules
from megatrain.config.llamafactory_rules import Rule, off, read_by, to

_METHOD = "another training method; MegaTrain trains every parameter with AdamW"

KEYS: dict[str, Rule] = {
    # model
    "model_name_or_path": to("model.name_or_path"),
    "trust_remote_code": to("model.trust_remote_code"),
    "flash_attn": Rule(
        "model.attn_implementation", rules.flash_attn, "auto: null, fa2, sdpa, disabled"
    ),
    "attn_implementation": to("model.attn_implementation"),
    "moe_aux_loss_coef": Rule("model.config_overrides", rules.moe_aux, "with output_router_logits"),
    "freeze_vision_tower": to("model.freeze_vision"),
    "freeze_multi_modal_projector": to("model.freeze_projector"),
    "freeze_language_model": off("freeze_language_model: true (the language model always trains)"),
    "bf16": Rule("model.compute_dtype", rules.precision, "true: bf16, false: fp32"),
    "fp16": read_by("bf16"),
    "image_max_pixels": to("data.image_max_pixels"),
    "image_min_pixels": to("data.image_min_pixels"),
    "adapter_name_or_path": off("adapter_name_or_path (merge the adapter into the model first)"),
    "quantization_bit": off("quantization_bit (QLoRA; MegaTrain keeps fp32 master weights)"),
    "rope_scaling": off("rope_scaling (set it in the model's config.json)"),
    "resize_vocab": off("resize_vocab (resize the embeddings in the model folder first)"),
    "use_unsloth": off("use_unsloth (MegaTrain runs its own layer streaming)"),
    "mixture_of_depths": off(f"mixture_of_depths ({_METHOD})"),
    # method
    "stage": Rule("data.stage", rules.stage, "sft, pt, dpo, kto; rm and ppo refused"),
    "finetuning_type": Rule("", rules.finetuning_type, "full; lora, freeze, oft refused"),
    "do_train": Rule("", lambda v, f: rules.refuse_false("do_train", v), "true"),
    "do_predict": off("do_predict: true (prediction; MegaTrain trains)"),
    "predict_with_generate": off("predict_with_generate: true (prediction; MegaTrain trains)"),
    "pref_beta": to("dpo.beta"),
    "pref_loss": Rule("dpo.loss_type", rules.pref_loss, "stage kto: kto"),
    "pref_ftx": to("dpo.rpo_alpha"),
    "simpo_gamma": to("dpo.simpo_gamma"),
    "dpo_label_smoothing": to("dpo.label_smoothing"),
    "kto_chosen_weight": to("dpo.desirable_weight"),
    "kto_rejected_weight": to("dpo.undesirable_weight"),
    "precompute_ref_log_probs": Rule("dpo.reference", rules.precompute, "false: weights"),
    "ref_model": off("ref_model (the reference is the initial weights: dpo.reference)"),
    "use_peft": off("use_peft: true (LoRA; MegaTrain trains every parameter)"),
    **{
        key: off(f"{key}: true ({_METHOD})")
        for key in (
            "use_galore",
            "use_apollo",
            "use_badam",
            "use_muon",
            "use_adam_mini",
            "use_llama_pro",
            "use_dft_loss",
            "use_asft_loss",
            "use_eaft_loss",
            "use_kt",
            "use_mca",
        )
    },
    "neftune_noise_alpha": off(f"neftune_noise_alpha ({_METHOD})"),
    "label_smoothing_factor": off("label_smoothing_factor (the loss is plain cross-entropy)"),
    # dataset
    "dataset": to("data.dataset"),
    "eval_dataset": to("data.eval_dataset"),
    "dataset_dir": to("data.dataset_dir"),
    "media_dir": Rule("", rules.media_dir, "must be dataset_dir"),
    "cutoff_len": to("data.cutoff_len"),
    "max_samples": to("data.max_samples"),
    "val_size": to("data.val_size"),
    "packing": to("data.packing"),
    "neat_packing": Rule(
        "data.packing / data.neat_packing", rules.neat_packing, "pt: neat_packing"
    ),
    "train_on_prompt": to("data.train_on_prompt"),
    "default_system": to("data.system_prompt"),
    "chat_template_path": to("data.chat_template", "a .jinja file"),
    "assistant_only_loss": to("data.train_on_prompt", "negated", lambda v: not v),
    "pad_to_multiple_of": to("data.pad_to_multiple_of"),
    "truncation_mode": Rule("", rules.truncation_mode, "keep_start"),
    "eos_token": off("eos_token (set it in the tokenizer's folder)"),
    "pad_token": off("pad_token (set it in the tokenizer's folder)"),
    "sync_ref_model": off("sync_ref_model: true (the reference is the initial weights)"),
    "data_seed": to("data.seed"),
    "mix_strategy": Rule("", rules.mix_strategy, "concat"),
    "mask_history": off("mask_history: true (every assistant turn trains: data.multi_turn)"),
    "streaming": off("streaming: true (data sets are read whole)"),
    "tokenized_path": off("tokenized_path (MegaTrain keeps its own data cache)"),
    # output
    "output_dir": to("training.output_dir"),
    "overwrite_output_dir": to("training.overwrite_output_dir"),
    "logging_steps": to("logging.log_every"),
    "save_strategy": Rule("checkpoint.save_every", rules.save_every, "steps: save_steps; no: 0"),
    "save_steps": read_by("save_strategy"),
    "save_total_limit": to("checkpoint.keep_last"),
    "report_to": to("logging.report_to"),
    "run_name": to("logging.run_name"),
    "disable_tqdm": to("logging.progress_bar", "negated", lambda v: not v),
    "resume_from_checkpoint": Rule("checkpoint.resume_from", rules.resume, "true: auto"),
    "push_to_hub": off("push_to_hub: true (upload output_dir/hf_model yourself)"),
    # train
    "per_device_train_batch_size": Rule(
        "training.micro_batch_size", rules.batch, "rows; x2 under dpo and kto (a pair is two rows)"
    ),
    "gradient_accumulation_steps": to("training.gradient_accumulation_steps"),
    "learning_rate": to("optimizer.learning_rate"),
    "num_train_epochs": to("training.num_epochs"),
    "max_steps": Rule("training.max_steps", rules.max_steps, "-1: null"),
    "lr_scheduler_type": Rule(
        "optimizer.lr_scheduler", rules.scheduler, "linear, cosine, constant"
    ),
    "warmup_ratio": Rule(
        "optimizer.warmup_ratio",
        rules.warmup_ratio,
        "0 with constant; round(ratio x steps) warmup steps, where transformers takes the ceiling",
    ),
    "warmup_steps": Rule("optimizer.warmup_steps", rules.warmup_steps, "< 1: warmup_ratio"),
    "weight_decay": to("optimizer.weight_decay"),
    "adam_beta1": Rule("optimizer.betas", rules.betas),
    "adam_beta2": Rule("optimizer.betas", rules.betas),
    "adam_epsilon": to("optimizer.eps"),
    "max_grad_norm": to("optimizer.max_grad_norm"),
    "optim": Rule("optimizer.state_dtype", rules.optim, "adamw_torch; adamw_8bit: int8"),
    "seed": Rule("training.seed, data.seed", rules.seed),
    "torch_compile": to("training.compile_layers"),
    "use_cpu": Rule("training.device", lambda v, f: {"training.device": "cpu"} if v else {}),
    "eval_strategy": Rule("training.eval_every", rules.eval_every, "steps: eval_steps; no: 0"),
    "eval_steps": read_by("eval_strategy"),
}
"""Flat key -> how it maps (README of this module)."""

ALIASES: dict[str, str] = {
    "dataset_name": "dataset",
    "max_length": "cutoff_len",
    "max_seq_length": "cutoff_len",
    "beta": "pref_beta",
    "loss_type": "pref_loss",
    "rpo_alpha": "pref_ftx",
    "label_smoothing": "dpo_label_smoothing",
    "desirable_weight": "kto_chosen_weight",
    "undesirable_weight": "kto_rejected_weight",
    "evaluation_strategy": "eval_strategy",
    "no_cuda": "use_cpu",
    "router_aux_loss_coef": "moe_aux_loss_coef",
}
"""TRL's (and older transformers') name -> the LLaMA-Factory / TrainingArguments name."""

IGNORED: tuple[str, ...] = (
    # distributed back ends and their settings: MegaTrain streams layers itself
    "deepspeed", "fsdp", "fsdp_config", "ddp_timeout", "ddp_backend",
    "ddp_find_unused_parameters", "local_rank",
    # data loading and caching
    "preprocessing_num_workers", "preprocessing_batch_size", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_drop_last", "overwrite_cache", "remove_unused_columns",
    "per_device_eval_batch_size",
    # the chat template by name: the tokenizer's own template is used (or data.chat_template)
    "template", "enable_thinking", "tool_format",
    # recomputation, kernels and load dtypes: the engine's own
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "disable_gradient_checkpointing",
    "use_reentrant_gc", "enable_liger_kernel", "use_liger_kernel", "torch_dtype", "dtype",
    "low_cpu_mem_usage", "use_fast_tokenizer", "model_init_kwargs", "disable_dropout",
    "activation_offloading", "padding_free", "packing_strategy", "eval_packing",
    "dataset_num_proc", "precompute_ref_batch_size", "shuffle_dataset",
    # logging and saving: metrics.jsonl and the trackers, resumable checkpoints + the HF export
    "plot_loss", "logging_dir", "logging_strategy", "logging_first_step", "save_only_model",
    "include_num_input_tokens_seen", "include_tokens_per_second", "print_param_status",
    "include_effective_tokens_per_second", "do_eval",
    # LoRA / OFT / freeze settings (finetuning_type lora, oft, freeze are refused)
    "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "lora_r", "lora_target_modules",
    "oft_rank", "oft_block_size", "oft_target", "freeze_trainable_layers",
    "freeze_trainable_modules", "freeze_extra_modules", "lora_modules_to_save",
    "lora_target_parameters", "lora_task_type", "use_rslora", "use_dora",
    # video settings: video data are refused by the data registry
    "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen",
)  # fmt: skip
"""Keys that configure only what MegaTrain replaces: read and named once as ignored."""

DEFAULTS: dict[str, Any] = {
    "stage": "sft",
    "dataset_dir": "data",
    "cutoff_len": 2048,
    "per_device_train_batch_size": 8,
    "learning_rate": 5e-5,
    "num_train_epochs": 3.0,
    "lr_scheduler_type": "linear",
    "logging_steps": 500,
    "save_strategy": "steps",
    "save_steps": 500,
    "eval_strategy": "no",
    "report_to": "none",
    "bf16": False,
    "pref_loss": "sigmoid",
    "output_dir": "trainer_output",
}
"""LLaMA-Factory's / transformers 5 TrainingArguments' defaults where MegaTrain's differ."""


def is_flat(raw: Mapping[str, Any], sections: Mapping[str, Any]) -> bool:
    """Whether a YAML file's top level holds flat keys rather than MegaTrain `sections`."""
    return any(key not in sections and _known(key) for key in raw)


def translate(
    raw: Mapping[str, Any], where: str, sections: Mapping[str, Any], *, stage: str = "sft"
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(MegaTrain sections {section: {key: value}}, the ignored keys of the file) of flat file
    `raw` (named `where` in errors); `stage`: the command's stage when the file sets none."""
    _check_keys(raw, where, sections)
    flat: dict[str, Any] = {ALIASES.get(key, key): value for key, value in raw.items()}
    flat = {**DEFAULTS, "stage": stage, **flat}
    out: dict[str, dict[str, Any]] = {}
    writer: dict[str, str] = {}  # MegaTrain key -> the flat key that set it
    refused: list[str] = []
    for key, value in flat.items():
        if key in IGNORED:
            continue
        try:
            written = KEYS[key].convert(value, flat)
        except rules.Refused as e:
            refused.append(str(e))
            continue
        for target, new in written.items():
            section, _, name = target.partition(".")
            body = out.setdefault(section, {})
            if body.get(name, new) != new:
                raise ValueError(
                    f"{where}: {writer[target]} and {key} disagree on {target} "
                    f"({body[name]!r} and {new!r}); keep one of them"
                )
            body[name], writer[target] = new, key
    if refused:
        raise ValueError(
            f"{where} is a LLaMA-Factory / TRL config that asks for what MegaTrain does not do: "
            + "; ".join(refused)
            + ". MegaTrain trains every parameter of the model (fp32 master weights and AdamW "
            "states in host RAM): SFT and pre-training with `megatrain train`, DPO and KTO with "
            "`megatrain dpo`, RL with `megatrain grpo`; change or remove these keys "
            "(docs/configuration.md, LLaMA-Factory and TRL files)"
        )
    return out, [key for key in raw if key in IGNORED]


def ignored_line(where: str, keys: list[str]) -> str:
    """The one line naming a file's ignored keys."""
    return f"{where}: ignored (they configure what MegaTrain does its own way): {', '.join(keys)}"


def _known(key: str) -> bool:
    return key in KEYS or key in ALIASES or key in IGNORED


def _check_keys(raw: Mapping[str, Any], where: str, sections: Mapping[str, Any]) -> None:
    mixed = [key for key in raw if key in sections]
    if mixed:
        flat = [key for key in raw if key not in sections]
        raise ValueError(
            f"{where} mixes MegaTrain sections ({', '.join(map(str, mixed))}) with LLaMA-Factory / "
            f"TRL keys ({', '.join(map(str, flat[:5]))}, ...); write one form: keep the flat keys "
            "and give MegaTrain settings as --section.key VALUE overrides, or convert the flat "
            "keys with `megatrain train --config FILE --print-config`"
        )
    for key, alias in ALIASES.items():
        if key in raw and alias in raw:
            raise ValueError(f"{where}: {key} and {alias} are the same setting; keep one")
    unknown = [str(key) for key in raw if not _known(str(key))]
    if unknown:
        known = [*KEYS, *ALIASES, *IGNORED]
        hints = [
            f"{key} (did you mean {near[0]}?)" if near else key
            for key in unknown
            for near in [difflib.get_close_matches(key, known, n=1)]
        ]
        raise ValueError(
            f"{where} is a LLaMA-Factory / TRL config with keys MegaTrain does not know: "
            f"{', '.join(hints)}; remove them, or write them as MegaTrain keys (--section.key "
            "VALUE overrides; docs/configuration.md lists both)"
        )
