"""GRPO: reinforcement learning with verifiable rewards, full parameters, through the engine.

loss.py       the clipped surrogate + k3 KL per token, TRL's loss_type normalisations
sequences.py  prompt + completion token lists -> engine micro-batches and per-token inputs
"""
