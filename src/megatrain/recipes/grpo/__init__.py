"""GRPO: reinforcement learning with verifiable rewards, full parameters, through the engine.

recipe.py      GRPOTrainer: the only GRPO module that reads the config (megatrain grpo)
checkpoint.py  the KL reference in checkpoints and the disk check (a mixin of GRPOTrainer)
prompts.py     prompt data through the data registry, rendered with the chat template
rewards.py     built-in and user reward functions (TRL's signature), checked calls
advantages.py  group-normalised advantages (TRL's scale_rewards)
rollout.py     sampling with the current weights: a device copy of the model + generate
sequences.py   prompt + completion token lists -> engine micro-batches, per-token inputs
loss.py        the clipped surrogate + k3 KL per token, TRL's loss_type normalisations
ranks.py       under torchrun: each rank's prompt groups, what is gathered and summed over ranks
plan.py        the rollout phase and the log-prob passes beside the training plan
decode.py      static decoding (static KV cache, compiled forward, CUDA graphs)
decode_support.py  the models static decoding serves, and the attention it runs them with
phase_memory.py  each phase's GPU memory, for the metrics
"""
