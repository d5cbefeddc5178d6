"""Vision-language micro-batches: the demo's image token counts are what the tiny Qwen2.5-VL
model expects (its forward checks them), `Batch.images` follows the placeholder order through
packing and shuffling, and the prefetch thread keeps the order and the loader's resumable state."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from megatrain.batch import IGNORE_INDEX, Batch
from megatrain.data import DataConfig, make_loader, prepare_data
from megatrain.data.prefetch import prefetched
from megatrain.data.ranks import RankLoader
from megatrain.model.tiny_vision import demo_vlm_config
from megatrain.package_assets import demo_vlm_dir

PROCESSOR = str(demo_vlm_dir())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(PROCESSOR)


@pytest.fixture(scope="module")
def data(tokenizer: Any) -> Any:
    cfg = DataConfig(dataset="demo_vlm", cutoff_len=128, max_samples=40)
    return prepare_data(cfg, tokenizer, processor=PROCESSOR)


def _loader(data: Any, *, packing: bool, seed: int = 3) -> Any:
    return make_loader(
        data.train,
        micro_batch_size=3,
        seq_len=128,
        packing=packing,
        pad_token_id=data.pad_token_id,
        seed=seed,
        vision=data.vision,
    )


def _image_runs(batch: Batch, image_id: int) -> list[int]:
    """Lengths of the runs of image tokens, rows in order, each left to right."""
    runs: list[int] = []
    for row in batch.input_ids.tolist():
        previous = False
        for token in row:
            if token == image_id and not previous:
                runs.append(0)
            if token == image_id:
                runs[-1] += 1
            previous = token == image_id
    return runs


def test_the_tiny_vlm_model_takes_a_demo_batch_and_returns_a_loss(data: Any) -> None:
    config = demo_vlm_config()
    assert config.image_token_id == data.vision.image_token_id
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    batch = next(iter(_loader(data, packing=False)))
    assert batch.num_images >= 3 and set(batch.images) == {"pixel_values", "image_grid_thw"}
    # the model raises when the image tokens and the vision tower's features disagree in count
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        labels=batch.labels,
        **batch.images,
    )
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    merge = config.vision_config.spatial_merge_size
    per_image = (batch.images["image_grid_thw"].prod(dim=1) // merge**2).tolist()
    assert _image_runs(batch, config.image_token_id) == per_image


@pytest.mark.parametrize("packing", [False, True])
def test_batch_images_follow_the_placeholder_order(data: Any, packing: bool) -> None:
    loader = _loader(data, packing=packing)
    order = loader.epoch_order(0)
    image_id = data.vision.image_token_id
    for step, batch in enumerate(loader):
        picked = order[step * 3 : (step + 1) * 3]
        rows = [loader.rows[r] for r in picked] if packing else [[i] for i in picked]
        samples = [data.train[i] for row in rows for i in row]
        paths = [p for s in samples for p in s.images]
        assert _image_runs(batch, image_id) == [n for s in samples for n in s.image_tokens]
        if paths:
            expected = data.vision.features(paths)
            assert batch.images is not None and set(batch.images) == set(expected)
            for key, value in expected.items():
                assert torch.equal(batch.images[key], value), key
        else:
            assert batch.images is None
        assert not (batch.labels[batch.input_ids == image_id] != IGNORE_INDEX).any()
    assert step == len(loader) - 1


def test_prefetch_keeps_the_order_and_the_resumable_state(data: Any) -> None:
    straight = _loader(data, packing=True)
    resumed = _loader(data, packing=True)
    stream = iter(straight)
    first = [next(stream) for _ in range(2)]
    state = straight.state_dict()
    assert state["step"] == 2  # counted as yielded, not as prefetched
    resumed.load_state_dict(state)
    rest, again = list(stream), list(resumed)
    assert len(rest) == len(again) == len(straight) - 2
    for a, b in zip(rest, again, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.images["pixel_values"], b.images["pixel_values"])
    assert first[0].images is not None


def test_prefetched_runs_ahead_on_one_thread_in_order() -> None:
    made: list[tuple[int, str]] = []
    lock = threading.Lock()

    def make(item: int) -> int:
        with lock:
            made.append((item, threading.current_thread().name))
        time.sleep(0.002 * (item % 3))  # uneven work: order must not depend on it
        return item * 10

    stream = prefetched(make, range(8), depth=2)
    assert next(stream) == 0
    time.sleep(0.05)
    assert len(made) == 3  # the one yielded and two ahead, no more
    assert list(stream) == [10 * i for i in range(1, 8)]
    assert [i for i, _ in made] == list(range(8))
    assert all(name.startswith("megatrain-prefetch") for _, name in made)


def test_prefetched_raises_at_the_failing_item_and_closes() -> None:
    def make(item: int) -> int:
        if item == 2:
            raise ValueError("bad image 2")
        return item

    stream = prefetched(make, range(5), depth=2)
    assert [next(stream), next(stream)] == [0, 1]
    with pytest.raises(ValueError, match="bad image 2"):
        next(stream)
    closed = prefetched(lambda i: i, range(100), depth=2)
    assert next(closed) == 0
    closed.close()  # cancels the queued items, joins the worker


def test_batch_moves_its_images_and_counts_them() -> None:
    ids = torch.zeros(1, 4, dtype=torch.int64)
    images = {"pixel_values": torch.ones(8, 6), "image_grid_thw": torch.tensor([[1, 2, 2]] * 2)}
    batch = Batch(input_ids=ids, labels=ids.clone(), images=images)
    moved = batch.to("cpu")
    assert moved.num_images == 2 and torch.equal(
        moved.images["pixel_values"], images["pixel_values"]
    )
    assert Batch(input_ids=ids, labels=ids).num_images == 0


def test_a_rank_builds_only_its_own_micro_batches(data: Any) -> None:
    loader = _loader(data, packing=True)
    built: list[list[int]] = []
    make = loader._make_batch

    def recording(picked: Any) -> Batch:
        built.append(picked.tolist())
        return make(picked)

    loader._make_batch = recording  # type: ignore[method-assign]
    order = loader.epoch_order(0)
    step_rows = [order[s * 3 : (s + 1) * 3].tolist() for s in range(len(loader))]
    rank1 = iter(RankLoader(loader, rank=1, world_size=2))
    assert len(loader) >= 4
    got = [next(rank1) for _ in range(2)]
    assert built[:2] == [step_rows[1], step_rows[3]]
    assert all(rows in step_rows[1::2] for rows in built)  # prefetched ahead: its own only
    single = list(_loader(data, packing=True))
    for batch, step in zip(got, (1, 3), strict=True):
        assert torch.equal(batch.input_ids, single[step].input_ids)
        assert torch.equal(batch.images["pixel_values"], single[step].images["pixel_values"])
