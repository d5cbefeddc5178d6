"""The `checkpoint:` section: when a run saves resumable checkpoints, how many it keeps, where
it resumes from, and its Hugging Face export (docs/checkpoints.md)."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config.types import check_choice, check_int, check_types
from megatrain.dtypes import DTYPE_NAMES as DTYPES


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 0
    """Optimizer steps between resumable checkpoints; 0: only at the end."""
    keep_last: int = 2
    """Checkpoints kept in output_dir/checkpoints (older ones deleted), >= 1."""
    resume_from: str | None = None
    """A checkpoint directory, or "auto": the latest in output_dir/checkpoints (none: fresh)."""
    export_hf: bool = True
    """Write a Hugging Face model folder (safetensors + config + tokenizer) at the end."""
    export_dtype: str = "bf16"
    """Dtype of the exported weights: "bf16" or "fp32"."""
    save_final: bool = True
    """Write a resumable checkpoint at the end of the run (12 bytes per parameter with fp32
    AdamW states, 8 with bf16, about 6 with int8, about 5 with int4; 2 less with a bf16
    master). False: only the Hugging Face export (2 bytes per parameter in bf16) keeps the
    trained weights."""

    def validate(self) -> None:
        check_types("checkpoint", self)
        check_int("checkpoint.save_every", self.save_every, minimum=0)
        check_int("checkpoint.keep_last", self.keep_last, minimum=1)
        if self.resume_from == "":
            raise ValueError(
                "checkpoint.resume_from='' is empty; give a checkpoint directory, 'auto', or null"
            )
        check_choice("checkpoint.export_dtype", self.export_dtype, DTYPES)
        if not (self.save_final or self.export_hf or self.save_every):
            raise ValueError(
                "checkpoint.save_final: false with checkpoint.export_hf: false and "
                "checkpoint.save_every: 0 would save nothing: the trained weights would be lost; "
                "set export_hf: true (the Hugging Face model) or save_final: true"
            )
