"""The config sections: one frozen dataclass per YAML section, each with `validate()`.

Every field has a default and a docstring; every error names the key as `section.key`, the value
and what is allowed. See megatrain/config/__init__.py for the whole picture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatrain.choices import SINK_ATTENTION, TIER_STATE_DTYPES
from megatrain.config.checkpoint import CheckpointConfig
from megatrain.config.dpo import DPOConfig
from megatrain.config.grpo import GRPOConfig
from megatrain.config.memory import MemoryConfig
from megatrain.config.optimizer import OptimizerConfig
from megatrain.config.types import check_choice, check_int, check_number, check_types
from megatrain.data.config import PREFERENCE_STAGES, DataConfig
from megatrain.dtypes import DTYPE_NAMES as DTYPES
from megatrain.dtypes import torch_dtype
from megatrain.trackers import TRACKER_NAMES

if TYPE_CHECKING:
    import torch  # only named in annotations: loading a config loads no torch

ATTN_IMPLEMENTATIONS = (
    None,
    "sdpa",
    "eager",
    "flash_attention_2",
    "flex_attention",
    SINK_ATTENTION,
)
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str | None = None
    """Hub id (`Qwen/Qwen3-8B`) or local directory of a checkpoint. Exclusive with model_type."""
    model_type: str | None = None
    """Random-init architecture by transformers model type (`qwen3`) instead of a checkpoint."""
    tiny: bool = False
    """With model_type: a tiny random config of that architecture, for tests and the demo."""
    random_init: bool = False
    """With name_or_path: the checkpoint's config, but random weights."""
    tokenizer: str | None = None
    """Hub id or directory; None: name_or_path. Required with model_type; "demo": built-in one."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own Python code (config, model, tokenizer)."""
    attn_implementation: str | None = None
    """None (transformers' choice), "sdpa", "eager", "flash_attention_2", "flex_attention" or
    "megatrain_sinks" (attention sinks on flex attention's kept key blocks on CUDA, as an
    extra key of sdpa's fused kernels elsewhere). None gives "megatrain_sinks" to a model whose
    attention has sinks and no sdpa support (GPT-OSS), which transformers would run eager
    ([B, H, S, S] scores); "eager" keeps that."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields set on the HF config before building the model, e.g. {output_router_logits: true}."""
    compute_dtype: str = "bf16"
    """Dtype of the GPU forward/backward: "bf16" or "fp32" (master weights are always fp32)."""
    freeze_vision: bool = True
    """Vision-language models: keep the vision tower as loaded (LLaMA-Factory's
    freeze_vision_tower). false: it trains, fp32 master and AdamW on the host like every block,
    its forward run again in the backward (docs/vision.md). No effect on a text-only model."""
    freeze_projector: bool = True
    """Vision-language models: keep the projector (LLaVA's and Gemma 3's multi_modal_projector,
    Qwen's merger) as loaded (LLaMA-Factory's freeze_multi_modal_projector); false: it trains."""

    def validate(self) -> None:
        check_types("model", self)
        if self.name_or_path is not None and self.model_type is not None:
            raise ValueError(
                f"model.name_or_path={self.name_or_path!r} and model.model_type="
                f"{self.model_type!r} are both set; set exactly one: name_or_path for a "
                "checkpoint, model_type for a randomly initialised architecture"
            )
        if self.name_or_path is None and self.model_type is None:
            raise ValueError(
                "no model: set model.name_or_path (a hub id like Qwen/Qwen3-8B or a local "
                "directory) or model.model_type (e.g. qwen3, with model.tiny: true and "
                "model.tokenizer: demo for a tiny test model)"
            )
        for key in ("name_or_path", "model_type", "tokenizer"):
            if getattr(self, key) == "":
                raise ValueError(f"model.{key}='' is empty; give a value or null")
        if self.tiny and self.model_type is None:
            raise ValueError(
                f"model.tiny=True needs model.model_type (tiny random config of an architecture);"
                f" for random weights of model.name_or_path={self.name_or_path!r} set "
                "model.random_init: true instead"
            )
        if self.model_type is not None and self.tokenizer is None:
            raise ValueError(
                f"model.tokenizer=None: model.model_type={self.model_type!r} brings no tokenizer;"
                " set model.tokenizer to a hub id or directory, or to 'demo' for the built-in one"
            )
        check_choice("model.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        check_choice("model.compute_dtype", self.compute_dtype, DTYPES)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype as a torch dtype (the one place the name is mapped)."""
        return torch_dtype(self.compute_dtype)


@dataclass(frozen=True)
class TrainingConfig:
    output_dir: str = "outputs/run"
    """Folder for config.yaml, metrics, checkpoints and the exported model."""
    seed: int = 42
    """Seed of random init and of everything random in training (data has its own `seed`)."""
    micro_batch_size: int | str = 1
    """Rows per forward/backward: an integer >= 1, or "auto" (the largest that fits the GPU; on
    the CPU, host RAM beside the store). `megatrain grpo` and `megatrain dpo` default to "auto"
    (grpo: the largest divisor of the generation batch; dpo: an even count)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    global_batch_size: int | None = None
    """Rows per optimizer step. With micro_batch_size "auto" the accumulation becomes
    global_batch_size / micro-batch, so tokens per step stay fixed; None: "auto" keeps
    gradient_accumulation_steps and grows the micro-batch."""
    seq_len: int | None = None
    """Row length for packing / maximum padded length; None: data.cutoff_len (must be >= it)."""
    max_steps: int | None = None
    """Optimizer steps to run; overrides num_epochs. None: num_epochs of the training data."""
    num_epochs: float = 1.0
    """Passes over the training data (fractions allowed) when max_steps is None."""
    eval_every: int = 0
    """Optimizer steps between evaluations; 0: only at the end, when there is eval data."""
    max_eval_batches: int | None = None
    """Evaluate on at most this many micro-batches; None: the whole eval set."""
    device: str = "auto"
    """"auto" (the GPU if there is one), "cpu", "cuda" or "cuda:N"."""
    threads: int | None = None
    """torch's CPU threads (intra-op) the run computes with; set, it wins over OMP_NUM_THREADS.
    A CPU run's losses may depend on the count (torch's CPU kernels split sums among threads),
    so it is the run's, never the machine's load, and each checkpoint saves it: None:
    OMP_NUM_THREADS when set, else the count the resumed checkpoint was computed with, else the
    cores this process may run on (its CPU affinity); a CUDA run keeps torch's default. Where
    other processes keep the cores busy, fewer threads run faster (megatrain/threads.py)."""
    compile_layers: str | bool = "auto"
    """torch.compile each decoder layer: 1.35x the model TFLOPS of eager layers on an H100
    (Llama-3.1-8B shape, 64k tokens per step: 430 against 319), a minute or so of compiling in the
    first step, once: one graph per layer structure and grad mode, with dynamic shapes, so a short
    micro-batch or another padded length does not compile again (docs/architecture.md "Compiled
    layers"). "auto": on a GPU, for rows of one fixed length (packed, pre-training) when every layer
    is softmax attention with an MLP or routed experts (MoE: 1.40x) and needs no MLP tiles (the plan
    profiles eager layers of those kinds, which the compiled ones do not exceed; planning/builder.py
    COMPILE_AUTO_KINDS); otherwise, on the CPU and in `megatrain grpo` (rows of every length) eager.
    Hybrid linear-attention layers (Qwen3.5, Qwen3-Next) stay eager under auto: with
    flash-linear-attention they ran slower compiled (Qwen3.5-27B cut to 16 layers: 11.5 s a step
    against 9.6-9.8 eager) and held 2.7x the eager layer's memory in their backward. true / false:
    as given."""
    overwrite_output_dir: bool = False
    """Start a new run (resume_from: null) in a non-empty output_dir. The previous run's files
    there (config.yaml, metrics.jsonl, tensorboard, wandb, swanlog, checkpoints, hf_model) are
    moved into output_dir/previous-<time>/, never deleted. False: such a run is refused."""

    def validate(self) -> None:
        check_types("training", self)
        if self.output_dir == "":
            raise ValueError("training.output_dir='' is empty; give a folder, e.g. outputs/run")
        check_int("training.seed", self.seed, minimum=0)
        mbs = self.micro_batch_size
        if (isinstance(mbs, str) and mbs != "auto") or (isinstance(mbs, int) and mbs < 1):
            raise ValueError(f"training.micro_batch_size={mbs!r} must be an integer >= 1 or 'auto'")
        check_int(
            "training.gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1
        )
        check_int("training.global_batch_size", self.global_batch_size, minimum=1, optional=True)
        if self.global_batch_size is not None and mbs != "auto":
            raise ValueError(
                f"training.global_batch_size={self.global_batch_size} is used only with "
                "micro_batch_size: auto; otherwise rows per step are micro_batch_size x "
                "gradient_accumulation_steps (set global_batch_size: null)"
            )
        check_int("training.seq_len", self.seq_len, minimum=2, optional=True)
        check_int("training.max_steps", self.max_steps, minimum=1, optional=True)
        check_number("training.num_epochs", self.num_epochs, low=0.0, low_open=True)
        check_int("training.eval_every", self.eval_every, minimum=0)
        check_int("training.max_eval_batches", self.max_eval_batches, minimum=1, optional=True)
        check_int("training.threads", self.threads, minimum=1, optional=True)
        if isinstance(self.compile_layers, str):
            check_choice("training.compile_layers", self.compile_layers, ("auto",))
        if not DEVICE_PATTERN.fullmatch(self.device):
            allowed = ["auto", "cpu", "cuda", "cuda:N"]
            raise ValueError(f"training.device={self.device!r} must be one of {allowed}")


PLANNED_BATCH: dict[str, dict[str, Any]] = {"training": {"micro_batch_size": "auto"}}
"""The defaults `megatrain grpo` and `megatrain dpo` put under the config file (and `megatrain
estimate` for their runs): the plan picks the micro-batch (planning/batch_size.py). A GRPO step
is one generation batch, its rows fixed, so "auto" only changes how they are batched; a
preference step keeps gradient_accumulation_steps (or global_batch_size) as `train` does."""


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 1
    """Optimizer steps between metric lines (loss, lr, grad norm, tokens/s)."""
    jsonl: bool = True
    """Append metrics to output_dir/metrics.jsonl."""
    report_to: str | tuple[str, ...] = ("tensorboard",)
    """Trackers that also get every metric (rank 0): tensorboard (output_dir/tensorboard), wandb,
    mlflow, swanlab, trackio, a list of them, "all" (every one installed) or "none". Each one's
    own settings come from its environment variables (WANDB_MODE=offline, MLFLOW_TRACKING_URI,
    ...); docs/metrics.md."""
    project: str = "megatrain"
    """The project (wandb, swanlab, trackio) or experiment (mlflow) the run is logged under."""
    run_name: str | None = None
    """The run's name in the trackers; None: the output_dir's folder name."""
    progress_bar: bool = True
    """Show a tqdm progress bar."""
    timeline: bool = False
    """Print where each step's time went (transfers, compute, optimizer, waits)."""

    def validate(self) -> None:
        check_types("logging", self)
        check_int("logging.log_every", self.log_every, minimum=1)
        names = (self.report_to,) if isinstance(self.report_to, str) else self.report_to
        for name in names:
            check_choice("logging.report_to", name, (*TRACKER_NAMES, "all", "none"))
        if len(names) > 1 and {"all", "none"} & set(names):
            raise ValueError(
                f"logging.report_to={list(names)!r} mixes 'all' or 'none' with other names; "
                "give 'all', 'none', or a list of trackers"
            )


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def validate(self) -> None:
        """Each section's checks, then the ones that span sections."""
        self.model.validate()
        check_types("data", self.data)
        self.data.validate()
        self.training.validate()
        self.optimizer.validate()
        self.memory.validate()
        self.logging.validate()
        self.checkpoint.validate()
        self.grpo.validate()
        self.dpo.validate()
        t, d = self.training, self.data
        if d.stage in PREFERENCE_STAGES and (d.stage == "kto") != (self.dpo.loss_type == "kto"):
            raise ValueError(
                f"data.stage={d.stage!r} with dpo.loss_type={self.dpo.loss_type!r}: KTO rows "
                "(data.stage: kto) train with loss_type: kto, pairs (dpo) with the others"
            )
        if t.seq_len is not None and t.seq_len < d.cutoff_len:
            raise ValueError(
                f"training.seq_len={t.seq_len} is shorter than data.cutoff_len={d.cutoff_len}; a "
                f"row must hold the longest sample: set seq_len >= {d.cutoff_len} or null"
            )
        if t.eval_every > 0 and d.val_size == 0 and not d.eval_dataset_names():
            raise ValueError(
                f"training.eval_every={t.eval_every} but there is no evaluation data; set "
                "data.val_size or data.eval_dataset, or training.eval_every: 0"
            )
        blocks, states = self.memory.gpu_state_blocks, self.optimizer.state_dtype
        if isinstance(blocks, int) and blocks > 0 and states not in TIER_STATE_DTYPES:
            raise ValueError(
                f"memory.gpu_state_blocks={blocks} with optimizer.state_dtype={states!r}: the GPU "
                f"tier keeps {', '.join(TIER_STATE_DTYPES)} states; set memory.gpu_state_blocks: "
                "0 (or auto), or another optimizer.state_dtype"
            )
        self._check_master_dtype()
        warmup = self.optimizer.warmup_steps
        if t.max_steps is not None and warmup > t.max_steps:
            raise ValueError(
                f"optimizer.warmup_steps={warmup} exceeds training.max_steps={t.max_steps}; "
                f"set warmup_steps <= {t.max_steps} (or use optimizer.warmup_ratio)"
            )

    def _check_master_dtype(self) -> None:
        """A bf16 master is the bf16 copy the device streams: bf16 compute, no GPU tier."""
        if self.optimizer.master_dtype == "fp32":
            return
        if self.model.compute_dtype != "bf16":
            raise ValueError(
                f"optimizer.master_dtype: bf16 with model.compute_dtype: "
                f"{self.model.compute_dtype}: the bf16 master is the copy the GPU computes with; "
                "set model.compute_dtype: bf16, or optimizer.master_dtype: fp32"
            )
        blocks = self.memory.gpu_state_blocks
        if isinstance(blocks, int) and blocks > 0:
            raise ValueError(
                f"memory.gpu_state_blocks={blocks} with optimizer.master_dtype: bf16: the GPU "
                "tier keeps fp32 masters (a block's checkpoint must not depend on its tier); "
                "set memory.gpu_state_blocks: 0 (or auto), or optimizer.master_dtype: fp32"
            )

    # Derived values: computed here once, read everywhere else.

    @property
    def seq_len(self) -> int:
        """Tokens per row: training.seq_len, or data.cutoff_len when that is None."""
        return self.training.seq_len or self.data.cutoff_len

    @property
    def layout(self) -> str:
        """How rows are laid out: "padded", "packed" (positions restart inside rows) or "full"
        (plain causal rows); decided by the data section (DataConfig.layout)."""
        return self.data.layout()

    @property
    def rows_together(self) -> int:
        """Rows that share a micro-batch: 2 for preference data (a pair's chosen and rejected,
        a KTO row and its KL row), else 1; "auto" micro-batches hold a multiple of it."""
        return 2 if self.data.stage in PREFERENCE_STAGES else 1


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "memory": MemoryConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "grpo": GRPOConfig,
    "dpo": DPOConfig,
}
"""YAML section name -> its dataclass, in TrainConfig's field order."""
