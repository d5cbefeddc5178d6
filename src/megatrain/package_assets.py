"""Where the shipped demo assets live, inside the installed package (package data).

`megatrain/assets/demo/` is written by `python -m megatrain.data.demo_assets` and committed; this
module only locates it, so importing the pipeline never imports the generator.
"""

from __future__ import annotations

from pathlib import Path


def demo_assets_dir() -> Path:
    """The folder holding the demo data, its dataset_info.json and `tokenizer/`."""
    return Path(__file__).resolve().parent / "assets" / "demo"


def demo_tokenizer_dir() -> Path:
    """The demo tokenizer folder, loadable with `AutoTokenizer.from_pretrained`."""
    return demo_assets_dir() / "tokenizer"


def demo_vlm_dir() -> Path:
    """The demo vision-language processor folder (tokenizer + image processor), written by
    `megatrain.data.demo_vlm`; `model.tokenizer: demo_vlm` names it."""
    return demo_assets_dir() / "vlm"
