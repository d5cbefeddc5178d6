"""The estimate of a vision-language run counts its vision modules: their weights on the GPU
(frozen; trained with their gradient and their backward's activations), the frozen ones in fp32
on the host, and the tower's time per image token (`megatrain estimate --image-share`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from megatrain.cli import main
from megatrain.model.loading import load_config
from megatrain.model.multimodal import vision_numel
from megatrain.planning import model_spec

_RUN = ["--model-type", "qwen2_5_vl", "--tiny", "--seq-len", "256", "--micro-batch-size", "2"]
_RUN += ["--gpu-gib", "80", "--host-gib", "64", "--json"]


def _estimate(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    main(["estimate", *_RUN, *flags])
    return json.loads(capsys.readouterr().out)


def test_the_estimate_counts_the_vision_modules(capsys: pytest.CaptureFixture[str]) -> None:
    spec = model_spec(load_config(None, model_type="qwen2_5_vl", tiny=True), "bf16")
    vision = vision_numel(spec.structure)
    text = _estimate(capsys)
    images = _estimate(capsys, "--image-share", "0.5")
    trained = _estimate(
        capsys,
        "--image-share",
        "0.5",
        "--model.freeze_vision",
        "false",
        "--model.freeze_projector",
        "false",
    )
    # GPU: the frozen tower in bf16; trained, its weights and fp32 gradient instead
    assert text["gpu"]["items"]["vision modules (frozen)"] == 2 * vision
    items = trained["gpu"]["items"]
    assert "vision modules (frozen)" not in items
    assert (items["vision weights (trained)"], items["vision gradient (fp32)"]) == (
        2 * vision,
        4 * vision,
    )
    # host: the frozen tower in fp32 beside the process; trained, a block of the store
    assert text["host"]["baseline_bytes"] - trained["host"]["baseline_bytes"] == 4 * vision
    assert trained["host"]["store_bytes"] > text["host"]["store_bytes"]
    # time: the tower runs per image token; trained, again in the backward
    assert text["time"]["vision_s"] == 0 < images["time"]["vision_s"] < trained["time"]["vision_s"]
    assert trained["time"]["vision_s"] == pytest.approx(4 * images["time"]["vision_s"])


def test_a_share_outside_0_1_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *_RUN, "--image-share", "1.5"]) == 2
    assert "--image-share 1.5" in capsys.readouterr().err
