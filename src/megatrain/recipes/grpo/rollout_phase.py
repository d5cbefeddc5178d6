"""The rollout phase of a GRPO step: sampling a generation batch with the current weights.

A mixin of GRPOTrainer (recipes/grpo/recipe.py), which owns every attribute declared below; it
is split out only to keep each file readable. Each generation batch plans its rollout against
the GPU memory free now (recipes/grpo/plan.py `grpo_plan`: resident or streamed, the weights'
format), builds the device model from the store while the last step's updates finish block by
block (recipes/grpo/rollout.py `device_model`), and samples on the static path or with
transformers' generate.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatrain.config import TrainConfig
from megatrain.distributed import any_rank, rank_sums
from megatrain.engine.engine import StreamingEngine
from megatrain.model.structure import ModelStructure
from megatrain.planning.hardware import gib
from megatrain.recipes.builder import RunBuilder
from megatrain.recipes.grpo.decode import static_generate
from megatrain.recipes.grpo.phase_memory import PhasePeak
from megatrain.recipes.grpo.plan import GRPOPlan, grpo_plan
from megatrain.recipes.grpo.prompts import Prompt
from megatrain.recipes.grpo.ranks import rollout_seed
from megatrain.recipes.grpo.rollout import Rollout, device_model, generate
from megatrain.recipes.grpo.rollout_weights import COMPUTE
from megatrain.store.host import HostStore


class RolloutPhase:
    # Owned and set up by GRPOTrainer (recipes/grpo/recipe.py) and its base Recipe.
    cfg: TrainConfig
    builder: RunBuilder
    engine: StreamingEngine
    structure: ModelStructure
    store: HostStore
    plan: GRPOPlan  # the start's
    decode: str
    pad_id: int
    eos_ids: list[int]
    min_completion_tokens: int
    rank: int
    world: int
    told: bool  # a rollout path other than the plan's was printed

    def _rollout(
        self, prompts: list[Prompt], index: int
    ) -> tuple[Rollout, dict[str, Any], float | None]:
        """Completions of `prompts` sampled with the current weights, the rollout's timing and
        memory record, and the TIS cap its weights' format asks for (plan.py)."""
        g, b = self.cfg.grpo, self.builder
        t0 = time.perf_counter()
        plan = self._rollout_plan()
        streamed, weights = plan.rollout.streamed, plan.rollout.weights
        peak = PhasePeak(b.device)
        waited = 0.0

        def ready(block: Any) -> None:  # the last step's update of the block applied
            nonlocal waited
            waited += self.engine.wait_update(block)

        with device_model(
            self.structure,
            self.store,
            b.device,
            streamed=streamed,
            num_slots=self.cfg.memory.num_slots,
            compact=None if weights == COMPUTE else weights,
            ready=ready,
            resident=self.engine.tier_weights,
        ) as model:
            built_s = time.perf_counter() - t0
            static: dict[str, Any] = {}  # the static path's KV cache, sized as the plan sizes it
            if self.decode != "generate" and not streamed:
                prompt = g.max_prompt_length or max(len(p.prompt_ids) for p in prompts)
                static["cache_len"] = prompt + g.max_completion_length
                static["compile_forward"] = self.decode == "compiled"
            rollout = (static_generate if static else generate)(
                model,
                [p.prompt_ids for p in prompts],
                max_new_tokens=g.max_completion_length,
                pad_token_id=self.pad_id,
                eos_token_ids=self.eos_ids,
                do_sample=True,
                temperature=g.temperature,
                top_p=g.top_p,
                seed=rollout_seed(g.seed, index, self.rank, self.world),
                min_new_tokens=self.min_completion_tokens,
                logprobs=plan.importance_cap is not None,
                **static,
            )
        gen_s = time.perf_counter() - t0
        (generated,) = rank_sums([float(rollout.generated_tokens)])  # every rank's, together
        record: dict[str, Any] = {
            "time/generation_s": round(gen_s, 4),
            # of which: waiting for the last step's updates, and the rollout model's build
            # (its weight copies, overlapping those waits block by block)
            "time/rollout_update_wait_s": round(waited, 4),
            "time/rollout_weights_s": round(built_s, 4),
            "generation_tokens_per_s": round(generated / max(gen_s, 1e-9), 1),
            "rollout_streamed": int(streamed),
            "rollout_compact": int(weights != COMPUTE),
        }
        record.update(peak.record("rollout"))
        if rollout.decode_steps:  # the static path times its phases (recipes/grpo/decode.py)
            record["time/prefill_capture_s"] = round(rollout.prefill_s, 4)
            record["time/decode_step_ms"] = round(1e3 * rollout.decode_s / rollout.decode_steps, 3)
        return rollout, record, plan.importance_cap

    def _rollout_plan(self) -> GRPOPlan:
        """The plan for the memory free now (recipes/grpo/plan.py): path and weights. The training
        phase's activations stay cached by PyTorch's allocator, which the device does not count
        as free: they are handed back first (run 20's second step saw only that as free and
        generated on the streamed path, some 0.5 s per token). Under several ranks the streamed
        path does not run: a rank short of memory stops every rank (the plan refused it at the
        start, so only memory taken since then gets here)."""
        device = self.builder.device
        free = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        plan = grpo_plan(self.builder, free_gpu_bytes=free)
        if self.world > 1 and any_rank(plan.rollout.streamed):  # sync point
            raise RuntimeError(
                f"a rank's GPU has too little free memory for the resident rollout now "
                f"({plan.reason}) and streamed generation does not run under torchrun: lower "
                "grpo.prompts_per_step, grpo.num_generations or grpo.max_completion_length, "
                "or raise memory.gpu_margin_gib (the engine's plan then leaves more room), and "
                "resume from the last checkpoint"
            )
        chosen = (plan.rollout.streamed, plan.rollout.weights)
        if chosen != (self.plan.rollout.streamed, self.plan.rollout.weights) and not self.told:
            self.told = True  # once a run: the reason names the memory free now
            path = "streamed" if plan.rollout.streamed else f"resident, {plan.rollout.weights}"
            print(
                f"rollout: {path}, not as planned at the start ({plan.reason}); "
                f"{gib(free or 0)} free on the GPU now",
                flush=True,
            )
        return plan
