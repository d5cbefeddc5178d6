"""Other trainers' names for MegaTrain's keys: what an unknown key or section is called here.

A newcomer types the name they know from Hugging Face `TrainingArguments` or LLaMA-Factory
(`--training.save_steps 10`, `--lora.r 8`); spelling-distance suggestions then point at an
unrelated key (`training.max_steps`). `ALIASES` maps such a name (the key alone, whatever section
it was typed under) to the MegaTrain key, and `NOT_HERE` names what MegaTrain has no key for and
why. Read by the override and YAML key errors (config/loading.py); a translator of flat
LLaMA-Factory files may read the same table.

Invariant: every value of `ALIASES` is an existing `section.key` (tests/config/test_aliases.py).
"""

from __future__ import annotations

ALIASES: dict[str, str] = {
    "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "checkpoint.resume_from",
    "logging_steps": "logging.log_every",
    "eval_steps": "training.eval_every",
    "per_device_train_batch_size": "training.micro_batch_size",
    "train_batch_size": "training.micro_batch_size",
    "batch_size": "training.micro_batch_size",
    "num_train_epochs": "training.num_epochs",
    "epochs": "training.num_epochs",
    "torch_compile": "training.compile_layers",
    "model_name_or_path": "model.name_or_path",
    "flash_attn": "model.attn_implementation",
    "bf16": "model.compute_dtype",
    "fp16": "model.compute_dtype",
    "lr": "optimizer.learning_rate",
    "lr_scheduler_type": "optimizer.lr_scheduler",
    "optim": "optimizer.name",
    "adam_epsilon": "optimizer.eps",
    "adam_beta1": "optimizer.betas",
    "adam_beta2": "optimizer.betas",
    "max_seq_length": "data.cutoff_len",
    "max_length": "data.cutoff_len",
    "template": "data.chat_template",
    "val_set_size": "data.val_size",
    "stage": "data.stage",
}
"""Other trainers' key -> MegaTrain's `section.key` (one name, whatever section it was typed in)."""

NOT_HERE: dict[str, str] = {
    "lora": "MegaTrain trains every parameter at full precision (fp32 master weights and AdamW "
    "states in host RAM); it has no LoRA or other adapters: remove the lora keys",
    "finetuning_type": "MegaTrain always trains every parameter (full fine-tuning); remove it",
    "deepspeed": "MegaTrain streams layers from host RAM itself; no DeepSpeed config is read "
    "(remove it; several GPUs: torchrun, docs/multi_gpu.md)",
}
"""Names of features MegaTrain does not have (a key or a section), and what to do instead."""


def alias_hint(name: str, prefix: str = "") -> str:
    """The hint for an unknown key or section `name` ("" when the tables do not know it);
    `prefix` goes before the key suggested (`--` on the command line). A name's first word
    counts for `NOT_HERE` (`lora_rank` is a lora key)."""
    missing = NOT_HERE.get(name) or NOT_HERE.get(name.split("_")[0])
    if missing:
        return missing
    if name in ALIASES:
        return f"did you mean {prefix}{ALIASES[name]}? ({name} is its name in other trainers)"
    return ""
