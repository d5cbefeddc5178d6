"""Choice lists of settings that several layers check (defined once; no torch import).

The config validates a user's value against them (config/), the store and the planner rely on
them (store/states.py, planning/long_context.py, recipes/grpo/plan.py). The row layouts have
their own module (layouts.py).
"""

STATE_DTYPES = ("fp32", "bf16", "int8", "int4")
"""optimizer.state_dtype: how AdamW's m and v are kept (store/states.py)."""

TIER_STATE_DTYPES = ("fp32", "bf16", "int8")
"""The state dtypes the GPU tier keeps (engine/tier.py): updated on the device by torch's AdamW
(fp32) or, in their stored format, by the fused kernel of optim/triton_adamw.py (bf16, int8:
bit for bit the C kernel). int4 stays off the tier."""

MASTER_DTYPES = ("fp32", "bf16")
"""optimizer.master_dtype: how the master weights are kept (store/master.py)."""

ROLLOUT_WEIGHTS = ("auto", "bf16", "int8", "fp8")
"""grpo.rollout_weights: how the resident rollout keeps the decoder layers' linear weights on the
GPU (model/quant_linear.py; "bf16": the compute dtype, whatever it is; recipes/grpo/plan.py
resolves "auto")."""

GRAD_DTYPES = ("bf16", "int8")
"""optimizer.grad_dtype: how a bf16 master's gradients wait for their update (store/grads.py)."""

STAGING_SET_CHOICES = (1, 2)
"""optimizer.gpu_update_sets: the device staging sets the GPU update share takes in turn
(EnginePlan.share_sets; "auto": the planner's shorter predicted step, planning/gpu_share.py).
A set takes a block once its previous block's copies back are done: with one, each block's
states go up only after the previous block's came back; with two, one block's go up while the
previous one's come back (the link's two directions at once), for a second set of staging
memory on the GPU (engine/gpu_share.py, "Staging sets")."""

OFFLOAD_CHOICES = ("auto", "on", "off")
"""memory.activation_offload: whether layer inputs wait in host memory
(planning/long_context.py)."""

SINK_ATTENTION = "megatrain_sinks"
"""model.attn_implementation: attention with learned sinks (GPT-OSS's `s_aux`) on sdpa's fused
kernels (model/sink_attention.py); the default where transformers would run such a model eager.
No "sdpa" in the name: transformers checks a name containing it against the model's sdpa
support (`_supports_sdpa`, False for GPT-OSS) and refuses it."""
