"""The run's tokenizer: `model.tokenizer` (or `model.name_or_path`), with errors a user can act on.

Sources: "demo" (the built-in tokenizer shipped with the package), "demo_vlm" (the built-in
vision-language demo processor's tokenizer), a local folder, or a hub id.
What transformers reports for a mistake is often misleading (a missing folder reads "Repo id must
be in the form ...", an empty folder reads "install sentencepiece or tiktoken", an uncached hub
id while offline is a long traceback); each is turned here into one paragraph naming the key,
the value and the fix. Nothing else about loading changes: `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from megatrain.errors import MissingPath
from megatrain.hub import go_offline_if_unreachable, hub_error
from megatrain.model.loading import looks_like_path
from megatrain.package_assets import demo_tokenizer_dir, demo_vlm_dir

BUILT_IN = {"demo": demo_tokenizer_dir, "demo_vlm": demo_vlm_dir}

# Any of these in a folder makes it a tokenizer folder AutoTokenizer can read.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
)


def load_tokenizer(
    tokenizer: str | None, name_or_path: str | None, *, trust_remote_code: bool
) -> Any:
    """The run's tokenizer: `tokenizer` (model.tokenizer), else the model's own folder or hub
    id (model.name_or_path); ValueError/FileNotFoundError naming the key and the fix."""
    key = "model.tokenizer" if tokenizer else "model.name_or_path"
    source = tokenizer or name_or_path
    if source is None:
        raise ValueError(
            "model.tokenizer is required with model.model_type (a hub id, a "
            "directory, or 'demo' for the built-in demo tokenizer)"
        )
    source = processor_source(tokenizer, name_or_path)
    assert source is not None
    path = Path(source).expanduser()
    if path.is_dir():
        _check_folder(path, key)
        source = str(path)
    elif looks_like_path(source) or path.exists():
        raise MissingPath(
            f"{key}={source!r}: no such folder; give the folder holding the model's tokenizer "
            "(tokenizer.json or tokenizer_config.json), a hub id like Qwen/Qwen3-8B, or 'demo'",
            source,
        )
    if not path.is_dir():
        go_offline_if_unreachable()  # a hub id: fail at once, not after the hub's retries
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as e:
        if path.is_dir():
            raise
        raise hub_error(key, source, e, what="tokenizer") from e


def processor_source(tokenizer: str | None, name_or_path: str | None) -> str | None:
    """Where the run's tokenizer (and so the model's processor, for images) is read from:
    `model.tokenizer`, else `model.name_or_path`; the built-in names become their folders."""
    source = tokenizer or name_or_path
    return str(BUILT_IN[source]()) if source in BUILT_IN else source


def _check_folder(path: Path, key: str) -> None:
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        return
    raise FileNotFoundError(
        f"{key}={str(path)!r} holds no tokenizer files (none of {', '.join(_TOKENIZER_FILES[:3])}"
        " ...); point it at the folder the model's tokenizer was saved to (save_pretrained "
        "writes tokenizer.json and tokenizer_config.json), a hub id, or 'demo'"
    )
