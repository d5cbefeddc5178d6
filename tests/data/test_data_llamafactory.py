"""LLaMA-Factory's own data registry, as shipped (tests/data_fixtures/llamafactory/data/):
every local entry loads, every hub entry fails fast offline in one paragraph naming the data set,
its hub id and the fix, every entry of a feature not supported yet is refused by name, and other
hubs' source keys (om_hub_url, ms_hub_url) beside hf_hub_url are ignored. Also the demo data's
failure mode: rows that lose every supervised token to cutoff_len are counted and explained."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

from data_fixtures.helpers import demo_tokenizer, write_rows
from data_fixtures.pt_corpus import write_lf_corpus
from megatrain.cli import main
from megatrain.data import DataConfig, prepare_data
from megatrain.data.preference_data import prepare_preference

FIXTURE = Path(__file__).resolve().parents[1] / "data_fixtures" / "llamafactory" / "data"
INFO: dict[str, Any] = json.loads((FIXTURE / "dataset_info.json").read_text(encoding="utf-8"))
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
# the HTTP client huggingface_hub's errors are built on (httpx, or httpx2 from hub 2.x on)
HTTP = importlib.import_module(
    next(c.__module__ for c in RepositoryNotFoundError.__mro__ if c.__name__ == "HTTPError")
)
GIT_BLOB = "4d105699026995d1455f6ecb44e2702bef97a7c3"  # data/dataset_info.json, see README.md


def _glaive_rows(count: int) -> list[dict[str, Any]]:
    """glaive_toolcall_*_demo rows: a call, its result, the answer; tool schemas of growing size."""
    rows = []
    for i in range(count):
        props = {f"p{k}": {"type": "string", "description": f"part {k}"} for k in range(1 + i)}
        tool = {"name": "find", "description": "Find a recipe", "parameters": {"properties": props}}
        call = {"name": "find", "arguments": {"p0": f"dish {i}"}}
        turns = [
            ("human", f"Find dish {i}."),
            ("function_call", json.dumps(call)),
            ("observation", json.dumps({"found": f"dish {i}"})),
            ("gpt", f"Here is dish {i}."),
        ]
        conversation = [{"from": role, "value": value} for role, value in turns]
        rows.append({"conversations": conversation, "tools": json.dumps([tool])})
    return rows


ALPACA = [
    {"instruction": "Reverse the letters.", "input": "a b c", "output": "c b a"},
    {"instruction": "hi", "input": "", "output": "Hello! I am {{name}}, made by {{author}}."},
]
ALPACA_ZH = [{"instruction": "把字母倒过来。", "input": "a b c", "output": "c b a"}]
GLAIVE = _glaive_rows(4)
LOCAL_SFT = {  # file name in the registry: its rows
    "identity.json": ALPACA,
    "alpaca_en_demo.json": ALPACA,
    "alpaca_zh_demo.json": ALPACA_ZH,
    "glaive_toolcall_en_demo.json": GLAIVE,
    "glaive_toolcall_zh_demo.json": GLAIVE,
}
LOCAL_PT = ("wiki_demo", "c4_demo")  # written by write_lf_corpus
IMAGES = "multimodal data (columns.images)"
UNSUPPORTED = {  # the entry: the feature its error names
    "mllm_audio_demo": "multimodal data (columns.audios) is",
    "mllm_video_demo": "multimodal data (columns.videos) is",
    "mllm_video_audio_demo": "multimodal data (columns.videos, columns.audios) is",
    **{name: f"{IMAGES} is" for name in ("rlhf_v", "vlfeedback", "rlaif_v")},  # preference
}
LOCAL_IMAGES = ("mllm_demo",)  # loads with a vision-language processor (test_data_vlm.py)
# preference entries (data.stage dpo) and KTO entries (kto), local or on the hub
DPO = ("dpo_en_demo", "dpo_zh_demo", "dpo_mix_en", "dpo_mix_zh", "coig_p", "ultrafeedback")
DPO_HUB_NO_COLUMNS = ("orca_pairs", "nectar_rm", "orca_dpo_de")
KTO = ("kto_en_demo", "kto_mix_en", "ultrafeedback_kto")
STAGE = {**{n: "dpo" for n in (*DPO, *DPO_HUB_NO_COLUMNS)}, **{n: "kto" for n in KTO}}
PAIR = {
    "conversations": [
        {"from": "human", "value": "Name a colour."},
        {"from": "gpt", "value": "Blue."},
        {"from": "human", "value": "Another one?"},
    ],
    "chosen": {"from": "gpt", "value": "Red."},
    "rejected": {"from": "gpt", "value": "No."},
}
KTO_ROW = {
    "messages": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi!"},
    ],
    "label": True,
}
LOCAL_PREFERENCE = {"dpo_en_demo.json": [PAIR] * 2, "dpo_zh_demo.json": [PAIR]}
LOCAL_PREFERENCE["kto_en_demo.json"] = [KTO_ROW, {**KTO_ROW, "label": False}]
HUB_PT = (  # raw-text corpora: tried under data.stage: pt
    *("refinedweb", "redpajama_v2", "wikipedia_en", "wikipedia_zh", "pile", "skypile"),
    *("fineweb", "fineweb_edu", "cci3_hq", "cci3_data", "cci4_base", "cci4_cot", "cci4_extra"),
    *("the_stack", "starcoder_python"),
)
LOCAL_FILES = {**LOCAL_SFT, **LOCAL_PREFERENCE}
LOCAL_NAMES = [n for n, e in INFO.items() if e.get("file_name") in LOCAL_FILES] + list(LOCAL_PT)
HUB = [n for n in INFO if n not in {*LOCAL_NAMES, *UNSUPPORTED, *LOCAL_IMAGES, "deepctrl"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return demo_tokenizer()


@pytest.fixture(scope="module")
def lf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LLaMA-Factory's data folder: its registry, and small files for its local entries."""
    folder = tmp_path_factory.mktemp("llamafactory") / "data"
    write_lf_corpus(folder)  # c4_demo.jsonl, wiki_demo.txt (and a registry, replaced below)
    for file_name, rows in LOCAL_FILES.items():
        write_rows(folder / file_name, rows)
    shutil.copyfile(FIXTURE / "dataset_info.json", folder / "dataset_info.json")
    return folder


@pytest.fixture(autouse=True)
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network and an empty hub cache, whatever the machine has."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def _cfg(name: str, folder: Path) -> DataConfig:
    stage = "pt" if name in (*LOCAL_PT, *HUB_PT) else STAGE.get(name, "sft")
    cache = str(folder.parent / "cache") if stage == "pt" else None
    return DataConfig(dataset=name, dataset_dir=str(folder), stage=stage, cache_dir=cache)


def _prepare(cfg: DataConfig, tokenizer: Any) -> Any:
    """prepare_data, or prepare_preference for data.stage dpo / kto."""
    if cfg.stage in ("dpo", "kto"):
        return prepare_preference(cfg, tokenizer)
    return prepare_data(cfg, tokenizer)


def test_the_fixture_is_llamafactorys_file_and_every_entry_is_classified() -> None:
    data = (FIXTURE / "dataset_info.json").read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == GIT_BLOB
    assert len(INFO) == 104
    assert len(LOCAL_NAMES) == 10 and len(UNSUPPORTED) == 6 and len(HUB) == 86
    assert {n for n, e in INFO.items() if e.get("ranking")} == {
        *DPO,
        *DPO_HUB_NO_COLUMNS,
        *UNSUPPORTED,
    } - {n for n in UNSUPPORTED if not INFO[n].get("ranking")}
    assert {n for n, e in INFO.items() if "kto_tag" in e.get("columns", {})} == set(KTO)
    assert all("hf_hub_url" in INFO[name] for name in HUB)
    assert set(HUB_PT) <= set(HUB)


@pytest.mark.parametrize("name", LOCAL_NAMES)
def test_every_local_entry_loads(name: str, lf_dir: Path, tokenizer: Any) -> None:
    stats = _prepare(_cfg(name, lf_dir), tokenizer).stats
    file_name = INFO[name]["file_name"]
    if name in LOCAL_PT:  # a document per line
        expected = len((lf_dir / file_name).read_text(encoding="utf-8").splitlines())
    else:
        expected = len(LOCAL_FILES[file_name])
    assert (stats.rows_read, stats.kept, stats.dropped) == (expected, expected, {})


@pytest.mark.parametrize("name", HUB)
def test_every_hub_entry_offline_names_itself_its_id_and_the_fix(
    name: str, lf_dir: Path, tokenizer: Any
) -> None:
    repo = INFO[name]["hf_hub_url"]
    with pytest.raises(FileNotFoundError) as err:
        _prepare(_cfg(name, lf_dir), tokenizer)
    message = str(err.value)
    assert message.startswith(f"data set {name!r} (hf_hub_url {repo}): cannot download it")
    assert "the Hugging Face hub is unreachable" in message
    assert f"`hf download {repo} --repo-type dataset --local-dir DIR`" in message
    assert "replace the entry's hf_hub_url with file_name: DIR" in message
    assert "\n" not in message and "ConnectError" not in message


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_unsupported_entry_names_the_feature(name: str, lf_dir: Path, tokenizer) -> None:
    with pytest.raises(ValueError) as err:
        prepare_data(_cfg(name, lf_dir), tokenizer)
    message = str(err.value)
    assert f"data set {name!r}: {UNSUPPORTED[name]} not supported yet" in message
    assert "for formatting" not in message  # not mistaken for a column error


def test_an_entry_only_on_another_hub_is_named(lf_dir: Path, tokenizer: Any) -> None:
    with pytest.raises(ValueError) as err:
        prepare_data(_cfg("deepctrl", lf_dir), tokenizer)
    message = str(err.value)
    assert "data set 'deepctrl': its only source is ms_hub_url='deepctrl/deepctrl-sft-data'" in (
        message
    )
    assert "set file_name to the local copy" in message


@pytest.mark.parametrize("name", ["alpaca_en", "alpaca_gpt4_zh"])
def test_om_hub_url_beside_hf_hub_url_is_ignored(
    name: str, lf_dir: Path, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert {"hf_hub_url", "ms_hub_url", "om_hub_url"} <= set(INFO[name])
    write_rows(tmp_path / "snapshot" / "train.json", ALPACA)
    calls: list[dict[str, Any]] = []

    def snapshot_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    stats = prepare_data(_cfg(name, lf_dir), tokenizer).stats
    assert [c["repo_id"] for c in calls] == [INFO[name]["hf_hub_url"]]
    assert (stats.rows_read, stats.kept) == (len(ALPACA), len(ALPACA))


def test_a_refused_hub_download_is_one_paragraph(
    lf_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = "https://huggingface.co/api/datasets/llamafactory/alpaca_zh"
    response = HTTP.Response(404, request=HTTP.Request("GET", url))

    def snapshot_download(**kwargs: Any) -> str:
        text = f"404 Client Error.\n\nRepository Not Found for url: {url}."
        raise RepositoryNotFoundError(text, response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ValueError) as err:
        prepare_data(_cfg("alpaca_zh", lf_dir), tokenizer)
    assert str(err.value) == (
        "data set 'alpaca_zh' (hf_hub_url llamafactory/alpaca_zh): the hub refused the download "
        f"(404 Client Error. Repository Not Found for url: {url}.); check hf_hub_url and "
        "revision in dataset_info.json, and for a gated or private data set accept its terms on "
        "the hub and log in (`hf auth login`)"
    )


def test_the_cli_prints_an_offline_hub_entry_as_one_line(
    lf_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--data.dataset", "alpaca_en", "--data.dataset_dir", str(lf_dir), "--show", "0"]
    assert main(["data", "--config", str(DEMO), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain data: error: data set 'alpaca_en' (hf_hub_url ")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_rows_that_do_not_fit_cutoff_len_are_counted_and_explained(
    overflow: str, tokenizer: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_rows(tmp_path / "glaive_toolcall_en_demo.json", _glaive_rows(8))
    whole = prepare_data(DataConfig(dataset=str(path), cutoff_len=4096), tokenizer).train
    first_target = [int(s.target_mask.argmax()) for s in whole]
    lengths = [s.num_tokens for s in whole]
    # half the rows answer past the cut (truncate), or are longer than it (drop)
    cutoff = sorted(first_target if overflow == "truncate" else lengths)[len(whole) // 2]
    fits = [
        s.num_tokens <= cutoff or (overflow == "truncate" and f < cutoff)
        for s, f in zip(whole, first_target, strict=True)
    ]
    cut = [s.num_tokens for s, fit in zip(whole, fits, strict=True) if not fit]
    assert 0 < len(cut) < len(whole)
    cfg = DataConfig(dataset=str(path), cutoff_len=cutoff, overflow=overflow)
    with caplog.at_level(logging.WARNING, logger="megatrain.data.pipeline"):
        stats = prepare_data(cfg, tokenizer).stats
    assert (stats.kept, stats.dropped) == (sum(fits), {"over_cutoff_len": len(cut)})
    why = (
        f"are longer than data.cutoff_len={cutoff} (overflow: drop)"
        if overflow == "drop"
        else "keep fewer than data.min_target_tokens=1 supervised tokens when truncated to "
        f"data.cutoff_len={cutoff}"
    )
    assert (
        f"; {len(cut)} of the {len(whole)} rows were dropped because they do not fit: they {why}; "
        f"raise data.cutoff_len ({max(cut)} keeps every such row whole)"
    ) in caplog.text
    cfg = DataConfig(dataset=str(path), cutoff_len=max(cut), overflow=overflow)
    assert prepare_data(cfg, tokenizer).stats.kept == len(whole)
