"""examples/*.yaml: each loads and validates, is headed by its own command, names a hub model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.model.tiny_vision import DEMO_VLM_OVERRIDES

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))  # demo.yaml included once it exists
FAMILIES = {
    "qwen2_5_7b", "qwen3_8b", "qwen3_5_27b", "qwen3_next_80b_a3b", "qwen3_moe_30b_a3b",
    "llama3_1_8b", "llama4_scout", "mistral_7b", "mixtral_8x7b", "deepseek_v2_lite", "phi4_14b",
    "gemma2_9b", "gemma3_1b", "glm4_9b", "gpt_oss_20b",
}  # fmt: skip
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _header(path: Path) -> str:
    """The comment lines before the first line of YAML."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_every_family_has_an_example() -> None:
    assert {p.stem for p in EXAMPLES} >= FAMILIES


def test_readme_lists_every_example() -> None:
    readme = (EXAMPLES_DIR / "README.md").read_text()
    missing = [p.name for p in EXAMPLES if f"]({p.name})" not in readme]
    assert not missing


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_and_is_headed_by_its_command(path: Path) -> None:
    cfg = load_config(path)
    command = "grpo" if path.name.startswith("grpo") or path.stem.endswith("_grpo") else "train"
    if path.stem == "dpo_demo" or path.stem.endswith("_dpo"):
        command = "dpo"
    assert f"megatrain {command} --config examples/{path.name}" in _header(path)
    if path.name in ("demo.yaml", "dpo_demo.yaml", "vlm_demo.yaml"):
        assert cfg.model.model_type is not None and cfg.model.tiny
        if path.name == "vlm_demo.yaml":  # the tiny model matches the demo processor
            overrides = cfg.model.config_overrides
            assert {k: overrides[k] for k in DEMO_VLM_OVERRIDES} == DEMO_VLM_OVERRIDES
        return
    if path.name == "grpo_demo.yaml":  # starts from the export of the demo's warm start
        warm_start = "outputs/grpo_warm_start"  # its own folder: the full demo writes outputs/demo
        assert cfg.model.name_or_path == f"{warm_start}/hf_model"
        assert f"--training.output_dir {warm_start}" in _header(path)
        return
    if path.name == "qwen3_5_27b_grpo.yaml":  # the release's language model, random weights
        assert cfg.model.model_type == "qwen3_5_text" and not cfg.model.tiny
        assert HUB_ID.fullmatch(cfg.model.tokenizer or "") and "251 GiB" in _header(path)
        assert "80 GB GPU" in _header(path) and "bytes per parameter" in _header(path)
        return
    assert cfg.model.name_or_path is not None and HUB_ID.fullmatch(cfg.model.name_or_path)
    assert "80 GB GPU" in _header(path) and "bytes per parameter" in _header(path)


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem in FAMILIES], ids=lambda p: p.name)
def test_model_example_uses_the_sft_recipe(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.model.compute_dtype == "bf16" and not cfg.model.trust_remote_code
    assert cfg.data.packing and 2048 <= cfg.data.cutoff_len <= 4096
    opt = cfg.optimizer
    assert (opt.learning_rate, opt.lr_scheduler, opt.max_grad_norm) == (1e-5, "cosine", 1.0)
    assert opt.warmup_steps > 0 or opt.warmup_ratio > 0
    assert cfg.training.output_dir == f"outputs/{path.stem}"
    assert "dataset_dir" in path.read_text()  # shows how to point at real data
