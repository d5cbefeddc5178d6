"""Preference training (DPO and its variants, ORPO/SimPO without a reference, KTO).

loss.py        TRL's preference losses of per-row sequence log-probs, and TRL's metric names
objective.py   the loss as an engine `TokenObjective`: a log-prob pass, d loss / d logp per
               token, then the weighted backward through the chunked head
"""
