"""megatrain.config: defaults, YAML round trip, CLI overrides, and every error naming its key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from megatrain.config import (
    SECTIONS,
    CheckpointConfig,
    LoggingConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
    TrainingConfig,
    config_to_dict,
    load_config,
    parse_overrides,
    save_config,
)
from megatrain.data.config import DataConfig

TINY = ["--model.model_type", "llama", "--model.tiny", "true", "--model.tokenizer", "demo"]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_section_defaults_validate_and_a_model_is_required() -> None:
    for cls in (TrainingConfig, OptimizerConfig, MemoryConfig, LoggingConfig, CheckpointConfig):
        cls().validate()
    TrainConfig(model=ModelConfig(name_or_path="Qwen/Qwen3-8B")).validate()
    with pytest.raises(ValueError, match=r"no model: set model\.name_or_path .* model\.model_type"):
        TrainConfig().validate()
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(TrainConfig)]
    assert SECTIONS["data"] is DataConfig


def test_none_path_gives_defaults_plus_overrides() -> None:
    cfg = load_config(None, TINY)
    assert cfg == TrainConfig(model=ModelConfig(model_type="llama", tiny=True, tokenizer="demo"))


def test_yaml_round_trip_is_exact(tmp_path: Path) -> None:
    cfg = TrainConfig(
        model=ModelConfig(
            name_or_path="Qwen/Qwen3-8B",
            attn_implementation="sdpa",
            config_overrides={"output_router_logits": True, "rope_scaling": {"factor": 2.0}},
        ),
        data=DataConfig(dataset=["a.jsonl", "b"], cutoff_len=512, packing=True, val_size=0.1),
        training=TrainingConfig(micro_batch_size="auto", seq_len=1024, eval_every=10),
        optimizer=OptimizerConfig(
            learning_rate=3e-5, betas=(0.9, 0.95), no_decay=(r"\.bias$",), warmup_ratio=0.1
        ),
        memory=MemoryConfig(loss_chunk_tokens=4096, pin_memory=False),
        logging=LoggingConfig(report_to=("wandb", "mlflow"), timeline=True),
        checkpoint=CheckpointConfig(resume_from="auto", export_dtype="fp32"),
    )
    cfg.validate()
    path = tmp_path / "out" / "config.yaml"
    save_config(cfg, path)
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.optimizer.betas == (0.9, 0.95) and isinstance(loaded.optimizer.betas, tuple)
    assert yaml.safe_load(path.read_text())["optimizer"]["learning_rate"] == 3e-5
    # rewritten in place atomically: no temporary file is left next to it
    save_config(dataclasses.replace(cfg, logging=LoggingConfig(log_every=7)), path)
    assert load_config(path).logging.log_every == 7
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]


def test_config_to_dict_is_plain_yaml_data() -> None:
    d = config_to_dict(load_config(None, TINY))
    assert list(d) == list(SECTIONS)
    assert d["optimizer"]["betas"] == [0.9, 0.999]
    assert d["optimizer"]["no_decay"] == ["bias", "norm"]
    yaml.safe_dump(d)  # only plain types: the safe dumper accepts it


def test_yaml_file_values_and_exponent_floats(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "model:\n  name_or_path: Qwen/Qwen3-8B\n"
        "optimizer:\n  learning_rate: 1e-5\n  weight_decay: 0\n  betas: [0.9, 0.95]\n"
        "data:\n  dataset: a,b\n  val_size: 100\n"
        "memory:\nlogging: null\n",
    )
    cfg = load_config(path)
    assert cfg.optimizer.learning_rate == 1e-5
    assert isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.data.dataset_names() == ["a", "b"]
    assert cfg.memory == MemoryConfig() and cfg.logging == LoggingConfig()
    # the global safe loader is left as it is (YAML 1.1: `1e-5` without a dot is a string)
    assert yaml.safe_load("1e-5") == "1e-5"


def test_override_forms_and_types(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  name_or_path: Qwen/Qwen3-8B\ntraining:\n  seed: 1\n")
    cfg = load_config(
        path,
        [
            "--optimizer.learning_rate",
            "2e-5",
            "--optimizer.betas=[0.8, 0.9]",
            "--optimizer.max_grad_norm",
            "2",
            "--training.max_steps=30",
            "--training.micro_batch_size",
            "auto",
            "--logging.report_to",
            "none",
            "--data.dataset",
            "a,b",
            "--data.eval_dataset=[e1, e2]",
            "--data.system_prompt",
            "Note: answer briefly",
            "--checkpoint.resume_from",
            "null",
            "--model.config_overrides.vocab_size",
            "512",
            "--model.config_overrides.output_router_logits=true",
            "--training.seed",
            "7",
        ],
    )
    assert cfg.optimizer.learning_rate == 2e-5
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.optimizer.max_grad_norm == 2.0 and isinstance(cfg.optimizer.max_grad_norm, float)
    assert cfg.training.max_steps == 30 and cfg.training.micro_batch_size == "auto"
    assert cfg.training.seed == 7  # the override beats the file
    assert cfg.logging.report_to == "none"
    assert cfg.data.dataset == "a,b" and cfg.data.eval_dataset == ["e1", "e2"]
    assert cfg.data.system_prompt == "Note: answer briefly"  # not read as a YAML mapping
    assert cfg.checkpoint.resume_from is None
    assert cfg.model.config_overrides == {"vocab_size": 512, "output_router_logits": True}
    assert cfg.model.name_or_path == "Qwen/Qwen3-8B"


def test_string_field_keeps_text_that_yaml_would_turn_into_another_type() -> None:
    cfg = load_config(None, [*TINY, "--training.output_dir", "2024", "--model.tokenizer", "true"])
    assert cfg.training.output_dir == "2024"
    assert cfg.model.tokenizer == "true"


def test_parse_overrides_pairs_and_token_errors() -> None:
    assert parse_overrides(["--a.b", "1", "--c.d=x=y", "--e.f", "-3"]) == [
        ("a.b", "1"),
        ("c.d", "x=y"),
        ("e.f", "-3"),
    ]
    with pytest.raises(ValueError, match=r"--training\.seed has no value"):
        parse_overrides(["--training.seed", "--training.max_steps", "3"])
    with pytest.raises(ValueError, match=r"--training\.seed has no value"):
        parse_overrides(["--training.seed"])
    with pytest.raises(ValueError, match=r"'training\.seed=3' is not of the form --section\.key"):
        parse_overrides(["training.seed=3"])


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_config(missing)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_config(tmp_path)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "model:\n  name_or_path: x/y\ntraining:\n  seed: [1, 2\n  device: cpu\n"
    )
    with pytest.raises(ValueError, match=re.escape(str(path)) + r":\d+: invalid YAML") as err:
        load_config(path)
    line = int(str(err.value).split(":")[1])
    assert 4 <= line <= 6  # the unclosed list opens on line 4
    with pytest.raises(ValueError, match="top level must be a mapping of sections"):
        load_config(_write(tmp_path, "- model\n- data\n"))
    with pytest.raises(ValueError, match=r"training=5 must be a mapping of training keys"):
        load_config(_write(tmp_path, "training: 5\n"))


def test_unknown_key_lists_allowed_keys_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_config(None, [*TINY, "--training.learnin_rate", "1e-4"])
    msg = str(err.value)
    assert "unknown key training.learnin_rate" in msg
    assert "did you mean optimizer.learning_rate?" in msg
    assert "training takes: output_dir, seed, micro_batch_size" in msg
    path = _write(tmp_path, "optimizer:\n  warmup_step: 10\n")
    with pytest.raises(
        ValueError, match=r"optimizer\.warmup_step; did you mean optimizer\.warmup_steps\?"
    ):
        load_config(path)
    with pytest.raises(ValueError, match=r"unknown key memory\.zzz; memory takes: num_slots"):
        load_config(None, ["--memory.zzz", "1"])


def test_unknown_section_suggests(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown section 'trainig'; did you mean training\?"):
        load_config(None, ["--trainig.seed", "1"])
    # (a top-level learning_rate is a LLaMA-Factory key: tests/config/test_llamafactory.py)
    with pytest.raises(ValueError, match=r"'micro_batch_size'; did you mean training\.micro_batch"):
        load_config(_write(tmp_path, "micro_batch_size: 2\n"))
    with pytest.raises(ValueError, match=r"e\.g\. --optimizer\.learning_rate"):
        load_config(None, ["--learning_rate", "1e-5"])
    with pytest.raises(ValueError, match=r"training\.seed has no sub-key 'x'"):
        load_config(None, ["--training.seed.x", "1"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            ["--optimizer.learning_rate", "fast"],
            "optimizer.learning_rate='fast' has the wrong type (str); expected a number",
        ),
        (
            ["--optimizer.betas", "0.9"],
            "optimizer.betas=0.9 has the wrong type (float); expected a list of 2 numbers",
        ),
        (["--optimizer.betas", "[0.9]"], "expected a list of 2 numbers"),
        (
            ["--training.seed", "1.5"],
            "training.seed=1.5 has the wrong type (float); expected an integer",
        ),
        (
            ["--data.packing", "maybe"],
            "data.packing='maybe' has the wrong type (str); expected true/false",
        ),
        (["--training.max_steps", "[1]"], "expected an integer or null"),
        (["--model.config_overrides", "[1]"], "expected a mapping"),
        (["--optimizer.no_decay", "bias"], "expected a list of strings"),
    ],
)
def test_wrong_types_name_key_value_and_expected_type(override: list[str], expected: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(None, [*TINY, *override])
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            ["--optimizer.learning_rate", "-1e-5"],
            "optimizer.learning_rate=-1e-05 must be a number >= 0.0",
        ),
        (
            ["--optimizer.warmup_ratio", "1"],
            "optimizer.warmup_ratio=1.0 must be a number >= 0 and < 1",
        ),
        (
            ["--optimizer.warmup_steps", "10", "--optimizer.warmup_ratio", "0.1"],
            "optimizer.warmup_steps=10 and optimizer.warmup_ratio=0.1 are both set",
        ),
        (
            ["--optimizer.betas", "[0.9, 1.0]"],
            "optimizer.betas[1]=1.0 must be a number >= 0.0 and < 1.0",
        ),
        (["--optimizer.eps", "0"], "optimizer.eps=0.0 must be a number > 0.0"),
        (["--optimizer.max_grad_norm", "-1"], "optimizer.max_grad_norm=-1.0 must be a number"),
        (
            ["--optimizer.min_lr_ratio", "2"],
            "optimizer.min_lr_ratio=2.0 must be a number >= 0.0 and <= 1.0",
        ),
        (
            ["--optimizer.lr_scheduler", "cosin"],
            "optimizer.lr_scheduler='cosin' must be one of ['constant', 'linear', 'cosine']",
        ),
        (["--optimizer.name", "sgd"], "optimizer.name='sgd' must be one of ['adamw']"),
        (
            ["--optimizer.impl", "cuda"],
            "optimizer.impl='cuda' must be one of ['auto', 'c', 'torch']",
        ),
        (["--optimizer.threads", "0"], "optimizer.threads=0 must be an integer >= 1"),
        (["--optimizer.no_decay", "['(']"], "optimizer.no_decay: '(' is not a valid regular"),
        (["--optimizer.learning_rate", ".nan"], "optimizer.learning_rate=nan must be a number"),
        (
            ["--model.name_or_path", "Qwen/Qwen3-8B"],
            "model.name_or_path='Qwen/Qwen3-8B' and "
            "model.model_type='llama' are both set; set exactly one",
        ),
        (
            ["--model.compute_dtype", "fp16"],
            "model.compute_dtype='fp16' must be one of ['bf16', 'fp32']",
        ),
        (
            ["--model.attn_implementation", "flash"],
            "model.attn_implementation='flash' must be one of [None, 'sdpa', 'eager', "
            "'flash_attention_2', 'flex_attention', 'megatrain_sinks']",
        ),
        (
            ["--model.tokenizer", "null"],
            "model.tokenizer=None: model.model_type='llama' brings no tokenizer",
        ),
        (
            ["--training.micro_batch_size", "0"],
            "training.micro_batch_size=0 must be an integer >= 1 or 'auto'",
        ),
        (
            ["--training.micro_batch_size", "big"],
            "training.micro_batch_size='big' must be an integer >= 1 or 'auto'",
        ),
        (
            ["--training.gradient_accumulation_steps", "0"],
            "training.gradient_accumulation_steps=0 must be an integer >= 1",
        ),
        (
            ["--training.seq_len", "512"],
            "training.seq_len=512 is shorter than data.cutoff_len=1024",
        ),
        (["--training.max_steps", "0"], "training.max_steps=0 must be an integer >= 1"),
        (["--training.num_epochs", "0"], "training.num_epochs=0.0 must be a number > 0.0"),
        (["--training.eval_every", "-1"], "training.eval_every=-1 must be an integer >= 0"),
        (
            ["--training.eval_every", "50"],
            "training.eval_every=50 but there is no evaluation "
            "data; set data.val_size or data.eval_dataset",
        ),
        (["--training.max_eval_batches", "0"], "training.max_eval_batches=0 must be an integer"),
        (
            ["--training.device", "gpu"],
            "training.device='gpu' must be one of ['auto', 'cpu', 'cuda', 'cuda:N']",
        ),
        (["--training.output_dir", "''"], "training.output_dir='' is empty"),
        (
            ["--training.max_steps", "5", "--optimizer.warmup_steps", "10"],
            "optimizer.warmup_steps=10 exceeds training.max_steps=5",
        ),
        (["--memory.num_slots", "0"], "memory.num_slots=0 must be an integer >= 1"),
        (["--memory.loss_chunk_tokens", "0"], "memory.loss_chunk_tokens=0 must be an integer"),
        (["--memory.gpu_margin_gib", "-1"], "memory.gpu_margin_gib=-1.0 must be a number >= 0.0"),
        (["--logging.log_every", "0"], "logging.log_every=0 must be an integer >= 1"),
        (["--checkpoint.keep_last", "0"], "checkpoint.keep_last=0 must be an integer >= 1"),
        (["--checkpoint.save_every", "-5"], "checkpoint.save_every=-5 must be an integer >= 0"),
        (
            ["--checkpoint.export_dtype", "fp16"],
            "checkpoint.export_dtype='fp16' must be one of ['bf16', 'fp32']",
        ),
        (["--checkpoint.resume_from", "''"], "checkpoint.resume_from='' is empty"),
        (["--data.overflow", "cut"], "data.overflow='cut' must be one of ['truncate', 'drop']"),
        (["--data.cutoff_len", "1"], "data.cutoff_len=1 must be an integer >= 2"),
    ],
)
def test_impossible_values_name_key_value_and_allowed(override: list[str], expected: str) -> None:
    with pytest.raises(ValueError) as err:
        load_config(None, [*TINY, *override])
    assert expected in str(err.value)


def test_model_source_rules() -> None:
    with pytest.raises(ValueError, match=r"model\.tiny=True needs model\.model_type"):
        load_config(None, ["--model.name_or_path", "Qwen/Qwen3-8B", "--model.tiny", "true"])
    cfg = load_config(None, ["--model.name_or_path", "Qwen/Qwen3-8B", "--model.random_init=true"])
    assert cfg.model.random_init and cfg.model.tokenizer is None
    with pytest.raises(ValueError, match=r"model\.name_or_path='' is empty"):
        load_config(None, ["--model.name_or_path", "''"])


def test_eval_every_with_eval_data_and_seq_len_at_cutoff_validate() -> None:
    cfg = load_config(
        None,
        [
            *TINY,
            "--training.eval_every",
            "5",
            "--data.val_size",
            "0.1",
            "--training.seq_len",
            "1024",
        ],
    )
    assert cfg.training.eval_every == 5 and cfg.training.seq_len == cfg.data.cutoff_len


def test_validate_checks_types_of_directly_built_configs() -> None:
    with pytest.raises(ValueError, match=r"optimizer\.learning_rate='1e-5' has the wrong type"):
        OptimizerConfig(learning_rate="1e-5").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"training\.micro_batch_size=True has the wrong type"):
        TrainingConfig(micro_batch_size=True).validate()
    with pytest.raises(ValueError, match=r"data\.dataset_dir=3 has the wrong type"):
        TrainConfig(
            model=ModelConfig(name_or_path="a/b"),
            data=DataConfig(dataset_dir=3),  # type: ignore[arg-type]
        ).validate()
