"""`megatrain verify`: the engine against plain PyTorch training, step by step.

Both sides start from the same weights and see the same micro-batches (random tokens, one
padded row per micro-batch, or packed rows). The reference is the plain HF model with
`torch.optim.AdamW` and `clip_grad_norm_`, the step's loss being the sum of cross-entropy over
the step's supervised tokens divided by their count (+ the router aux loss HF's forward adds,
averaged over micro-batches).

Reported per step: losses, and the largest relative difference (||a - b|| / ||b|| per tensor,
max over tensors) between engine and fp32 PyTorch of the loss, the gradients (before clipping)
and the weights (after the update).

Each step is judged on its own arithmetic: before every step after the first, every reference
takes the engine's weights and AdamW states (Reference.start_from). Otherwise a difference well
within tolerance after one step (4e-6 in a weight) is amplified by the next step's
ill-conditioned gradients (a linear-attention decay's: 7e-4) by an amount that depends on which
CPU's kernels rounded it, and the verdict would judge the CPU, not the engine.

Pass/fail ("excess" <= 1) judges the engine's error against a more exact target, allowing
max(tolerance, 10 x the error plain PyTorch makes at the same precision):
- fp32 compute: target = the same training in float64; noise = PyTorch fp32. Some gradients
  are ill-conditioned (sums that nearly cancel, e.g. a linear-attention decay) and no fp32
  computation, PyTorch's own included, gets them within 1e-5; everything else must be.
- bf16 compute: target = PyTorch fp32; noise = PyTorch training the same way the engine does:
  the model in bf16 (weights, activations, residual stream), gradients copied to fp32 master
  weights, fp32 AdamW (the DeepSpeed / Megatron bf16 recipe). The engine's bf16 run must stay
  within 10x of the drift PyTorch's own bf16 training shows on the same model and data.
  In bf16 the errors are measured over the whole model (all gradients, all weights as one
  vector), not per tensor: a gradient element near zero flips sign under bf16 rounding, which
  moves that weight by 2 x lr, and in a 16-element zero-initialised norm weight one such flip is
  a 50% relative error, in PyTorch's bf16 run as much as in ours.

Like is compared with like:
- Dropout and router jitter are turned off on every side: two implementations that draw their
  random numbers in a different order (the engine runs layer-major, PyTorch micro-batch-major)
  apply different masks, and no tolerance can compare them. That the engine's backward uses the
  masks of its own forward is proven by tests/engine/test_engine_dropout.py.
- MoE routing (fp32 compute): a top-k choice whose runner-up is within rounding of the last
  expert kept is decided by rounding, differently in float64, fp32 and the engine. The data is
  drawn (seed after seed) so that every routing decision of the float64 run keeps a relative
  margin of at least MIN_ROUTING_MARGIN; the margin reached is reported.
"""

from megatrain.verify.judge import (
    MIN_ROUTING_MARGIN,
    NOISE_FACTOR,
    TOLERANCES,
    StepReport,
    format_report,
    within,
)
from megatrain.verify.run import SHORTHANDS, VERIFY_BASE, make_batches, run_verify, verify_config

__all__ = [
    "MIN_ROUTING_MARGIN",
    "NOISE_FACTOR",
    "SHORTHANDS",
    "TOLERANCES",
    "VERIFY_BASE",
    "StepReport",
    "format_report",
    "make_batches",
    "run_verify",
    "verify_config",
    "within",
]
