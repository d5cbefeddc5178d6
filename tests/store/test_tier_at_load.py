"""The GPU tier's blocks go to the device as the store builds them (store/host.py
`device_blocks`; recipes/builder.py `model_and_store` passes the run's tier), so the host never
holds the tier's states while the model loads (planning/host_memory.py's load peak).

On the CPU the move keeps the tensors where they are (the tier's code path run on the CPU); the
order of builds and moves is what is checked, and that the engine's tier is the same blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.engine.plan import tier_names
from megatrain.recipes.builder import RunBuilder
from megatrain.store.blocks import ParamBlock
from megatrain.store.host import HostStore
from megatrain.verify import verify_config


@pytest.mark.parametrize("count", [0, 2, 5])  # tiny llama: 3 layers, then embedding, head
def test_each_tier_block_moves_before_the_next_is_built(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    block, move = HostStore._block, ParamBlock.to_device

    def built(self: HostStore, name: str, *args: Any) -> ParamBlock:
        events.append(f"build {name}")
        return block(self, name, *args)

    def moved(self: ParamBlock, device: torch.device) -> None:
        events.append(f"move {self.name}")
        move(self, device)

    monkeypatch.setattr(HostStore, "_block", built)
    monkeypatch.setattr(ParamBlock, "to_device", moved)
    cfg = verify_config(
        None, ["--memory.gpu_state_blocks", str(count)], model_type="llama", tiny=True
    )
    builder = RunBuilder(cfg)
    structure, store = builder.model_and_store()
    tier = tier_names(len(structure.layers), count)
    order = ["embed", *(f"layer.{i}" for i in range(len(structure.layers))), "head"]
    assert len(structure.layers) == 3 and len(tier) == count
    expected = [
        e for name in order for e in [f"build {name}", f"move {name}"][: 1 + (name in tier)]
    ]
    assert events == expected
    engine = builder.engine(structure, store)  # its tier moves them again: nothing happens
    try:
        assert [b.name for b in engine.tier.blocks] == tier
        assert events[len(expected) :] == [f"move {name}" for name in tier]
    finally:
        engine.close()
