"""training.compile_layers "auto" (PlanBuilder.compiled): compiled on a GPU for fixed-length
rows of plain attention + MLP layers that need no MLP tiles; eager otherwise."""

from __future__ import annotations

import pytest
import torch

from megatrain.config.shorthand import shorthand_config
from megatrain.distributed import Placement
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import Hardware

GPU = Placement(torch.device("cuda"))  # planned for, not used: nothing runs on it


def _compiled(model_type: str, placement: Placement = GPU, **values: object) -> bool:
    cfg = shorthand_config(
        None,
        values={
            "model.model_type": model_type,
            "model.tiny": True,
            "data.packing": True,
            "data.cutoff_len": 256,
            **values,
        },
    )
    return PlanBuilder(cfg, hardware=Hardware(), placement=placement).compiled


@pytest.mark.parametrize(
    ("model_type", "values", "expected"),
    [
        ("llama", {}, True),  # packed rows of a dense model on a GPU
        ("llama", {"data.stage": "pt"}, True),  # full pre-training rows
        ("llama", {"data.packing": False}, False),  # padded rows: every length recompiles
        ("llama", {"memory.mlp_tiles": 4}, False),  # tiles run eager
        ("llama", {"training.compile_layers": False}, False),
        ("qwen3_moe", {}, True),  # MoE layers: compiled peak as eager, 1.40x faster (run 41)
        ("qwen3_5_text", {}, False),  # hybrid linear attention: slower compiled with fla
    ],
)
def test_auto_compiles_only_where_the_plan_holds(
    model_type: str, values: dict[str, object], expected: bool
) -> None:
    assert _compiled(model_type, **values) is expected


def test_auto_is_eager_on_the_cpu_and_true_is_taken_as_given() -> None:
    cpu = Placement(torch.device("cpu"))
    assert _compiled("llama", cpu) is False
    assert _compiled("llama", cpu, **{"training.compile_layers": True}) is True
