"""Readers: data files and folders (local or downloaded from the Hugging Face hub) to rows.

A row is a `dict[str, Any]` as stored in the file: no column is renamed or converted here (that is
`formats.py`'s job). Supported: `.json` (a JSON array of objects, or JSON lines), `.jsonl`,
`.parquet` (pyarrow, read one record batch at a time), `.csv` (stdlib csv; every value a string),
`.txt` (raw text for data.stage: pt only, TEXT_SUFFIXES: one row `{"text": line}` per line, as
LLaMA-Factory reads text files; blank lines are kept as empty rows, counted and dropped later),
and folders of such files, read recursively in sorted path order so the row order is
reproducible. Every reader streams except a `.json` array, which
is parsed whole.

Hub data sets (`hf_hub_url` in dataset_info.json) are fetched with
`huggingface_hub.snapshot_download(repo_type="dataset")` and then read with the same readers. A
download that fails (the hub unreachable or HF_HUB_OFFLINE set, with no cached copy; a missing,
gated or private repository; an unknown revision) is one error naming the data set, its hub id
and the fix.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatrain.hub import go_offline_if_unreachable

SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")  # conversation (sft) data
TEXT_SUFFIXES = (*SUFFIXES, ".txt")  # raw text (pt) data: .txt files too
TEXT_COLUMN = "text"  # the column of a .txt file's rows, as the `datasets` text builder names it
KNOWN_SPLITS = ("train", "validation", "valid", "val", "test", "dev", "eval")


def data_files(path: Path, suffixes: tuple[str, ...] = SUFFIXES) -> list[Path]:
    """`path` itself if it is a data file, else the data files under the folder, sorted.

    `suffixes`: the file types read; a folder's other files are skipped (a README.txt beside
    conversation data is not data), a file of another type given directly is an error."""
    if path.is_file():
        if path.suffix.lower() == ".txt" and ".txt" not in suffixes:
            raise ValueError(
                f"{path}: a .txt file is raw text (one document per line), which data.stage: pt "
                "trains on; set data.stage: pt, or give conversations in "
                f"{'/'.join(suffixes)} files for sft"
            )
        if path.suffix.lower() not in suffixes:
            raise ValueError(
                f"{path}: unsupported file type {path.suffix!r}; use one of {suffixes}"
            )
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such data file or folder")
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in suffixes
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
        and p.name != "dataset_info.json"
    )
    if not files:
        raise FileNotFoundError(f"{path}: the folder holds no data file ({', '.join(suffixes)})")
    return files


def iter_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a data file or of every data file in a folder, in order."""
    for file in data_files(path):
        for index, row in enumerate(read_file(file)):
            if not isinstance(row, dict):
                raise ValueError(
                    f"{file}: row {index + 1} is {type(row).__name__}, expected a JSON object "
                    "(one sample per object)"
                )
            yield row


def read_rows(path: Path) -> list[dict[str, Any]]:
    return list(iter_rows(path))


def read_file(file: Path) -> Iterator[Any]:
    """The rows of one data file, streamed (a `.json` array is parsed whole)."""
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_jsonl(file)
    elif suffix == ".json":
        yield from _read_json(file)
    elif suffix == ".txt":
        with file.open(encoding="utf-8") as f:
            for line in f:
                yield {TEXT_COLUMN: line.rstrip("\r\n")}
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(file).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    else:
        with file.open(newline="", encoding="utf-8") as f:
            yield from csv.DictReader(f)


def _read_json(file: Path) -> Iterator[Any]:
    """A JSON array, or JSON lines under a .json name (as `datasets` accepts).

    A file that is neither reports the parse error of the reading it resembles: an array (first
    character `[`) or a file whose first line is not JSON gets the whole-document error with its
    line and column, JSON lines get the first bad line.
    """
    text = file.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        first_line = next((line for line in text.splitlines() if line.strip()), "")
        if text.lstrip().startswith("[") or not _is_json(first_line):
            raise ValueError(
                f"{file}: {json_problem(err)}; fix the file (a JSON array of objects, or one "
                "JSON object per line)"
            ) from err
        yield from _read_jsonl(file)
        return
    if not isinstance(data, list):
        raise ValueError(f"{file}: expected a JSON array of objects, got {type(data).__name__}")
    yield from data


def json_problem(err: json.JSONDecodeError, line_no: int | None = None) -> str:
    """Where and what: "invalid JSON at line 3 column 7: <problem>" (`line_no`: the line of a
    JSON-lines file the error is in). The parser's "Invalid control character at" is said whole."""
    problem = err.msg.removesuffix(" at")  # the parser's message leads into its position
    if problem == "Invalid control character":
        problem = (
            "a control character (a tab or line break) inside a string; write it as \\t or \\n"
        )
    return f"invalid JSON at line {line_no or err.lineno} column {err.colno}: {problem}"


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _read_jsonl(file: Path) -> Iterator[Any]:
    with file.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}: {json_problem(err, line_no)}") from err


def download_hub_dataset(
    repo_id: str,
    *,
    name: str,
    revision: str | None = None,
    folder: str | None = None,
    subset: str | None = None,
    split: str = "train",
    suffixes: tuple[str, ...] = SUFFIXES,
) -> list[Path]:
    """Download a hub data set repository and return the data files of `split`, sorted.

    `name`: the data set's name in dataset_info.json, for the messages. `folder` is a folder
    inside the repository; `subset` (a `datasets` config name) is looked up as a folder of that
    name, which is how hub repositories lay out their configs' data files. Files of a split are
    those named `<split>...` (e.g. `train-00000-of-00001.parquet`, `train.jsonl`) or under a
    folder named `<split>`; a repository with no split in any file name is all `train`.
    """
    prefix = "/".join(p.strip("/") for p in (folder, subset) if p)
    patterns = [f"{prefix}/*{s}" if prefix else f"*{s}" for s in suffixes]
    where = f"data set {name!r} (hf_hub_url {repo_id})"
    local = _snapshot(repo_id, revision=revision, patterns=patterns, where=where)
    root = local / prefix if prefix else local
    if not root.is_dir():
        raise FileNotFoundError(
            f"{where}: no folder {prefix!r} in the repository (from folder="
            f"{folder!r}, subset={subset!r}); check `folder`/`subset` in dataset_info.json"
        )
    files = data_files(root, suffixes)
    chosen = [f for f in files if _in_split(f.relative_to(root), split)]
    if (
        not chosen
        and split == "train"
        and not any(_names_split(f.relative_to(root)) for f in files)
    ):
        chosen = files  # no split in any name: everything is train, as `datasets` does
    if not chosen:
        names = ", ".join(str(f.relative_to(root)) for f in files[:20])
        raise FileNotFoundError(
            f"{where}: no data file of split {split!r} among: {names}; set `split` "
            "in dataset_info.json to the split named in those files"
        )
    tops = sorted({f.relative_to(root).parts[0] if f.parent != root else "." for f in chosen})
    if len(tops) > 1:
        raise ValueError(
            f"{where}: split {split!r} has files in several folders {tops}, "
            "usually one per subset (config); set `subset` or `folder` in dataset_info.json"
        )
    return chosen


def _snapshot(repo_id: str, *, revision: str | None, patterns: list[str], where: str) -> Path:
    """The local snapshot folder of a hub data set; a failed download is a user error."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    go_offline_if_unreachable()  # fail at once, not after the hub's retries
    try:
        return Path(
            snapshot_download(
                repo_id=repo_id, repo_type="dataset", revision=revision, allow_patterns=patterns
            )
        )
    except LocalEntryNotFoundError as err:  # offline or unreachable, and not in the hub cache
        raise FileNotFoundError(
            f"{where}: cannot download it: the Hugging Face hub is unreachable (no network, or "
            "HF_HUB_OFFLINE is set) and no copy is in the local hub cache. Run where the hub is "
            f"reachable, or download it there (`hf download {repo_id} --repo-type dataset "
            "--local-dir DIR`) and replace the entry's hf_hub_url with file_name: DIR (or the "
            "data files of the split you want) in dataset_info.json"
        ) from err
    except HfHubHTTPError as err:  # no such repository or revision, gated or private
        reason = " ".join(str(err).split())  # the hub's text, as one paragraph
        raise ValueError(
            f"{where}: the hub refused the download ({reason}); check hf_hub_url and revision in "
            "dataset_info.json, and for a gated or private data set accept its terms on the hub "
            "and log in (`hf auth login`)"
        ) from err


def _in_split(relative: Path, split: str) -> bool:
    """A file is in `split` if a folder is named so or its name is `<split>.*` / `<split>-*`."""
    stem = relative.name.split(".")[0]
    return split in relative.parts[:-1] or stem == split or stem.startswith(f"{split}-")


def _names_split(relative: Path) -> bool:
    """Whether any word of the path (split at - _ . /) is a usual split name."""
    return any(word in KNOWN_SPLITS for word in re.split(r"[-_./]", relative.as_posix()))
