"""`DataConfig`: every option of the data pipeline, the `data:` section of a run's YAML.

Only the recipe (trainer, `megatrain data` command) reads this class; the pipeline's parts take
plain keyword arguments. Field types stay simple (str, int, float, bool, list[str], optional of
those) so the config system can map each field to a `--data.<field>` override.

Invariant: `validate()` accepts exactly the configurations the pipeline can run, and every error
names the key as `data.<field>`, the offending value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERFLOW_CHOICES = ("truncate", "drop")
MULTI_TURN_CHOICES = ("per_turn", "final")
STAGES = ("sft", "pt", "dpo", "kto")
PREFERENCE_STAGES = ("dpo", "kto")
# Options that shape conversations: under stage pt (raw text) each must keep its default.
# (`packing` is not one: pt rows are always full, so either value means the same there.)
SFT_ONLY_DEFAULTS: dict[str, object] = {
    "chat_template": None,
    "overflow": "truncate",
    "train_on_prompt": False,
    "system_prompt": None,
    "min_target_tokens": 1,
}


@dataclass(frozen=True)
class DataConfig:
    stage: str = "sft"
    """"sft": conversations (alpaca / sharegpt / OpenAI) through the chat template, assistant turns
    supervised. "pt": continued pre-training on raw text, as LLaMA-Factory's `stage: pt`: one
    document per row of a text column (`columns: {prompt: <column>}`, default `text`) or per line
    of a .txt file, no template, every token supervised, an eos token after each document, the
    documents concatenated and cut into rows of exactly `seq_len` tokens. "dpo": preference pairs
    (registry `ranking: true`, columns chosen and rejected), the two rows of a pair in one
    micro-batch, only the completions supervised. "kto": prompt + completion rows labelled
    desirable or not (a `kto_tag` column). dpo/kto: the prompt is kept whole and completions are
    cut to `cutoff_len` (docs/preference.md)."""

    dataset: str | list[str] = "demo"
    """Names registered in `dataset_dir/dataset_info.json`, or paths to data files/folders (format
    detected from the first row). Several: a list or a comma-separated string, concatenated."""

    dataset_dir: str | None = None
    """Folder holding `dataset_info.json`; relative `file_name`s resolve against it.
    None: the built-in demo assets (`megatrain/assets/demo`)."""

    eval_dataset: str | list[str] | None = None
    """Evaluation data, named like `dataset`. Exclusive with `val_size`."""

    val_size: float = 0.0
    """Split off the processed train set for evaluation: 0 < v < 1 is a fraction, a whole number
    >= 1 a sample count, 0 none. The split is a seeded (`seed`) random draw."""

    chat_template: str | None = None
    """Jinja chat template (the text, or a path to a .jinja file) replacing the tokenizer's own.
    None: the tokenizer's `chat_template`."""

    multi_turn: str = "per_turn"
    """Multi-turn data with a template that rewrites earlier turns (Qwen3, gpt-oss, DeepSeek-R1
    drop past reasoning): "per_turn" trains every assistant turn as rendered when the
    conversation ends at it (a row per turn where renderings differ), "final" one row, the whole
    conversation as rendered at its end (earlier turns supervised only where rendered unchanged).
    Prefix-stable templates give the same single row either way. See docs/chat_templates.md."""

    cutoff_len: int = 1024
    """Maximum tokens per sample after the chat template; longer samples follow `overflow`."""

    overflow: str = "truncate"
    """Samples over `cutoff_len`: "truncate" keeps the first `cutoff_len` tokens, "drop" drops
    them. Both are counted in the data statistics."""

    packing: bool = False
    """Pack several samples into each row of exactly `seq_len` tokens (attention stays within a
    sample through restarting position ids); False pads each micro-batch to its longest sample.
    Stage pt: no effect, its rows are always full (see `neat_packing`), so an sft config's
    `packing: true` can be kept."""

    pad_to_multiple_of: int = 8
    """Padded batches only: round the padded length up to a multiple of this (1 = no rounding)."""

    train_on_prompt: bool = False
    """Supervise every token (system, user and template tokens too), not only assistant turns."""

    system_prompt: str | None = None
    """System message for conversations that have none. None: leave them without one."""

    max_samples: int | None = None
    """Keep only the first `max_samples` rows of each data set (before conversion). None: all."""

    min_target_tokens: int = 1
    """Drop samples with fewer supervised (loss-bearing) tokens than this, after truncation."""

    shuffle: bool = True
    """Shuffle the training samples (or packed rows) every epoch."""

    seed: int = 42
    """Seed of the shuffle (mixed with the epoch number), of `val_size` and of `num_samples`."""

    neat_packing: bool = False
    """Stage pt: restart attention and position ids at every document boundary inside a row (no
    attention across documents; the first token of a document is not a target). False: rows are
    plain causal windows over the concatenated documents, as LLaMA-Factory's pt stage."""

    cache_dir: str | None = None
    """Stage pt: folder of the tokenized-corpus cache (one entry per data file, keyed on its path,
    size and mtime, the tokenizer and the settings). None: `$MEGATRAIN_CACHE`, else
    `~/.cache/megatrain`."""

    image_max_pixels: int = 768 * 768
    """Images with more pixels (width x height) are scaled down to this, aspect kept, before the
    model's image processor sees them (LLaMA-Factory's `image_max_pixels`): fewer image tokens,
    less memory. Applies to the token count and the pixels alike."""

    image_min_pixels: int = 32 * 32
    """Images with fewer pixels are scaled up to this (LLaMA-Factory's `image_min_pixels`)."""

    def layout(self) -> str:
        """The row layout the loader produces, as the resource estimate names it: "padded",
        "packed" (position ids restart inside rows) or "full" (plain causal rows)."""
        if self.stage == "pt":
            return "packed" if self.neat_packing else "full"
        return "packed" if self.packing else "padded"

    def dataset_names(self) -> list[str]:
        """`dataset` as a list: a comma-separated string is split, blanks removed."""
        return _names(self.dataset)

    def eval_dataset_names(self) -> list[str]:
        return [] if self.eval_dataset is None else _names(self.eval_dataset)

    def validate(self) -> None:
        """Raise ValueError naming `data.<field>`, the bad value and what is allowed."""
        if self.stage not in STAGES:
            raise ValueError(
                f"data.stage={self.stage!r} must be one of {list(STAGES)} (sft: conversations, "
                "pt: continued pre-training on raw text, dpo: preference pairs, kto: labelled "
                "completions)"
            )
        for name in ("dataset", "eval_dataset"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, str)
                or (isinstance(value, list) and all(isinstance(v, str) for v in value))
            ):
                raise ValueError(f"data.{name}={value!r} must be a string or a list of strings")
        if not self.dataset_names():
            raise ValueError(
                f"data.dataset={self.dataset!r} names no data set; give a name from "
                "dataset_info.json or a path to a .json/.jsonl/.parquet/.csv/.txt file or a folder"
            )
        _check_int("cutoff_len", self.cutoff_len, minimum=2)
        _check_int("pad_to_multiple_of", self.pad_to_multiple_of, minimum=1)
        _check_int("min_target_tokens", self.min_target_tokens, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        _check_int("image_max_pixels", self.image_max_pixels, minimum=1)
        _check_int("image_min_pixels", self.image_min_pixels, minimum=1)
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(
                f"data.image_min_pixels={self.image_min_pixels} is more than "
                f"data.image_max_pixels={self.image_max_pixels}; set min <= max"
            )
        if self.max_samples is not None:
            _check_int("max_samples", self.max_samples, minimum=1)
        if self.multi_turn not in MULTI_TURN_CHOICES:
            allowed = list(MULTI_TURN_CHOICES)
            raise ValueError(f"data.multi_turn={self.multi_turn!r} must be one of {allowed}")
        if self.overflow not in OVERFLOW_CHOICES:
            allowed = list(OVERFLOW_CHOICES)
            raise ValueError(f"data.overflow={self.overflow!r} must be one of {allowed}")
        for name in ("packing", "train_on_prompt", "shuffle", "neat_packing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"data.{name}={getattr(self, name)!r} must be true or false")
        self._validate_stage_options()
        self._validate_val_size()

    def _validate_stage_options(self) -> None:
        if self.stage != "pt" and self.neat_packing:
            raise ValueError(
                f"data.neat_packing=True applies to data.stage: pt, not {self.stage}; under sft, "
                "packing: true already keeps attention within each sample"
            )
        if self.stage in PREFERENCE_STAGES:
            for name in ("packing", "train_on_prompt"):
                if getattr(self, name):
                    raise ValueError(
                        f"data.{name}=True does not apply to data.stage: {self.stage} (padded "
                        "rows, only the completions supervised); remove it"
                    )
        if self.stage != "pt":
            return
        for name, default in SFT_ONLY_DEFAULTS.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"data.{name}={getattr(self, name)!r} shapes conversations and does not apply "
                    "to data.stage: pt (raw text, every token supervised); remove it"
                )

    def _validate_val_size(self) -> None:
        v = self.val_size
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(
                f"data.val_size={v!r} must be 0 (none), a fraction 0 < v < 1, or a count >= 1"
            )
        if v >= 1 and v != int(v):
            raise ValueError(
                f"data.val_size={v!r}: values >= 1 are a sample count and must be whole; "
                "use 0 < v < 1 for a fraction"
            )
        if v > 0 and self.eval_dataset_names():
            raise ValueError(
                f"data.val_size={v!r} and data.eval_dataset={self.eval_dataset!r} both define the "
                "evaluation set; set one of them (val_size: 0 to use eval_dataset)"
            )


def _names(value: str | list[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item.strip()]


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"data.{name}={value!r} must be an integer >= {minimum}")
