"""model/flex_sinks.py on the CPU: the block mask it reads from a layer's mask, the attention's
forward (flex attention's eager form: torch has no flex backward on the CPU, so the gradients
are tested on CUDA, tests/model/test_flex_sinks_cuda.py), and the cache of block masks.

Block lists: the same blocks as torch's own `create_block_mask` of the same mask function, for
causal, sliding-window, padded and packed masks over lengths that do and do not fill the last
block. Forward: against transformers' eager GPT-OSS attention, within the fp32 rounding bound of
tests/model/test_sink_attention.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
from test_sink_attention import HEADS, KV_HEADS, ROWS, _additive, _assert_fp32_close, _module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

import megatrain.model.flex_sinks as flex_sinks

WINDOW = 100
LEFT = 130  # left padding past a whole block: queries that see no key


def _mask(kind: str, seq: int, window: int = WINDOW, left: int = LEFT) -> torch.Tensor:
    """Bool [B, 1, S, S], as transformers builds it for sdpa (also the CUDA tests')."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    causal = (j <= i).expand(ROWS, 1, seq, seq)
    if kind == "sliding":
        return causal & (i - j < window)
    if kind == "padded":
        keys = torch.ones(ROWS, seq, dtype=torch.bool)
        keys[0, -5:] = False  # right padding
        keys[1, :left] = False  # left padding: the first `left` queries see no key at all
        return causal & keys[:, None, None, :]
    if kind == "packed":
        return causal & ((i < seq // 3) == (j < seq // 3))
    return causal


@pytest.mark.parametrize("seq", [256, 300])
@pytest.mark.parametrize("kind", ["causal", "sliding", "padded", "packed"])
def test_the_blocks_are_torchs(kind: str, seq: int) -> None:
    mask = _mask(kind, seq)
    ours = flex_sinks._block_mask(mask, seq, -(-seq // 128) * 128, torch.device("cpu"))
    kept = mask[:, 0].contiguous()
    theirs = create_block_mask(lambda b, h, q, k: kept[b, q, k], ROWS, None, seq, seq, "cpu")
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # blocks visited
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)  # of them unmasked


@pytest.mark.parametrize("seq", [256, 300])
def test_no_mask_is_causal_without_an_s_by_s_tensor(seq: int) -> None:
    """The causal block lists come from arithmetic: the blocks the causal mask's visit, the
    ones below the diagonal whole (past the row's end too: flex bounds the queries there)."""
    wide, cpu = -(-seq // 128) * 128, torch.device("cpu")
    causal = flex_sinks._block_mask(None, seq, wide, cpu)
    masked = flex_sinks._block_mask(_mask("causal", seq)[:1], seq, wide, cpu)
    assert torch.equal(causal.to_dense(), masked.to_dense())
    blocks = -(-seq // flex_sinks.BLOCK)
    assert causal.full_kv_num_blocks.flatten().tolist() == list(range(blocks))
    if seq % flex_sinks.BLOCK == 0:
        assert torch.equal(causal.full_kv_num_blocks, masked.full_kv_num_blocks)
    padded = flex_sinks._block_mask(None, seq, 1024, torch.device("cpu"))  # run at 1024
    assert padded.kv_num_blocks.flatten().tolist() == [1] * blocks + [0] * (8 - blocks)
    assert padded.full_kv_num_blocks.flatten().tolist() == list(range(blocks)) + [0] * (8 - blocks)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["none", "sliding", "padded", "packed"])
def test_the_forward_equals_eager(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex_sinks, "_compiled", lambda: flex_attention)  # eager flex on CPU
    monkeypatch.setattr(flex_sinks, "_SHAPES", set())
    seq, head_dim = 300, 64  # run at 512 positions
    module = _module()
    torch.manual_seed(1)
    q, k, v = (torch.randn(ROWS, h, seq, head_dim) for h in (HEADS, KV_HEADS, KV_HEADS))
    mask = None if kind == "none" else _mask(kind, seq)
    eager_mask = _additive(_mask("causal", seq) if mask is None else mask)
    with torch.no_grad():
        ref, _ = eager_attention_forward(module, q, k, v, eager_mask, scaling=module.scaling)
        out = flex_sinks.flex_sink_attention(q, k, v, module.sinks, mask, module.scaling)
    # the scores' dot, the softmax's sums, the values' sum and the sink's reweighting
    _assert_fp32_close(out, ref, head_dim + 2 * (seq + 1) + 4)
    if kind == "padded":  # a query that sees no key attends to the sink alone: output 0
        assert torch.equal(out[1, :LEFT], torch.zeros_like(out[1, :LEFT]))


def test_the_cache_holds_a_block_mask_while_its_mask_lives() -> None:
    cpu = torch.device("cpu")
    mask = _mask("sliding", 300)
    first = flex_sinks._cached_block_mask(mask, 300, 512, cpu)
    assert flex_sinks._cached_block_mask(mask, 300, 512, cpu) is first  # the layers share it
    assert flex_sinks._cached_block_mask(mask.clone(), 300, 512, cpu) is not first
    del mask, first
    gc.collect()
    assert len(flex_sinks._BLOCK_MASKS) == 0


def test_flex_runs_on_cuda_only() -> None:
    query = torch.zeros(1, HEADS, 8, 64)  # the CPU: no flex backward
    assert not flex_sinks.flex_ready(query, None, True, square=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_call_shapes_past_the_budget_take_the_sdpa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of 100 tokens runs at 128 positions, a shape compiled already; one of 300 at 512, a
    new shape past a full budget (torch's recompile limit less one): None, the sdpa path."""
    monkeypatch.setattr(flex_sinks, "_compiled", lambda: flex_attention)
    seen = {(1, 1 << (i + 12), "causal", torch.float32, False) for i in range(6)}
    monkeypatch.setattr(flex_sinks, "_SHAPES", seen | {(1, 128, "causal", torch.float32, False)})
    widths = [flex_sinks.width(n) for n in (1, 100, 128, 129, 300, 2048)]
    assert widths == [128, 128, 128, 256, 512, 2048]
    sinks = torch.zeros(HEADS)
    with torch._dynamo.config.patch(recompile_limit=8), torch.no_grad():
        assert flex_sinks._budget() == 7
        for seq, runs in ((100, True), (300, False)):
            q, k = torch.zeros(1, HEADS, seq, 64), torch.zeros(1, KV_HEADS, seq, 64)
            out = flex_sinks.flex_sink_attention(q, k, k, sinks, None, 0.125)
            assert (out is not None) == runs
            assert out is None or out.shape == (1, seq, HEADS, 64)
    with torch._dynamo.config.patch(recompile_limit=64), torch.no_grad():  # as compiled layers
        assert flex_sinks.flex_sink_attention(q, k, k, sinks, None, 0.125) is not None


def test_a_shape_torch_cannot_compile_takes_the_sdpa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile failure (run 78's first versions met two, in inductor) costs that shape its
    flex path, once, with a warning: the run goes on on the sdpa path."""

    def fails(*args: object, **kwargs: object) -> None:
        raise torch._dynamo.exc.TorchRuntimeError("lowering failed")

    monkeypatch.setattr(flex_sinks, "_compiled", lambda: fails)
    monkeypatch.setattr(flex_sinks, "_SHAPES", set())
    monkeypatch.setattr(flex_sinks, "_FAILED", set())
    q, k = torch.zeros(1, HEADS, 100, 64), torch.zeros(1, KV_HEADS, 100, 64)
    with pytest.warns(UserWarning, match="did not compile .* 1 x 128 tokens"):
        assert flex_sinks.flex_sink_attention(q, k, k, torch.zeros(HEADS), None, 0.125) is None
    monkeypatch.setattr(flex_sinks, "_compiled", lambda: pytest.fail("tried again"))
    assert flex_sinks.flex_sink_attention(q, k, k, torch.zeros(HEADS), None, 0.125) is None
