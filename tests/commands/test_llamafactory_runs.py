"""LLaMA-Factory's own training files (tests/data_fixtures/llamafactory/examples/) run through
`megatrain train` / `megatrain dpo` as written, on the CPU: only `model_name_or_path` points at a
tiny random model saved in a folder (config + weights + the demo tokenizer), `max_steps` caps the
run, and the working directory holds LLaMA-Factory's `data/` (its default dataset_dir).

Each run's first loss is what a random model must give, derived (not measured):
- SFT and pre-training: cross-entropy of near-uniform logits, ln(vocab_size). The logits are
  h . W with h after the final RMSNorm (|h| ~ sqrt(hidden) = 8) and W ~ N(0, 0.02^2): logit std
  ~0.16, so the loss is ln V + var/2 ~ ln V + 0.013, well inside 0.1 of ln V.
- DPO (sigmoid): the policy is the reference at step 1, z = 0: -log s(0) = ln 2; KTO: 1 - s(0)
  = 0.5. The reference log-probs come from a separate pass in bf16 compute (the files say bf16:
  true), whose rounding may differ from the step's by a few bf16 ulps per token; with beta 0.1
  the loss moves by beta |z| / 2, under 0.005 for |z| < 0.1 (measured |z| ~ 0 on this CPU).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from megatrain.cli import main
from megatrain.model.tiny import tiny_config
from megatrain.model.tiny_vision import DEMO_VLM_OVERRIDES, tiny_vlm_config
from megatrain.package_assets import demo_tokenizer_dir, demo_vlm_dir

FIXTURES = Path(__file__).resolve().parents[1] / "data_fixtures" / "llamafactory"
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
VOCAB = 512  # the demo tokenizer's ids fit (485)


def _save(model: object, tokenizer_dir: Path, out: Path) -> Path:
    model.save_pretrained(out)  # type: ignore[attr-defined]
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    text = {"vocab_size": VOCAB, "max_position_embeddings": 4096, **SIZES}
    vlm = tiny_vlm_config("qwen2_5_vl", **DEMO_VLM_OVERRIDES)
    return {
        "llama": _save(
            AutoModelForCausalLM.from_config(tiny_config("llama", **text)),
            demo_tokenizer_dir(),
            root / "llama",
        ),
        "qwen3": _save(
            AutoModelForCausalLM.from_config(tiny_config("qwen3", **text)),
            demo_tokenizer_dir(),
            root / "qwen3",
        ),
        "qwen2_5_vl": _save(
            AutoModelForImageTextToText.from_config(vlm), demo_vlm_dir(), root / "qwen2_5_vl"
        ),
    }


def _run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    model: Path,
    steps: int,
    *cmd: str,
    dataset_dir: bool = False,
) -> tuple[int, list[dict]]:
    """Run LLaMA-Factory's `name` from `tmp_path`, with data/ there (LLaMA-Factory's default
    dataset_dir) or, `dataset_dir`, a dataset_dir line naming the fixture's; its train records."""
    monkeypatch.chdir(tmp_path)
    text = (FIXTURES / "examples" / name).read_text(encoding="utf-8")
    text = re.sub(r"(?m)^model_name_or_path: .*$", f"model_name_or_path: {model}", text)
    text += f"max_steps: {steps}\n"
    if dataset_dir:
        text += f"dataset_dir: {FIXTURES / 'data'}\n"
    else:
        (tmp_path / "data").symlink_to(FIXTURES / "data")
    (tmp_path / name).write_text(text, encoding="utf-8")
    rc = main([*cmd, "--config", name, "--logging.progress_bar", "false"])
    out = tmp_path / yaml_value(text, "output_dir")
    records = []
    if (out / "metrics.jsonl").is_file():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    return rc, records


def yaml_value(text: str, key: str) -> str:
    match = re.search(rf"(?m)^{key}: (\S+)", text)
    assert match, key
    return match.group(1)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("llama3_full_sft.yaml", "llama"),
        ("qwen3_full_sft.yaml", "qwen3"),
        ("qwen3_lora_pretrain.yaml", "qwen3"),
    ],
)
def test_sft_and_pretrain_files_train(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    models: dict[str, Path],
    name: str,
    model: str,
) -> None:
    rc, records = _run(tmp_path, monkeypatch, name, models[model], 2, "train")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "ignored (they configure what MegaTrain does its own way): " in captured.err
    assert "ddp_timeout" in captured.err and "preprocessing_num_workers" in captured.err
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["loss"] - math.log(VOCAB)) < 0.1
    # per_device_train_batch_size x gradient_accumulation_steps rows of at most cutoff_len
    text = (FIXTURES / "examples" / name).read_text()
    rows = int(yaml_value(text, "per_device_train_batch_size")) * int(
        yaml_value(text, "gradient_accumulation_steps")
    )
    if "stage: pt" in text:  # full rows of cutoff_len tokens
        assert records[0]["tokens"] == rows * 2048
    else:
        assert 0 < records[0]["tokens"] <= rows * 2048
    assert (tmp_path / yaml_value(text, "output_dir") / "hf_model" / "config.json").is_file()


def test_vision_language_file_trains(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    models: dict[str, Path],
) -> None:
    name = "qwen2_5vl_full_sft.yaml"
    rc, records = _run(tmp_path, monkeypatch, name, models["qwen2_5_vl"], 1, "train")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "video_max_pixels" in captured.err  # video settings: ignored
    assert len(records) == 1
    assert abs(records[0]["loss"] - math.log(DEMO_VLM_OVERRIDES["vocab_size"])) < 0.1
    # the three data sets, whole (max_samples: 1000): mllm_demo's 6 rows hold 8 images
    assert main(["data", "--config", name, "--show", "0"]) == 0
    summary = capsys.readouterr().out
    assert re.search(r"train: 113 samples, \d+ tokens, \d+ supervised tokens, 8 images", summary)
    # a step of image rows: the same file with only mllm_demo
    out = tmp_path / "images"
    args = ["--data.dataset", "mllm_demo", "--training.output_dir", str(out)]
    assert main(["train", "--config", name, *args]) == 0
    (record,) = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if r["kind"] == "train"]  # fmt: skip
    assert abs(record["loss"] - math.log(DEMO_VLM_OVERRIDES["vocab_size"])) < 0.1


@pytest.mark.parametrize(
    ("name", "first_loss"), [("qwen3_lora_dpo.yaml", math.log(2)), ("qwen3_lora_kto.yaml", 0.5)]
)
def test_preference_files_train_with_megatrain_dpo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    models: dict[str, Path],
    name: str,
    first_loss: float,
) -> None:
    kto = name == "qwen3_lora_kto.yaml"  # with a dataset_dir line; dpo with data/ in the cwd
    rc, records = _run(tmp_path, monkeypatch, name, models["qwen3"], 1, "dpo", dataset_dir=kto)
    assert rc == 0, capsys.readouterr().err
    assert len(records) == 1
    assert abs(records[0]["loss"] - first_loss) < 0.005


def test_megatrain_train_on_a_dpo_file_names_megatrain_dpo(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    models: dict[str, Path],
) -> None:
    rc, records = _run(tmp_path, monkeypatch, "qwen3_lora_dpo.yaml", models["qwen3"], 1, "train")
    err = capsys.readouterr().err
    assert rc == 2 and not records
    assert (
        "data.stage='dpo' is preference training, which runs with megatrain dpo (same config and "
        "overrides): megatrain dpo --config qwen3_lora_dpo.yaml"
    ) in err


def test_a_trl_sft_file_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models: dict[str, Path]
) -> None:
    """TRL's names (`trl sft --config F`): dataset_name a local file, max_length the row cap."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(FIXTURES / "data")
    (tmp_path / "trl.yaml").write_text(
        f"model_name_or_path: {models['llama']}\ndataset_name: data/alpaca_en_demo.json\n"
        "max_length: 256\nper_device_train_batch_size: 2\nlearning_rate: 2.0e-5\nmax_steps: 1\n"
        "logging_steps: 1\nbf16: true\ngradient_checkpointing: true\nassistant_only_loss: true\n"
        "output_dir: trl-sft\nreport_to: none\ndisable_tqdm: true\n",
        encoding="utf-8",
    )
    assert main(["train", "--config", "trl.yaml"]) == 0
    lines = (tmp_path / "trl-sft" / "metrics.jsonl").read_text().splitlines()
    (record,) = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert abs(record["loss"] - math.log(VOCAB)) < 0.1
    assert 0 < record["tokens"] <= 2 * 256  # two rows of at most max_length tokens
