"""LLaMA-Factory / TRL flat files read as MegaTrain configs (config/llamafactory.py): each key's
MegaTrain value, LLaMA-Factory's defaults for keys left out, the one ignored line, the one refusal
paragraph, unknown and mixed keys, and `--print-config`, whose output loads back to the same
config. LLaMA-Factory's own files: tests/data_fixtures/llamafactory/examples/ (runs of them:
tests/commands/test_llamafactory_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.cli import main
from megatrain.config import TrainConfig, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "data_fixtures"
EXAMPLES = FIXTURES / "llamafactory" / "examples"


def _write(tmp_path: Path, text: str, name: str = "lf.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_llama3_full_sft_maps_key_by_key(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(EXAMPLES / "llama3_full_sft.yaml")
    assert cfg.model.name_or_path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert cfg.model.trust_remote_code is True
    assert cfg.model.compute_dtype == "bf16"  # bf16: true
    d = cfg.data
    assert (d.stage, d.dataset, d.dataset_dir) == ("sft", "identity,alpaca_en_demo", "data")
    assert (d.cutoff_len, d.max_samples, d.val_size) == (2048, 1000, 0.0)
    t = cfg.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.num_epochs) == (1, 2, 3.0)
    assert (t.output_dir, t.overwrite_output_dir, t.max_steps) == (
        "saves/llama3-8b/full/sft",
        True,
        None,
    )
    o = cfg.optimizer
    assert (o.learning_rate, o.lr_scheduler, o.warmup_ratio, o.warmup_steps) == (
        1e-5,
        "cosine",
        0.1,
        0,
    )
    assert (cfg.logging.log_every, cfg.logging.report_to) == (10, "none")
    assert (cfg.checkpoint.save_every, cfg.checkpoint.resume_from) == (500, None)
    err = capsys.readouterr().err
    assert err == (
        f"{EXAMPLES / 'llama3_full_sft.yaml'}: ignored (they configure what MegaTrain does its "
        "own way): deepspeed, template, overwrite_cache, preprocessing_num_workers, "
        "dataloader_num_workers, plot_loss, save_only_model, ddp_timeout\n"
    )


def test_preference_files_count_rows_and_set_the_loss() -> None:
    dpo = load_config(EXAMPLES / "qwen3_lora_dpo.yaml")  # finetuning_type: full in the copy
    assert (dpo.data.stage, dpo.dpo.loss_type, dpo.dpo.beta) == ("dpo", "sigmoid", 0.1)
    # per_device_train_batch_size: 1 pair = 2 rows (chosen and rejected in one micro-batch)
    assert (dpo.training.micro_batch_size, dpo.training.gradient_accumulation_steps) == (2, 8)
    assert dpo.optimizer.learning_rate == 5e-6
    kto = load_config(EXAMPLES / "qwen3_lora_kto.yaml")
    assert (kto.data.stage, kto.dpo.loss_type, kto.training.micro_batch_size) == ("kto", "kto", 2)
    pt = load_config(EXAMPLES / "qwen3_lora_pretrain.yaml")
    assert (pt.data.stage, pt.data.dataset, pt.training.micro_batch_size) == ("pt", "c4_demo", 1)
    vl = load_config(EXAMPLES / "qwen2_5vl_full_sft.yaml")
    assert (vl.data.image_max_pixels, vl.model.freeze_vision, vl.model.freeze_projector) == (
        262144,
        True,
        True,
    )


def _flat(tmp_path: Path, text: str) -> TrainConfig:
    """A flat file of `text` (and a model) loaded."""
    return load_config(_write(tmp_path, f"model_name_or_path: m\n{text}\n"))


def test_lora_and_reward_files_get_one_paragraph(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as lora:
        load_config(EXAMPLES / "qwen3_lora_sft.yaml")
    msg = str(lora.value)
    assert "is a LLaMA-Factory / TRL config that asks for what MegaTrain does not do: " in msg
    assert "finetuning_type: lora (no adapter or frozen layers are needed" in msg
    assert "set finetuning_type: full)" in msg and "\n" not in msg
    with pytest.raises(ValueError) as reward:
        load_config(EXAMPLES / "qwen3_lora_reward.yaml")
    msg = str(reward.value)
    assert "stage: rm (a reward model" in msg and "; finetuning_type: lora (" in msg
    with pytest.raises(ValueError) as several:
        _flat(
            tmp_path, "stage: ppo\nfp16: true\noptim: sgd\nuse_galore: true\neval_strategy: epoch"
        )
    msg = str(several.value)
    for part in (
        "stage: ppo (MegaTrain's RL is GRPO",
        "fp16: true (MegaTrain computes in bf16 or fp32: set bf16: true instead)",
        "optim: sgd (MegaTrain's optimizer is AdamW",
        "use_galore: true (another training method",
        "eval_strategy: epoch (",
    ):
        assert part in msg


def test_left_out_keys_take_llamafactory_defaults(tmp_path: Path) -> None:
    cfg = _flat(tmp_path, "dataset: identity")
    assert (cfg.data.dataset_dir, cfg.data.cutoff_len, cfg.data.stage) == ("data", 2048, "sft")
    assert (cfg.training.micro_batch_size, cfg.training.num_epochs) == (8, 3.0)
    assert cfg.training.output_dir == "trainer_output"
    assert (cfg.optimizer.learning_rate, cfg.optimizer.lr_scheduler) == (5e-5, "linear")
    assert cfg.model.compute_dtype == "fp32"  # TrainingArguments' bf16: false
    assert (cfg.logging.log_every, cfg.logging.report_to) == (500, "none")
    assert (cfg.checkpoint.save_every, cfg.training.eval_every) == (500, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("warmup_steps: 0.05", {"optimizer.warmup_ratio": 0.05, "optimizer.warmup_steps": 0}),
        ("warmup_steps: 7\nwarmup_ratio: 0.1", {"optimizer.warmup_steps": 7}),
        ("lr_scheduler_type: constant\nwarmup_ratio: 0.1", {"optimizer.warmup_ratio": 0.0}),
        ("lr_scheduler_type: constant_with_warmup", {"optimizer.lr_scheduler": "constant"}),
        ("adam_beta2: 0.95", {"optimizer.betas": (0.9, 0.95)}),
        ("adam_beta1: 0.8\nadam_epsilon: 1.0e-6", {"optimizer.betas": (0.8, 0.999)}),
        ("optim: adamw_8bit", {"optimizer.state_dtype": "int8"}),
        ("max_grad_norm: 0.5\nweight_decay: 0.1", {"optimizer.max_grad_norm": 0.5}),
        ("eval_strategy: steps\nval_size: 0.1\nlogging_steps: 5", {"training.eval_every": 5}),
        ("eval_strategy: steps\neval_steps: 20\nval_size: 2", {"training.eval_every": 20}),
        ("save_strategy: 'no'", {"checkpoint.save_every": 0}),
        ("save_total_limit: 3", {"checkpoint.keep_last": 3}),
        ("max_steps: -1", {"training.max_steps": None}),
        ("resume_from_checkpoint: true", {"checkpoint.resume_from": "auto"}),
        ("seed: 7", {"training.seed": 7, "data.seed": 7}),
        ("seed: 7\ndata_seed: 3", {"training.seed": 7, "data.seed": 3}),
        ("neat_packing: true", {"data.packing": True}),
        ("stage: pt\nneat_packing: true", {"data.neat_packing": True}),
        ("flash_attn: fa2", {"model.attn_implementation": "flash_attention_2"}),
        ("flash_attn: disabled", {"model.attn_implementation": "eager"}),
        ("disable_tqdm: true", {"logging.progress_bar": False}),
        ("report_to: [wandb, tensorboard]", {"logging.report_to": ("wandb", "tensorboard")}),
        ("use_cpu: true", {"training.device": "cpu"}),
        ("default_system: Be brief.", {"data.system_prompt": "Be brief."}),
        ("moe_aux_loss_coef: 0.001",
         {"model.config_overrides": {"router_aux_loss_coef": 1e-3, "output_router_logits": True}}),
        # TRL's names
        ("max_length: 512\ndataset_name: d.jsonl",
         {"data.cutoff_len": 512, "data.dataset": "d.jsonl"}),
        ("stage: dpo\nbeta: 0.3\nloss_type: ipo\nper_device_train_batch_size: 4",
         {"dpo.beta": 0.3, "dpo.loss_type": "ipo", "training.micro_batch_size": 8}),
        ("stage: dpo\nprecompute_ref_log_probs: false", {"dpo.reference": "weights"}),
        ("stage: kto\ndesirable_weight: 1.5\npref_loss: ipo", {"dpo.desirable_weight": 1.5,
         "dpo.loss_type": "kto"}),
    ],
)  # fmt: skip
def test_value_conversions(tmp_path: Path, text: str, expected: dict[str, object]) -> None:
    cfg = _flat(tmp_path, text)
    for key, value in expected.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, key


def test_megatrain_dpo_reads_a_file_without_stage_as_dpo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trl = _write(tmp_path, "model_name_or_path: m\nbeta: 0.2\nper_device_train_batch_size: 2\n")
    assert main(["dpo", "--config", str(trl), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "data:\n  stage: dpo\n" in out and "micro_batch_size: 4\n" in out
    assert "dpo:\n  beta: 0.2\n" in out


def test_unknown_mixed_and_doubled_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keys MegaTrain does not know: learning_rat \(did you "
                       r"mean learning_rate\?\)"):  # fmt: skip
        _flat(tmp_path, "learning_rat: 1.0e-5")
    with pytest.raises(ValueError, match=r"mixes MegaTrain sections \(training\) with "):
        _flat(tmp_path, "training:\n  seed: 1")
    with pytest.raises(ValueError, match=r"max_length and cutoff_len are the same setting"):
        _flat(tmp_path, "max_length: 512\ncutoff_len: 512")
    with pytest.raises(ValueError, match=r"packing and neat_packing disagree on data\.packing "
                       r"\(False and True\); keep one"):  # fmt: skip
        _flat(tmp_path, "packing: false\nneat_packing: true")
    with pytest.raises(ValueError, match=r"lf\.yaml \(LLaMA-Factory / TRL keys, read as the "
                       r"MegaTrain keys .*: training\.max_steps=0 must be"):  # fmt: skip
        _flat(tmp_path, "max_steps: 0")


def test_trl_cli_config_reads_the_same_way() -> None:
    cfg = load_config(FIXTURES / "trl" / "example_config.yaml")  # TRL's own, as shipped
    assert (cfg.model.name_or_path, cfg.data.dataset) == ("Qwen/Qwen2.5-0.5B", "stanfordnlp/imdb")
    assert (cfg.optimizer.learning_rate, cfg.optimizer.lr_scheduler) == (1e-4, "cosine")
    assert cfg.logging.report_to == "none"


def test_trl_sft_and_dpo_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sft = _flat(
        tmp_path,
        "dataset_name: d.jsonl\nmax_length: 512\nassistant_only_loss: false\nloss_type: nll\n"
        "chat_template_path: t.jinja\npad_to_multiple_of: 16\ndtype: bfloat16\n"
        "gradient_checkpointing: true\nuse_peft: false\nlora_r: 16\n"
        "router_aux_loss_coef: 0.01",
    )
    d = sft.data
    assert (d.dataset, d.cutoff_len, d.train_on_prompt) == ("d.jsonl", 512, True)
    assert (d.chat_template, d.pad_to_multiple_of, sft.dpo.loss_type) == ("t.jinja", 16, "sigmoid")
    assert sft.model.config_overrides == {
        "router_aux_loss_coef": 0.01,
        "output_router_logits": True,
    }
    assert capsys.readouterr().err.endswith(": dtype, gradient_checkpointing, lora_r\n")
    dpo = _flat(tmp_path, "stage: dpo\nloss_type: [hinge]\nbeta: 0.05\nmax_length: 256")
    assert (dpo.dpo.loss_type, dpo.dpo.beta, dpo.data.cutoff_len) == ("hinge", 0.05, 256)
    with pytest.raises(ValueError, match=r"loss_type: dft \(MegaTrain's SFT loss is"):
        _flat(tmp_path, "loss_type: dft")
    with pytest.raises(ValueError, match=r"truncation_mode: keep_end \(long samples keep"):
        _flat(tmp_path, "truncation_mode: keep_end")


def test_overrides_apply_on_top(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "qwen3_full_sft.yaml", ["--training.max_steps", "3"])
    assert (cfg.training.max_steps, cfg.training.gradient_accumulation_steps) == (3, 2)


@pytest.mark.parametrize(
    ("name", "command"),
    [
        ("llama3_full_sft.yaml", "train"),
        ("qwen3_full_sft.yaml", "train"),
        ("qwen2_5vl_full_sft.yaml", "train"),
        ("qwen3_lora_pretrain.yaml", "train"),
        ("qwen3_lora_dpo.yaml", "dpo"),
        ("qwen3_lora_kto.yaml", "dpo"),
    ],
)
def test_print_config_loads_back_to_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, command: str
) -> None:
    assert main([command, "--config", str(EXAMPLES / name), "--print-config"]) == 0
    native = _write(tmp_path, capsys.readouterr().out, "native.yaml")
    assert native.read_text().startswith(
        f"# The MegaTrain config of {EXAMPLES / name} (keys at their defaults left out):\n"
        f"#   megatrain {command} --config <this file>\nmodel:\n  name_or_path: "
    )
    base = {"data": {"stage": "dpo"}} if command == "dpo" else None
    assert load_config(native, base=base) == load_config(EXAMPLES / name, base=base)
