"""Preference training (DPO and its variants, ORPO/SimPO without a reference, KTO).

loss.py        TRL's preference losses of per-row sequence log-probs, and TRL's metric names
objective.py   the loss as an engine `TokenObjective`: a log-prob pass, d loss / d logp per
               token, then the weighted backward through the chunked head
reference.py   the reference log-probs of every pair, precomputed once
steps.py       the pairs of each optimizer step (this rank's micro-batches) and their totals
eval.py        the loss and metrics over the eval pairs
recipe.py      DPOTrainer: `megatrain dpo` on the recipe base (the only module reading config)
"""
