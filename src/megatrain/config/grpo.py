"""The `grpo:` section: GRPO rollouts, rewards and objective (read by `megatrain grpo` only).

Names and defaults follow TRL's GRPOConfig wherever the meaning is the same, so a TRL user can
move a config over; `prompts_per_step` replaces TRL's batch-size arithmetic (one optimizer step
trains on prompts_per_step x num_generations completions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatrain.choices import ROLLOUT_WEIGHTS
from megatrain.config.types import check_choice, check_int, check_number, check_types

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
GENERATION = ("auto", "resident", "streamed")
COMPILE_DECODE = ("auto", True, False, "graphs")
IMPORTANCE_SAMPLING = ("auto", True, False)


@dataclass(frozen=True)
class GRPOConfig:
    num_generations: int = 8
    """Completions sampled per prompt (the group whose rewards are normalised together), >= 2."""
    prompts_per_step: int = 2
    """Prompts per generation batch; each optimizer step trains on their num_generations
    completions each, in micro-batches of training.micro_batch_size rows ("auto", the default
    of megatrain grpo: the plan's, a divisor of prompts_per_step x num_generations). Under
    torchrun a multiple of the number of processes: each rank takes its share of the prompts."""
    max_prompt_length: int | None = 512
    """Prompt tokens kept after the chat template (the last ones: left truncation); None: all."""
    max_completion_length: int = 256
    """Most tokens generated per completion (the end-of-sequence token counts)."""
    min_completion_length: int = 0
    """End-of-sequence held back until a completion has this many tokens (transformers'
    min_new_tokens, vLLM's min_tokens); 0: none. max_completion_length generates every
    completion at full length (a fixed cost per step: benchmarks)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs of the loss use the same temperature, as TRL does."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1: all."""
    beta: float = 0.0
    """KL coefficient (k3 estimator) to the reference model, the initial weights; 0: no
    reference is kept (saves its bf16 copy in host memory and a log-prob pass per step)."""
    epsilon: float = 0.2
    """Lower clipping range of the probability ratio: clip(r, 1 - epsilon, 1 + epsilon_high)."""
    epsilon_high: float | None = None
    """Upper clipping range; None: epsilon (DAPO recommends 0.28)."""
    loss_type: str = "dapo"
    """Normalisation of the token losses: "grpo" (mean of per-sequence means), "dr_grpo" (sum /
    (sequences x max_completion_length)) or "dapo" (sum / completion tokens of the step)."""
    scale_rewards: str | bool = "group"
    """Divide advantages by the reward std: "group" (per prompt; true), "batch" (over the
    generation batch) or "none" (false; Dr. GRPO's advice)."""
    num_iterations: int = 1
    """Optimizer steps per generation batch (mu); > 1 keeps the batch's old log-probs."""
    reward_funcs: tuple[str, ...] = ("math_answer",)
    """Rewards, summed with reward_weights: built-ins "math_answer" (the final answer, from
    \\boxed{} or the last number, equals the `answer` column), "exact_answer" (the stripped
    completion equals `answer`), "answer_similarity" (partial credit in [0, 1]: their similarity
    ratio), "format" (format_pattern matches), or your own as
    "path/to/file.py:function" or "package.module:function" (docs/grpo.md)."""
    reward_weights: tuple[float, ...] | None = None
    """One weight per reward function; None: all 1."""
    format_pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    """Regular expression (DOTALL) the built-in "format" reward checks the completion against."""
    generation: str = "auto"
    """Where rollouts run: "resident" (the whole model copied to the GPU once per generation
    batch), "streamed" (decoder layers copied in one by one, every decoding step: any size,
    slow) or "auto" (resident when the rollout estimate, weights + KV cache, fits in the GPU
    memory free beside the engine with memory.gpu_margin_gib to spare; always on the CPU)."""
    compile_decode: str | bool = "auto"
    """How resident rollouts decode. true: a static KV cache of max_prompt_length +
    max_completion_length tokens, the model's forward compiled with torch.compile (once per
    run) and each decoding step replayed as one CUDA graph (captured per generation batch);
    "graphs": the same with the eager kernels (nothing compiled); false: transformers'
    generate; "auto": true on CUDA for the models it takes (no experts; full or linear
    attention, as Qwen3.5's hybrid layers; sdpa or eager), generate otherwise. On the CPU,
    true and "graphs" run the same steps without graphs."""
    rollout_weights: str = "auto"
    """How a resident rollout keeps the decoder layers' linear weights on the GPU: "bf16" (the
    compute dtype), "fp8" (float8 e4m3 with a scale per output channel, multiplied on the fp8
    tensor cores of CUDA devices of compute capability >= 8.9) or "int8" (weight-only, a scale
    per output channel, dequantized per call); embedding, norms and head stay in the compute
    dtype. "auto": bf16 when its resident rollout fits beside the engine, else fp8 (capability
    >= 8.9) or int8 when that fits, else the streamed path (docs/grpo.md)."""
    importance_sampling_correction: str | bool = "auto"
    """Truncated importance sampling between the rollout's and the trainer's precisions: each
    completion token's loss is weighted by min(exp(trainer old log-prob - rollout log-prob),
    importance_sampling_cap), as TRL's vllm_importance_sampling_correction (token_truncate).
    "auto": on when the rollout's weights are compact (int8, fp8); true: always; false: never."""
    importance_sampling_cap: float = 2.0
    """Upper bound of the truncated importance weight (TRL's first TIS default, C = 2)."""
    seed: int = 42
    """Seed of the prompt order and of sampling (a checkpoint resumes both exactly)."""

    def validate(self) -> None:
        check_types("grpo", self)
        check_int("grpo.num_generations", self.num_generations, minimum=2)
        check_int("grpo.prompts_per_step", self.prompts_per_step, minimum=1)
        check_int("grpo.max_prompt_length", self.max_prompt_length, minimum=1, optional=True)
        check_int("grpo.max_completion_length", self.max_completion_length, minimum=1)
        check_int("grpo.min_completion_length", self.min_completion_length, minimum=0)
        if self.min_completion_length > self.max_completion_length:
            raise ValueError(
                f"grpo.min_completion_length={self.min_completion_length} is above "
                f"grpo.max_completion_length={self.max_completion_length}: completions cannot "
                "be longer than the maximum; lower it (0: no minimum)"
            )
        check_number("grpo.temperature", self.temperature, low=0.0, low_open=True)
        check_number("grpo.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_number("grpo.beta", self.beta, low=0.0)
        check_number("grpo.epsilon", self.epsilon, low=0.0, high=1.0)
        if self.epsilon_high is not None:
            check_number("grpo.epsilon_high", self.epsilon_high, low=0.0)
        check_choice("grpo.loss_type", self.loss_type, LOSS_TYPES)
        if isinstance(self.scale_rewards, str):
            check_choice("grpo.scale_rewards", self.scale_rewards, SCALE_REWARDS)
        check_int("grpo.num_iterations", self.num_iterations, minimum=1)
        check_choice("grpo.generation", self.generation, GENERATION)
        if isinstance(self.compile_decode, str):
            check_choice("grpo.compile_decode", self.compile_decode, COMPILE_DECODE)
        check_choice("grpo.rollout_weights", self.rollout_weights, ROLLOUT_WEIGHTS)
        if isinstance(self.importance_sampling_correction, str):
            check_choice(
                "grpo.importance_sampling_correction",
                self.importance_sampling_correction,
                IMPORTANCE_SAMPLING,
            )
        check_number("grpo.importance_sampling_cap", self.importance_sampling_cap, low=1.0)
        check_int("grpo.seed", self.seed, minimum=0)
        if not self.reward_funcs:
            raise ValueError(
                "grpo.reward_funcs is empty; name at least one reward, e.g. [math_answer] or "
                "[my_rewards.py:score]"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"grpo.reward_weights={list(self.reward_weights)} has {len(self.reward_weights)} "
                f"weights but grpo.reward_funcs={list(self.reward_funcs)} has "
                f"{len(self.reward_funcs)} functions; give one weight per function, or null"
            )
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            raise ValueError(
                f"grpo.format_pattern={self.format_pattern!r} is not a valid regular "
                f"expression ({e})"
            ) from e

    @property
    def upper_epsilon(self) -> float:
        """The upper clipping range: epsilon_high, or epsilon when that is None."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def reward_scaling(self) -> str:
        """scale_rewards as one of SCALE_REWARDS (TRL's booleans mapped: true "group")."""
        if isinstance(self.scale_rewards, bool):
            return "group" if self.scale_rewards else "none"
        return self.scale_rewards

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per reward function (all 1 when reward_weights is None)."""
        return self.reward_weights or (1.0,) * len(self.reward_funcs)
