"""Rendering: a `Conversation` to a `Sample` through the tokenizer's own chat template.

Masks are derived from the template itself, never from per-model knowledge. For every assistant
turn k of the message list (system first, when there is one):

    prompt_k = render(messages[:k], add_generation_prompt=True)
    end_k    = render(messages[:k + 1])
    full     = render(messages)                  (= end_k of the last assistant turn)

Turn k's supervised tokens are tokens(end_k)[len(tokens(prompt_k)):]: the assistant's content and
whatever the template closes the turn with (end-of-turn token, trailing newline). Rendering is
`tokenizer.apply_chat_template(..., tokenize=False)` then `tokenizer(text,
add_special_tokens=False)`, which is exactly what `apply_chat_template(tokenize=True)` does.

Invariants checked per conversation:
- text: prompt_k is a prefix of end_k, and end_k of full. A template that breaks this (it rewrites
  earlier turns, or renders a turn differently once it is not the last) cannot be masked turn by
  turn: ValueError naming the template problem, never a wrong mask.
- tokens: the same prefixes hold for the token ids. When the text holds but the tokenizer merges
  characters across a turn boundary (rare: a reply that starts with whitespace the template's
  header ends with), the sample is dropped as "token_merge_across_turns".
Then `cutoff_len`: the sample is truncated (first tokens kept) or dropped per `overflow`, and
dropped if fewer than `min_target_tokens` supervised tokens remain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from megatrain.data.formats import Conversation
from megatrain.data.sample import Sample

TEMPLATE_ERROR = "template_error"
TOKEN_MERGE = "token_merge_across_turns"
OVER_CUTOFF = "over_cutoff_len"
TOO_FEW_TARGETS = "too_few_target_tokens"


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
    ) -> None:
        assert overflow in ("truncate", "drop"), overflow
        self.tokenizer = tokenizer
        self.chat_template = resolve_chat_template(tokenizer, chat_template)
        self.cutoff_len = cutoff_len
        self.overflow = overflow
        self.train_on_prompt = train_on_prompt
        self.min_target_tokens = min_target_tokens
        self.default_system = default_system

    def messages(self, conv: Conversation) -> list[dict[str, Any]]:
        """The message list handed to the template: the system turn first, when there is one."""
        system = conv.system or self.default_system
        head = [{"role": "system", "content": system}] if system else []
        return head + conv.messages

    def encode(self, conv: Conversation) -> Sample | str:
        """The conversation as a Sample, or the reason it is dropped."""
        messages = self.messages(conv)
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            texts = []
            for k in turns:
                texts += [self._render(messages[:k], conv.tools, True)]
                texts += [self._render(messages[: k + 1], conv.tools, False)]
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"chat template syntax error, line {err.lineno}: {err}") from err
        except jinja2.TemplateError:
            return TEMPLATE_ERROR  # e.g. raise_exception() for roles the template rejects
        full_text = texts[-1]
        for i, k in enumerate(turns):
            gen = f"render(messages[:{k}], add_generation_prompt=True)"
            end = f"render(messages[:{k + 1}])"
            _check_text_prefix(texts[2 * i], texts[2 * i + 1], f"{gen} is not a prefix of {end}")
            whole = f"{end} is not a prefix of the rendering of all {len(messages)} messages"
            _check_text_prefix(texts[2 * i + 1], full_text, whole)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        full = ids[-1]
        mask = np.zeros(len(full), dtype=np.bool_)
        for start_ids, end_ids in zip(ids[0::2], ids[1::2], strict=True):
            if full[: len(start_ids)] != start_ids or full[: len(end_ids)] != end_ids:
                return TOKEN_MERGE
            mask[len(start_ids) : len(end_ids)] = True
        if self.train_on_prompt:
            mask[:] = True
        return self._limit(np.asarray(full, dtype=np.int32), mask)

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=generation,
            tokenize=False,
        )
        assert isinstance(text, str)
        return text

    def _limit(self, input_ids: np.ndarray, mask: np.ndarray) -> Sample | str:
        truncated = len(input_ids) > self.cutoff_len
        if truncated and self.overflow == "drop":
            return OVER_CUTOFF
        sample = Sample(input_ids[: self.cutoff_len], mask[: self.cutoff_len], truncated)
        if sample.num_target_tokens < self.min_target_tokens:
            return TOO_FEW_TARGETS
        return sample


def _check_text_prefix(prefix: str, text: str, problem: str) -> None:
    if text.startswith(prefix):
        return
    at = next((i for i, (a, b) in enumerate(zip(prefix, text, strict=False)) if a != b), len(text))
    raise ValueError(
        f"chat template is not prefix-stable: {problem} (they differ at character {at}: "
        f"{prefix[at : at + 40]!r} vs {text[at : at + 40]!r}). The template renders a turn "
        "differently depending on what follows it (e.g. it strips reasoning from past replies, or "
        "its generation prompt differs from its assistant header), so assistant tokens cannot be "
        "masked turn by turn; set data.chat_template to a template that renders each turn the "
        "same way whatever follows"
    )
