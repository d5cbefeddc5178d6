"""`megatrain --help`, `--version`, `--print-config`, argument and config errors (LLaMA-Factory
files' too) answer without importing torch or transformers (seconds of start-up on a small
machine); the command that runs imports them.
bench/cli_startup.py times these cases."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import megatrain.data

SRC = Path(__file__).resolve().parents[1] / "src"
LF = Path(__file__).resolve().parent / "data_fixtures" / "llamafactory" / "examples"
HEAVY = ("torch", "transformers")
CASES = [
    ["--help"],
    ["--version"],
    ["nonsense"],
    *(
        [command, "--help"]
        for command in ("train", "grpo", "dpo", "verify", "estimate", "data", "export")
    ),
    ["estimate", "--bad-flag"],
    ["verify", "--steps", "x"],
    ["train", "--optimizer.learning_rate", "1e-3", "--bad-flag"],
    ["train", "--config", "/nonexistent/run.yaml"],
    ["train", "--model.model_type", "llama", "--optimizer.lerning_rate", "1e-3"],
    ["grpo", "--optimizer.learning_rate", "-1"],
    ["dpo", "--dpo.beta", "0"],
    ["dpo", "--model.model_type", "llama", "--data.stage", "sft"],
    ["data", "--training.micro_batch_size", "0"],
    ["export", "--checkpoint", "/nonexistent", "--out", "/nonexistent/hf"],
    ["train", "--config", str(LF / "qwen3_lora_sft.yaml")],  # LoRA: refused
    ["train", "--config", str(LF / "qwen3_lora_dpo.yaml")],  # preference data: megatrain dpo
    ["train", "--config", str(LF / "llama3_full_sft.yaml"), "--print-config"],
]
ANSWERS = ("--help", "--version", "--print-config")  # exit 0; the other cases are errors
# Each case in a fresh interpreter: its exit status and what it loaded to get there.
PROBE = """
import json, sys
from megatrain.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as e:  # argparse: --help, --version, a usage error
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def test_parsing_the_command_line_imports_no_torch() -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    for argv in CASES:
        run = subprocess.run(
            [sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.splitlines()[-1])
        assert result["code"] == (0 if set(ANSWERS) & set(argv) else 2), argv
        assert result["heavy"] == [], argv


def test_the_data_package_resolves_each_name_from_its_module() -> None:
    """megatrain.data imports its modules on first use (so the config, which needs DataConfig,
    loads no torch): every exported name is its module's object."""
    exports = megatrain.data._EXPORTS
    assert sorted(exports) == sorted(megatrain.data.__all__)
    for name, module in exports.items():
        defined = getattr(importlib.import_module(f"megatrain.data.{module}"), name)
        assert getattr(megatrain.data, name) is defined, name
