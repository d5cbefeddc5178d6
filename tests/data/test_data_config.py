"""DataConfig: defaults validate; invalid values are rejected naming `data.<field>` and value."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain.data import DataConfig


def test_defaults_validate_and_cover_the_pipeline_options() -> None:
    cfg = DataConfig()
    cfg.validate()
    names = {f.name for f in dataclasses.fields(DataConfig)}
    required = {
        "dataset",
        "dataset_dir",
        "eval_dataset",
        "val_size",
        "cutoff_len",
        "overflow",
        "packing",
        "train_on_prompt",
        "system_prompt",
        "max_samples",
        "shuffle",
        "seed",
        "min_target_tokens",
    }
    assert required <= names
    assert cfg.dataset_names() == ["demo"]
    assert cfg.eval_dataset_names() == []


def test_dataset_names_split_commas_and_lists() -> None:
    assert DataConfig(dataset=" a, b,,c ").dataset_names() == ["a", "b", "c"]
    assert DataConfig(dataset=["x.jsonl", "y"]).dataset_names() == ["x.jsonl", "y"]
    assert DataConfig(eval_dataset="e1,e2").eval_dataset_names() == ["e1", "e2"]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"overflow": "cut"}, "data.overflow='cut' must be one of ['truncate', 'drop']"),
        ({"cutoff_len": 0}, "data.cutoff_len=0 must be an integer >= 2"),
        ({"cutoff_len": 8.5}, "data.cutoff_len=8.5 must be an integer >= 2"),
        ({"pad_to_multiple_of": 0}, "data.pad_to_multiple_of=0"),
        ({"min_target_tokens": -1}, "data.min_target_tokens=-1"),
        ({"max_samples": 0}, "data.max_samples=0"),
        ({"seed": -3}, "data.seed=-3"),
        ({"packing": "yes"}, "data.packing='yes' must be true or false"),
        ({"dataset": ""}, "data.dataset='' names no data set"),
        ({"dataset": ["a", 3]}, "data.dataset=['a', 3] must be a string or a list of strings"),
        ({"val_size": -0.5}, "data.val_size=-0.5"),
        ({"val_size": 2.5}, "data.val_size=2.5: values >= 1 are a sample count and must be whole"),
        ({"val_size": 0.1, "eval_dataset": "demo"}, "data.val_size=0.1 and data.eval_dataset="),
    ],
)
def test_validate_names_key_and_value(changes: dict, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        DataConfig(**changes).validate()
    assert expected in str(err.value)


@pytest.mark.parametrize("val_size", [0, 0.0, 0.25, 1, 10, 10.0])
def test_val_size_accepts_fraction_and_count(val_size: float) -> None:
    DataConfig(val_size=val_size).validate()
