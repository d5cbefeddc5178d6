"""The data set registry: LLaMA-Factory's `dataset_info.json`, and data referenced by path.

An entry (see LLaMA-Factory's data/README.md) names its source (`hf_hub_url`, else `file_name`
relative to the registry's folder), its `formatting` ("alpaca" default, "sharegpt", or this
package's "openai", which is sharegpt with OpenAI's role/content tags), optional `columns` and
`tags` that rename the fields, and `split`, `subset`, `folder`, `revision`, `num_samples`.
LLaMA-Factory's other sources (`ms_hub_url`, `om_hub_url` or any other `*_hub_url`, `script_url`,
`cloud_file_name`) are alternatives to those two: ignored when the entry has one of them, an
error naming the entry otherwise. Entries of features not supported yet (`videos`/`audios`
columns) are refused by name.

Vision-language data (LLaMA-Factory's `mllm_demo`) names an `images` column, in alpaca and
sharegpt formats alike: a list of image paths per row, relative to the registry's folder (or
absolute), with one `<image>` placeholder in the text per image (data/vision.py).

Preference data (data.stage dpo) is registered as LLaMA-Factory does: `"ranking": true` and
`columns` naming `chosen` and `rejected` (alpaca: text columns; sharegpt/openai: one assistant
turn each, the `messages` column holding the prompt turns). KTO data (data.stage kto) names a
`kto_tag` column: a boolean per row, true for a desirable completion (the last assistant turn).

A name that is not in the registry but is an existing file or folder (absolute, relative to the
working directory, or relative to the registry folder) is read directly; its format is detected
from its first row: alpaca (`instruction`/`output`), sharegpt (`conversations` of `from`/`value`),
or OpenAI (`messages` of `role`/`content`).

Invariant: every key an entry may carry is either honoured or rejected with an error naming the
data set, the key and the fix; the only keys ignored are the alternative sources above, and only
when a source read here is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatrain.data.readers import TEXT_COLUMN, iter_rows, json_problem

REGISTRY_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt", "openai")
PREFERENCE_COLUMNS = ("chosen", "rejected", "kto_tag")
ALPACA_COLUMNS = (
    "prompt",
    "query",
    "response",
    "history",
    "system",
    "tools",
    "images",
    *PREFERENCE_COLUMNS,
)
SHAREGPT_COLUMNS = ("messages", "system", "tools", "images", *PREFERENCE_COLUMNS)
TAGS = (
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "observation_tag",
    "function_tag",
    "system_tag",
)
SOURCES = ("hf_hub_url", "file_name")  # read here, in this order of precedence
# LLaMA-Factory's sources of other kinds, besides any `*_hub_url` of another hub
OTHER_SOURCES = ("script_url", "cloud_file_name")
HUB_URL_SUFFIX = "_hub_url"
# Features of LLaMA-Factory's registry not supported yet, by the column that marks each.
UNSUPPORTED_COLUMNS = {
    "videos": "multimodal",
    "audios": "multimodal",
}
ENTRY_KEYS = (
    *SOURCES,
    "formatting",
    "columns",
    "tags",
    "split",
    "subset",
    "folder",
    "revision",
    "num_samples",
    "ranking",
)


@dataclass(frozen=True)
class DatasetSpec:
    """Where one data set lives and how its rows map onto a conversation."""

    name: str
    load_from: str  # "file" | "hf_hub"
    path: str  # a local file or folder for "file", a repository id for "hf_hub"
    formatting: str = "alpaca"
    split: str = "train"
    subset: str | None = None
    folder: str | None = None
    revision: str | None = None
    num_samples: int | None = None
    # alpaca columns
    prompt: str | None = "instruction"
    query: str | None = "input"
    response: str | None = "output"
    history: str | None = None
    # sharegpt columns
    messages: str | None = "conversations"
    # both
    system: str | None = None
    tools: str | None = None
    images: str | None = None  # a list of image paths per row, relative to `media_dir`
    media_dir: str = "."  # the registry's folder (data.dataset_dir), or a direct path's folder
    # sharegpt tags
    role_tag: str = "from"
    content_tag: str = "value"
    user_tag: str = "human"
    assistant_tag: str = "gpt"
    observation_tag: str = "observation"
    function_tag: str = "function_call"
    system_tag: str = "system"
    # preference data: `ranking` pairs (chosen, rejected) or KTO rows labelled by `kto_tag`
    ranking: bool = False
    chosen: str | None = None
    rejected: str | None = None
    kto_tag: str | None = None
    # stage pt: the column of raw text (LLaMA-Factory's `columns: {prompt: <column>}`)
    text: str = TEXT_COLUMN


OPENAI_DEFAULTS: dict[str, Any] = {
    "messages": "messages",
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "system_tag": "system",
}


def load_registry(dataset_dir: Path) -> dict[str, Any] | None:
    """The parsed dataset_info.json of `dataset_dir`, or None when the folder has none."""
    path = dataset_dir / REGISTRY_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: {json_problem(err)}") from err
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected an object mapping data set names to entries")
    return info


def resolve_datasets(
    names: list[str], dataset_dir: Path, *, stage: str = "sft"
) -> list[DatasetSpec]:
    """One spec per name: a registry entry of `dataset_dir/dataset_info.json`, else a path.

    Stage "pt" reads a path's rows as raw text (column `text`) instead of detecting a format."""
    registry = load_registry(dataset_dir)
    return [_resolve(name, registry, dataset_dir, stage) for name in names]


def _resolve(
    name: str, registry: dict[str, Any] | None, dataset_dir: Path, stage: str
) -> DatasetSpec:
    if registry is not None and name in registry:
        return spec_from_entry(name, registry[name], dataset_dir)
    for candidate in (Path(name).expanduser(), dataset_dir / name):
        if candidate.exists():
            if stage == "pt":
                return DatasetSpec(name=name, load_from="file", path=str(candidate))
            return spec_from_path(name, candidate)
    registry_file = dataset_dir / REGISTRY_FILE
    if registry is not None:
        where = f"not registered in {registry_file}, which registers {sorted(registry)}"
    elif dataset_dir.is_dir():
        where = f"not registered: the folder {dataset_dir} has no {REGISTRY_FILE}"
    else:
        where = f"not registered: the data.dataset_dir folder {dataset_dir} does not exist"
    raise ValueError(
        f"unknown data set {name!r}: {where}, and there is no file or folder of that name "
        f"(relative to the working directory or to {dataset_dir}); fix data.dataset_dir, add "
        f"{name!r} to {REGISTRY_FILE}, or give a path to a data file or folder"
    )


def spec_from_entry(name: str, entry: Any, dataset_dir: Path) -> DatasetSpec:
    """Translate one dataset_info.json entry; reject what this pipeline cannot honour."""
    where = f"{dataset_dir / REGISTRY_FILE}: data set {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
    other_sources = [k for k in entry if k in OTHER_SOURCES or _is_other_hub(k)]
    unknown = sorted(set(entry) - set(ENTRY_KEYS) - set(other_sources))
    if unknown:
        raise ValueError(f"{where}: unsupported keys {unknown}; supported: {list(ENTRY_KEYS)}")
    _refuse_unsupported_features(entry, where)
    _check_preference(entry, where)
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise ValueError(f"{where}: formatting={formatting!r}; use one of {list(FORMATTINGS)}")
    if "hf_hub_url" in entry:
        load_from, path = "hf_hub", str(entry["hf_hub_url"])
    elif "file_name" in entry:
        file = Path(str(entry["file_name"])).expanduser()
        load_from, path = "file", str(file if file.is_absolute() else dataset_dir / file)
    elif other_sources:
        given = ", ".join(f"{k}={entry[k]!r}" for k in other_sources)
        raise ValueError(
            f"{where}: its only source is {given}, which megatrain does not read yet (it reads "
            f"{' and '.join(SOURCES)}); download the data and set file_name to the local copy, "
            "or add the data set's hf_hub_url"
        )
    else:
        raise ValueError(f"{where}: needs file_name or hf_hub_url")
    spec = DatasetSpec(
        name=name,
        load_from=load_from,
        path=path,
        formatting=formatting,
        media_dir=str(dataset_dir),
    )
    if entry.get("ranking"):  # LLaMA-Factory's entries without columns use these names
        spec = replace(spec, ranking=True, chosen="chosen", rejected="rejected")
    if formatting == "openai":
        spec = replace(spec, **OPENAI_DEFAULTS)
    fields: dict[str, Any] = {
        key: entry[key]
        for key in ("split", "subset", "folder", "revision", "num_samples")
        if entry.get(key) is not None
    }
    num_samples = fields.get("num_samples")
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
        raise ValueError(f"{where}: num_samples={num_samples!r} must be an integer >= 1")
    fields.update(_mapping(entry, "columns", _allowed_columns(formatting), where))
    if "prompt" in fields:
        fields["text"] = fields["prompt"]
    fields.update(_mapping(entry, "tags", TAGS if formatting != "alpaca" else (), where))
    return replace(spec, **fields)


def _is_other_hub(key: str) -> bool:
    return key.endswith(HUB_URL_SUFFIX) and key not in SOURCES


def _refuse_unsupported_features(entry: dict[str, Any], where: str) -> None:
    """Name the features of the entry that are not supported yet (before any column check)."""
    columns = entry.get("columns")
    found: dict[str, list[str]] = {}
    unsupported = dict(UNSUPPORTED_COLUMNS)
    if entry.get("ranking") or (isinstance(columns, dict) and "kto_tag" in columns):
        unsupported = {"images": "multimodal", **unsupported}  # image preference data
    for column, feature in unsupported.items():
        if isinstance(columns, dict) and column in columns:
            found.setdefault(feature, []).append(f"columns.{column}")
    if found:
        listed = " and ".join(f"{name} data ({', '.join(keys)})" for name, keys in found.items())
        raise ValueError(
            f"{where}: {listed} {'is' if len(found) == 1 else 'are'} not supported yet; megatrain "
            "trains on text conversations (data.stage: sft, dpo, kto), conversations with images "
            "(sft) and raw text (pt) only: remove the data set from data.dataset"
        )


def _check_preference(entry: dict[str, Any], where: str) -> None:
    """Columns chosen/rejected need `ranking: true`, which excludes kto_tag."""
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise ValueError(f"{where}: ranking={ranking!r} must be true or false")
    columns = entry.get("columns")
    columns = columns if isinstance(columns, dict) else {}
    paired = [c for c in ("chosen", "rejected") if c in columns]
    if paired and not ranking:
        raise ValueError(
            f'{where}: columns {paired} name preference pairs: add "ranking": true to the entry'
        )
    if ranking and "kto_tag" in columns:
        raise ValueError(
            f"{where}: columns.kto_tag (KTO, one labelled completion per row) and ranking: true "
            "(pairs) exclude each other; keep one"
        )


def _allowed_columns(formatting: str) -> tuple[str, ...]:
    return ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS


def _mapping(entry: dict[str, Any], key: str, allowed: tuple[str, ...], where: str) -> dict:
    value = entry.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where}: {key} must map names to strings, got {value!r}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(
            f"{where}: {key} {unknown} not supported for formatting "
            f"{entry.get('formatting', 'alpaca')!r}; supported: {list(allowed)}"
        )
    return dict(value)


def spec_from_path(name: str, path: Path) -> DatasetSpec:
    """A spec for a file or folder given directly; the format comes from its first row."""
    try:
        first = next(iter_rows(path))
    except StopIteration:
        raise ValueError(f"{path}: the data file holds no rows") from None
    base = DatasetSpec(
        name=name,
        load_from="file",
        path=str(path),
        system="system",
        tools="tools",
        images="images",
        media_dir=str(path if path.is_dir() else path.parent),
    )
    detected = sft_format_of(first)
    if detected == "openai":
        return replace(base, formatting="openai", **OPENAI_DEFAULTS)
    if detected == "sharegpt":
        return replace(base, formatting="sharegpt")
    if detected == "openai (conversations)":
        return replace(
            base, formatting="openai", **{**OPENAI_DEFAULTS, "messages": "conversations"}
        )
    if detected == "alpaca":
        return replace(base, formatting="alpaca", history="history")
    if isinstance(first.get(TEXT_COLUMN), str):
        raise ValueError(
            f"{path}: the rows hold raw text (a {TEXT_COLUMN!r} column, keys {sorted(first)}): "
            "this looks like pre-training data; set data.stage: pt to train on it"
        )
    raise ValueError(
        f"{path}: cannot detect the format from the first row (keys {sorted(first)}); expected "
        "alpaca (instruction, input, output), sharegpt (conversations: [{from, value}]) or OpenAI "
        f"(messages: [{{role, content}}]); or register it in {REGISTRY_FILE} with its columns"
    )


def sft_format_of(row: dict[str, Any]) -> str | None:
    """The conversation format a row is written in, or None if it looks like no SFT format."""
    messages = row.get("messages")
    conversations = row.get("conversations")
    if _is_turn_list(messages, "role", "content"):
        return "openai"
    if _is_turn_list(conversations, "from", "value"):
        return "sharegpt"
    if _is_turn_list(conversations, "role", "content"):
        return "openai (conversations)"
    if "instruction" in row and "output" in row:
        return "alpaca"
    return None


def _is_turn_list(value: Any, role_key: str, content_key: str) -> bool:
    if isinstance(value, str):  # csv and some parquet files store the turns as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return False
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and role_key in m for m in value)
        and any(content_key in m for m in value)
    )
