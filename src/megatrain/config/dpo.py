"""The `dpo:` section: the preference loss (read by the DPO recipe only; data.stage dpo / kto).

Names and defaults follow TRL's DPOConfig / CPOConfig / KTOConfig where the meaning is the same,
so a TRL config moves over; LLaMA-Factory's `pref_beta`, `pref_loss`, `pref_ftx`, `simpo_gamma`,
`dpo_label_smoothing`, `kto_chosen_weight` and `kto_rejected_weight` are `beta`, `loss_type`,
`rpo_alpha`, `simpo_gamma`, `label_smoothing`, `desirable_weight` and `undesirable_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config.types import check_choice, check_number, check_types

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "orpo", "simpo", "kto")
REFERENCES = ("precomputed", "weights")


@dataclass(frozen=True)
class DPOConfig:
    loss_type: str = "sigmoid"
    """"sigmoid" (DPO), "ipo", "hinge", "robust" (label-noise robust DPO) need the reference
    log-probs; "orpo" and "simpo" are reference-free (no reference pass); "kto" trains on
    data.stage: kto rows. Formulas: docs/preference.md, recipes/dpo/loss.py."""

    reference: str = "precomputed"
    """Where the reference log-probs of a reference loss come from. "precomputed": one streamed
    pass of the initial weights over every pair before step 1 (TRL's precompute_ref_log_probs),
    a table of 8 bytes per pair kept on the host and in each checkpoint. "weights": a copy of the
    initial weights in host RAM (2 bytes per parameter in bf16 compute, 4 in fp32; saved with
    each checkpoint, as GRPO's KL reference; under torchrun each rank keeps and saves its own
    shards) and one forward-only pass of them per step, on the step's own micro-batches. Both
    give the same losses; "weights" avoids the up-front pass on a large data set at the price
    of a forward per step. Unused by orpo and simpo."""

    beta: float = 0.1
    """Strength of the preference term (TRL's beta; LLaMA-Factory's pref_beta); ORPO's lambda."""

    label_smoothing: float = 0.0
    """Probability that a pair's preference is flipped (sigmoid, robust, simpo), 0 <= ls < 0.5."""

    rpo_alpha: float = 0.0
    """Weight of the chosen completions' NLL (mean over their tokens) added to the loss: TRL's
    rpo_alpha (DPO) / cpo_alpha (SimPO), LLaMA-Factory's pref_ftx; 0: none. ORPO always adds it
    with weight 1, as ORPO defines it."""

    simpo_gamma: float = 0.5
    """SimPO's target reward margin (gamma; the loss uses gamma / beta)."""

    desirable_weight: float = 1.0
    """KTO: weight of the desirable rows' losses."""

    undesirable_weight: float = 1.0
    """KTO: weight of the undesirable rows' losses."""

    def validate(self) -> None:
        check_types("dpo", self)
        check_choice("dpo.loss_type", self.loss_type, LOSS_TYPES)
        check_choice("dpo.reference", self.reference, REFERENCES)
        check_number("dpo.beta", self.beta, low=0.0, low_open=True)
        check_number("dpo.label_smoothing", self.label_smoothing, low=0.0, high=0.5, high_open=True)
        for name in ("rpo_alpha", "simpo_gamma", "desirable_weight", "undesirable_weight"):
            check_number(f"dpo.{name}", getattr(self, name), low=0.0)


def check_preference_run(stage: str, micro_batch_size: int | str) -> None:
    """Refuse what `megatrain dpo` cannot run (before anything loads): data that are not
    preference data, and micro-batches that would split a pair."""
    if stage not in ("dpo", "kto"):
        raise ValueError(
            f"data.stage={stage!r}: megatrain dpo trains preference data; set data.stage: dpo "
            "(pairs: a dataset_info.json entry with ranking: true and chosen/rejected columns) "
            "or kto (rows with a kto_tag label, with dpo.loss_type: kto); sft and pt data train "
            "with megatrain train"
        )
    if isinstance(micro_batch_size, int) and (micro_batch_size < 2 or micro_batch_size % 2):
        raise ValueError(
            f"training.micro_batch_size={micro_batch_size} rows: megatrain dpo puts a pair's two "
            "rows (chosen and rejected; KTO: a row and its KL row) in one micro-batch, so it "
            f"must be even and >= 2; set {max(2, micro_batch_size + micro_batch_size % 2)}"
        )
