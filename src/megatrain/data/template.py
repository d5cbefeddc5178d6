"""Rendering: a `Conversation` to training rows (`Sample`s) through the tokenizer's chat template.

Masks are derived from the template itself, never from per-model knowledge. For every assistant
turn k of the message list (system first, when there is one):

    prompt_k = render(messages[:k], add_generation_prompt=True)
    end_k    = render(messages[:k + 1])
    full     = render(messages)                  (= end_k of the last assistant turn)

Turn k's supervised tokens are tokens(end_k)[len(tokens(prompt_k)):]: exactly what the template
renders for the assistant when the conversation ends at that turn (its content, its reasoning
block if the template renders one, whatever closes the turn). Rendering is
`tokenizer.apply_chat_template(..., tokenize=False)` then `tokenizer(text,
add_special_tokens=False)`, which is exactly what `apply_chat_template(tokenize=True)` does.

Prefix-stable templates (ChatML, Llama 3, ...) render every turn the same whatever follows it:
each end_k is a prefix of full, and one row supervises every turn. Others rewrite earlier turns
(Qwen3 drops `<think>` blocks of past replies, gpt-oss and DeepSeek-R1 drop their reasoning):
then `multi_turn` decides (docs/chat_templates.md):
- "per_turn" (default): every turn is trained as rendered when the conversation ends at it. Rows
  are the fewest renderings that hold every turn: the row end_K supervises turn K and every
  earlier turn j with prompt_j and end_j prefixes of end_K (for a prefix-stable template, all
  of them: one row). Earlier turns in a row are context as the template renders history.
- "final": one row, full: the conversation as the template renders it at its end. Supervised:
  the last turn, and every earlier turn that full renders exactly as end_j does (with Qwen3-like
  templates, usually only the last one); the others are context.

Checks per conversation, each failure a counted drop, never a crash of the run:
- prompt_k must be a prefix of end_k, else the turn cannot be masked (the generation prompt
  differs from the rendered header, e.g. it opens an empty think block the rendered reply lacks):
  "generation_prompt_not_prefix".
- tokens: the same prefixes must hold for the token ids; when the tokenizer merges characters
  across a turn boundary (a reply that starts with whitespace the header ends with):
  "token_merge_across_turns".
Images (a `vision` processor given, data/vision.py): in a conversation with images, each
`<image>` placeholder becomes a `{"type": "image"}` content item, so the model's own chat template
renders its image slot (Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`); after
tokenizing, image i's one image token is repeated as many times as the processor expands that
image, and those positions are never supervised (not even with train_on_prompt). A row holds the
images its text renders (the first n of the conversation's). A truncation that would cut an
image's tokens drops the row as "image_over_cutoff_len".
Then `cutoff_len`: each row is truncated (first tokens kept) or dropped per `overflow`. A row is
dropped if fewer than `min_target_tokens` supervised tokens remain: as "over_cutoff_len" when the
cut is the reason (the whole row has enough), else "too_few_target_tokens".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from megatrain.data.config import MULTI_TURN_CHOICES
from megatrain.data.formats import Conversation
from megatrain.data.sample import Sample
from megatrain.data.vision import IMAGE_PLACEHOLDER, VisionProcessor

TEMPLATE_ERROR = "template_error"
PROMPT_NOT_PREFIX = "generation_prompt_not_prefix"
TOKEN_MERGE = "token_merge_across_turns"
OVER_CUTOFF = "over_cutoff_len"
TOO_FEW_TARGETS = "too_few_target_tokens"
IMAGE_OVER_CUTOFF = "image_over_cutoff_len"


def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str | None:
    """The template to render with: `chat_template` (text or a file path), else the tokenizer's.

    Returns None to mean the tokenizer's own; raises when neither exists.
    """
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        if "{" not in chat_template and path.is_file():
            return path.read_text(encoding="utf-8")
        if "{" not in chat_template:
            raise FileNotFoundError(
                f"data.chat_template={chat_template!r} is neither a Jinja template nor a file"
            )
        return chat_template
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template, so conversations cannot be rendered; set "
            "data.chat_template to a Jinja chat template (the text or a .jinja file), e.g. the "
            "ChatML one in megatrain/assets/demo/tokenizer/tokenizer_config.json, or use the "
            "instruct variant of the model's tokenizer"
        )
    return None


class ChatEncoder:
    """Conversations to Samples with one tokenizer, template and set of limits."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        cutoff_len: int,
        overflow: str = "truncate",
        train_on_prompt: bool = False,
        min_target_tokens: int = 1,
        default_system: str | None = None,
        chat_template: str | None = None,
        multi_turn: str = "per_turn",
        vision: VisionProcessor | None = None,
    ) -> None:
        assert overflow in ("truncate", "drop"), overflow
        assert multi_turn in MULTI_TURN_CHOICES, multi_turn
        self.multi_turn = multi_turn
        self.tokenizer = tokenizer
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self.cutoff_len = cutoff_len
        self.overflow = overflow
        self.train_on_prompt = train_on_prompt
        self.min_target_tokens = min_target_tokens
        self.default_system = default_system
        self.vision = vision  # set by the pipeline at the first row with images
        self._longest_over_cutoff = 0  # tokens of the longest OVER_CUTOFF row not yet taken

    def messages(self, conv: Conversation) -> list[dict[str, Any]]:
        """The message list handed to the template: the system turn first, when there is one."""
        system = conv.system or self.default_system
        head = [{"role": "system", "content": system}] if system else []
        if not conv.images:
            return head + conv.messages
        return head + [{**m, "content": _image_content(m["content"])} for m in conv.messages]

    def encode(self, conv: Conversation) -> list[Sample] | str:
        """The conversation's training rows (one, unless `multi_turn` splits it), or the reason
        the conversation is dropped."""
        messages = self.messages(conv)
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            texts = []
            for k in turns:
                texts += [self.render(messages[:k], conv.tools, True)]
                texts += [self.render(messages[: k + 1], conv.tools, False)]
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"chat template syntax error, line {err.lineno}: {err}") from err
        except jinja2.TemplateError:
            return TEMPLATE_ERROR  # e.g. raise_exception() for roles the template rejects
        spans = list(zip(texts[0::2], texts[1::2], strict=True))  # (prompt_k, end_k) per turn
        must_mask = spans if self.multi_turn == "per_turn" else spans[-1:]
        if any(not end.startswith(prompt) for prompt, end in must_mask):
            return PROMPT_NOT_PREFIX
        # verbose=False: rows longer than the model's maximum are cut to cutoff_len below, so
        # transformers' "Token indices sequence length is longer than ..." warning does not apply
        ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        id_spans = list(zip(ids[0::2], ids[1::2], strict=True))
        counts = self._image_counts(conv.images, id_spans[-1][1])
        rows = []
        for last, members in self._rows(spans):
            full = id_spans[last][1]
            mask = np.zeros(len(full), dtype=np.bool_)
            for j in members:
                start_ids, end_ids = id_spans[j]
                if full[: len(start_ids)] != start_ids or full[: len(end_ids)] != end_ids:
                    return TOKEN_MERGE
                mask[len(start_ids) : len(end_ids)] = True
            if self.train_on_prompt:
                mask[:] = True
            if conv.images:
                rows.append(self._limit_images(*self._expand(full, mask, conv.images, counts)))
            else:
                rows.append(self._limit(np.asarray(full, dtype=np.int32), mask))
        kept = [row for row in rows if isinstance(row, Sample)]
        return kept or next(row for row in rows if isinstance(row, str))

    def _rows(self, spans: list[tuple[str, str]]) -> list[tuple[int, list[int]]]:
        """(turn whose end_k is the row's text, turns supervised in it), in conversation order.

        per_turn: the last unplaced turn's rendering takes every unplaced turn it holds
        unchanged, until every turn is placed. final: the last turn's rendering alone.
        """
        remaining = list(range(len(spans)))
        rows = []
        while remaining:
            text = spans[remaining[-1]][1]
            members = [j for j in remaining if _holds(text, *spans[j])]
            rows.append((remaining[-1], members))
            if self.multi_turn == "final":
                break
            remaining = [j for j in remaining if j not in members]
        return rows[::-1]

    def render(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=generation,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text

    def note_over_cutoff(self, num_tokens: int) -> None:
        """A row of `num_tokens` was dropped as OVER_CUTOFF (for the hint of the data summary)."""
        self._longest_over_cutoff = max(self._longest_over_cutoff, num_tokens)

    def take_longest_over_cutoff(self) -> int:
        """Tokens of the longest row dropped as "over_cutoff_len" since the last call (0: none):
        the cutoff_len that would have kept every such row whole."""
        longest, self._longest_over_cutoff = self._longest_over_cutoff, 0
        return longest

    def _image_counts(self, images: list[str], full: list[int]) -> list[int]:
        """Each image's token count; ValueError unless the whole conversation's rendering
        (`full`) holds one image slot per image."""
        if not images:
            return []
        if self.vision is None:
            raise ValueError(
                "the data set has images but no vision processor was given to the chat encoder; "
                "train a vision-language model (its processor expands the images)"
            )
        slots = sum(t == self.vision.image_token_id for t in full)
        if slots != len(images):
            raise ValueError(
                f"the chat template renders {slots} image slot(s) ({self.vision.image_token}) "
                f"for a conversation with {len(images)} image(s): it must render "
                '{"type": "image"} content items, as the model\'s own template does; set '
                "data.chat_template to the model's template (or leave it unset)"
            )
        self.vision.check_expansion(images[0])
        return [self.vision.num_tokens(p) for p in images]

    def _expand(
        self, ids: list[int], mask: np.ndarray, images: list[str], counts: list[int]
    ) -> tuple[np.ndarray, np.ndarray, tuple[str, ...], tuple[int, ...]]:
        """Each image slot of `ids` repeated to its image's token count, never supervised; the
        row's images are the first n of the conversation's, n its slots."""
        assert self.vision is not None
        token = self.vision.image_token_id
        slots = [i for i, t in enumerate(ids) if t == token]
        out_ids, out_mask, start = [], [], 0
        for slot, count in zip(slots, counts, strict=False):
            out_ids += [ids[start:slot], [token] * count]
            out_mask += [mask[start:slot], np.zeros(count, dtype=np.bool_)]
            start = slot + 1
        out_ids.append(ids[start:])
        out_mask.append(mask[start:])
        n = len(slots)
        full = np.asarray([t for part in out_ids for t in part], dtype=np.int32)
        return full, np.concatenate(out_mask), tuple(images[:n]), tuple(counts[:n])

    def _limit_images(
        self, input_ids: np.ndarray, mask: np.ndarray, images: tuple, counts: tuple
    ) -> Sample | str:
        """`_limit`, except that a cut through or before an image's tokens drops the row."""
        assert self.vision is not None
        image_at = np.flatnonzero(input_ids == self.vision.image_token_id)
        if self.overflow == "truncate" and len(image_at) and image_at[-1] >= self.cutoff_len:
            return IMAGE_OVER_CUTOFF
        row = self._limit(input_ids, mask)
        if isinstance(row, str):
            return row
        return Sample(row.input_ids, row.target_mask, row.truncated, images, counts)

    def _limit(self, input_ids: np.ndarray, mask: np.ndarray) -> Sample | str:
        truncated = len(input_ids) > self.cutoff_len
        sample = Sample(input_ids[: self.cutoff_len], mask[: self.cutoff_len], truncated)
        too_few = sample.num_target_tokens < self.min_target_tokens
        whole_enough = Sample(input_ids, mask).num_target_tokens >= self.min_target_tokens
        if truncated and (self.overflow == "drop" or (too_few and whole_enough)):
            self.note_over_cutoff(len(input_ids))
            return OVER_CUTOFF
        return TOO_FEW_TARGETS if too_few else sample


def _image_content(content: Any) -> Any:
    """`content` split at each `<image>` into text and `{"type": "image"}` items, in order."""
    if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
        return content
    items: list[dict[str, str]] = []
    for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if k:
            items.append({"type": "image"})
        if text:
            items.append({"type": "text", "text": text})
    return items


def _holds(text: str, prompt: str, end: str) -> bool:
    """Whether `text` renders the turn (prompt, end) unchanged, so it can be supervised there."""
    return end.startswith(prompt) and text.startswith(end)
