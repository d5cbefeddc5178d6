"""`megatrain estimate`: the table prints, --json parses and carries the estimate's numbers,
the run config and its overrides are read, auto micro-batch and the fit verdict work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from megatrain.cli import split_overrides
from megatrain.commands.estimate import add_arguments, run
from megatrain.model.tiny import tiny_config
from megatrain.planning import Hardware, model_spec
from megatrain.planning.fit import store_choices
from megatrain.planning.hardware import GIB
from predict import predict


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    overrides, rest = split_overrides(argv)  # as cli.main does
    args = parser.parse_args(rest)
    args.overrides = overrides
    status = run(args)
    return status, capsys.readouterr().out


def test_table_names_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(
        [
            "--model-type",
            "llama",
            "--tiny",
            "--seq-len",
            "64",
            "--micro-batch-size",
            "2",
            "--grad-accum",
            "3",
            "--memory.gpu_state_blocks",  # all streamed: the table's streaming rows
            "0",
        ],
        capsys,
    )
    assert status == 0
    for text in (
        "host RAM",
        "pinned (bf16 shadow",
        "GPU peak",
        "boundary activations",
        "weight slots",
        "step (overlapped)",
        "tokens/s",
        "fits: yes",
        "2 x 64 tokens x 3 micro-batches = 384 tokens/step",
    ):
        assert text in out


def test_json_carries_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(
        [
            "--model-type",
            "qwen3_moe",
            "--tiny",
            "--seq-len",
            "32",
            "--micro-batch-size",
            "2",
            "--tokens-per-step",
            "256",
            "--dtype",
            "fp32",
            "--layout",
            "packed",
            "--num-slots",
            "1",
            "--memory.gpu_state_blocks",
            "0",
            "--optimizer.gpu_update_blocks",  # `predict` has no share
            "0",
            "--json",
        ],
        capsys,
    )
    assert status == 0
    report = json.loads(out)
    assert report["fits"] is True and report["problem"] is None
    assert report["settings"]["grad_accum"] == 4 and report["settings"]["layout"] == "packed"
    expected = predict(
        tiny_config("qwen3_moe"),
        seq_len=32,
        micro_batch_size=2,
        grad_accum=4,
        compute_dtype="fp32",
        num_slots=1,
        padded=False,
        packed=True,
        compiled=True,  # the GPU run's "auto": MoE layers compile, packed rows of one length
    )
    assert report["settings"]["compiled"] is True
    assert report["host"]["store_bytes"] == 16 * report["total_params"]
    assert report["gpu"]["peak_bytes"] == expected.gpu.peak_bytes
    slack = report["gpu"]["items"]["allocator slack (reserved beyond allocated)"]
    assert report["gpu"]["allocated_bytes"] == expected.gpu.peak_bytes - slack > 0
    assert report["host"]["pageable_bytes"] == expected.host.pageable_bytes
    assert report["active_params"] < report["total_params"]
    assert report["time"]["step_s"] == pytest.approx(expected.time.step_s)


def test_config_file_and_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  model_type: qwen2\n  tiny: true\n  tokenizer: demo\n"
        "  compute_dtype: fp32\n  config_overrides: {num_hidden_layers: 2}\n"
        "data:\n  cutoff_len: 48\n  packing: true\n"
        "training:\n  micro_batch_size: 2\n  gradient_accumulation_steps: 5\n"
        "memory:\n  num_slots: 1\n  gpu_state_blocks: 0\n"
        "optimizer:\n  max_grad_norm: 0.0\n"
    )
    status, out = _run(
        ["--config", str(config), "--json", "--training.gradient_accumulation_steps", "3"], capsys
    )
    assert status == 0
    s = json.loads(out)["settings"]
    assert (s["seq_len"], s["micro_batch_size"], s["grad_accum"]) == (48, 2, 3)
    assert (s["compute_dtype"], s["num_slots"], s["layout"], s["clipping"]) == (
        "fp32",
        1,
        "packed",
        False,
    )
    assert "full_attention x2;" in json.loads(out)["model"]  # config_overrides applied


def test_auto_micro_batch_keeps_the_tokens_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(
        [
            "--model-type",
            "llama",
            "--tiny",
            "--seq-len",
            "64",
            "--micro-batch-size",
            "auto",
            "--tokens-per-step",
            "1024",
            "--json",
        ],
        capsys,
    )
    report = json.loads(out)
    s = report["settings"]
    assert status == 0 and s["micro_batch_size"] * s["grad_accum"] == 16
    assert s["micro_batch_size"] == 16  # a tiny model fits whole on an 80 GiB GPU
    assert report["micro_batch_reason"].startswith("micro_batch_size 16 x grad_accum 1")


def test_local_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_config("mistral").save_pretrained(tmp_path)
    status, out = _run(["--model", str(tmp_path), "--seq-len", "16", "--json"], capsys)
    assert status == 0
    spec = model_spec(tiny_config("mistral"))
    assert json.loads(out)["total_params"] == spec.total_params


def test_a_setup_that_does_not_fit_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _run(
        [
            "--model-type",
            "llama",
            "--tiny",
            "--seq-len",
            "64",
            "--gpu-gib",
            "0.001",
            "--gpu-margin-gib",
            "0",
        ],
        capsys,
    )
    assert status == 1
    assert "fits: no" in out and "GPU: predicted peak" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seq-len", "8"], "exactly one of --config"),
        (["--model-type", "llama", "--tiny"], "give --seq-len"),
        (
            [
                "--model-type",
                "llama",
                "--tiny",
                "--seq-len",
                "64",
                "--micro-batch-size",
                "3",
                "--tokens-per-step",
                "640",
            ],
            "multiple of micro_batch_size x seq_len = 192",
        ),
        (
            ["--model-type", "llama", "--tiny", "--seq-len", "64", "--micro-batch-size", "x"],
            "integer >= 1 or auto",
        ),
        (
            ["--model-type", "llama", "--tiny", "--seq-len", "64", "--training.seq_len", "8"],
            "training.seq_len=8 is shorter than data.cutoff_len=64",
        ),
    ],
)
def test_usage_errors_name_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=message):
        _run(argv, capsys)


def test_set_reads_values_as_yaml_like_config_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set KEY=VALUE` parses VALUE as `--model.config_overrides.KEY VALUE` does: Python's
    `False` is a boolean (transformers' strict config fields refuse the string)."""
    tiny = ["--model-type", "qwen2", "--tiny", "--seq-len", "64", "--json"]
    status, out = _run(
        [*tiny, "--set", "tie_word_embeddings=False", "--set", "vocab_size=640"], capsys
    )
    assert status == 0
    untied = json.loads(out)
    status, out = _run(
        [*tiny, "--set", "tie_word_embeddings=true", "--set", "vocab_size=640"], capsys
    )
    tied = json.loads(out)
    assert untied["total_params"] - tied["total_params"] == 640 * tiny_config("qwen2").hidden_size


def test_without_a_gpu_the_report_says_the_gpu_is_assumed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    tiny = ["--model-type", "llama", "--tiny", "--seq-len", "64"]
    status, out = _run(tiny, capsys)
    assert status == 0
    assert (
        "note: no GPU found here: the GPU figures are for an assumed NVIDIA H100 80GB HBM3 "
        "with 80.0 GiB (--gpu-gib sets its memory" in out
    )
    _, out = _run([*tiny, "--gpu-gib", "24"], capsys)
    assert "an assumed NVIDIA H100 80GB HBM3 with 24.0 GiB" in out
    found = Hardware(gpu_name="NVIDIA L4", gpu_bytes=24 * GIB, measured=("gpu_bytes", "gpu_name"))
    notes = predict(tiny_config("llama"), seq_len=64, micro_batch_size=1, hardware=found).notes
    assert not any("no GPU found" in n for n in notes)


def test_export_row_names_the_configured_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    wide = {"vocab_size": 32768, "hidden_size": 1024}  # 0.07 B params: GiB with 2 decimals
    tiny = ["--model-type", "llama", "--tiny", "--seq-len", "64"]
    tiny += [arg for k, v in wide.items() for arg in ("--set", f"{k}={v}")]
    spec = model_spec(tiny_config("llama", **wide))
    for dtype, bytes_per_param in (("fp32", 4), ("bf16", 2)):
        status, out = _run([*tiny, "--checkpoint.export_dtype", dtype], capsys)
        row = next(line for line in out.splitlines() if "Hugging Face export" in line)
        assert status == 0 and f"Hugging Face export ({dtype})" in row
        assert row.split()[-1] == f"{bytes_per_param * spec.total_params / GIB:.2f}"
    _, out = _run([*tiny, "--checkpoint.export_hf", "false"], capsys)
    assert (
        "Hugging Face export                               none  checkpoint.export_hf: false" in out
    )


def test_host_store_layouts_in_the_table_and_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    """One row per store layout (bf16 compute, clipping on: 12), the run's marked with "*" and
    equal to the estimate's own host total; --json carries the same rows."""
    argv = ["--model-type", "llama", "--tiny", "--seq-len", "64", "--host-gib", "16"]
    argv += ["--optimizer.state_dtype", "int8", "--optimizer.master_dtype", "bf16"]
    status, out = _run([*argv, "--json"], capsys)
    report = json.loads(out)
    table = report["host_store_layouts"]
    assert status == 0 and table["host_bytes"] == 16 * GIB and table["host_margin_gib"] == 4.0
    choices = store_choices(True, clipping=True)
    rows = table["rows"]
    assert [(r["master_dtype"], r["state_dtype"], r["grad_dtype"]) for r in rows] == [
        (c.master, c.state, c.grad) for c in choices
    ]
    assert [r["bytes_per_param"] for r in rows] == [c.per_param for c in choices]
    (own,) = [r for r in rows if r["own"]]
    assert (own["master_dtype"], own["state_dtype"], own["grad_dtype"]) == ("bf16", "int8", "bf16")
    assert own["host_bytes"] == report["host"]["total_bytes"]
    assert own["step_s"] == report["time"]["step_s"]
    assert all(r["fits"] for r in rows)  # a tiny model on 16 GiB
    status, out = _run(argv, capsys)
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("host store layouts")))
    marked = [line for line in lines[start:] if line.startswith("* ")]
    assert marked == [
        line for line in lines if line.startswith("* state_dtype int8, master_dtype bf16, ")
    ]
    assert marked[0].split()[7] == f"{own['bytes_per_param']:.2f}"
    assert marked[0].split()[8] == f"{own['host_bytes'] / GIB:.2f}"
    assert len([line for line in lines[start:] if line[2:].startswith("state_dtype ")]) == 12
