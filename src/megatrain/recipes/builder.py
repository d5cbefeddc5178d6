"""The one builder: a validated `TrainConfig` -> the pieces of a run.

Every command builds what it needs here and nowhere else:

    b = RunBuilder(cfg)                  # device resolved, nothing loaded yet
    plan = b.plan()                      # resource plan: estimate, fit check input, batch
    tok = b.tokenizer(); data = b.data()
    structure, store = b.model_and_store()  # or b.model(), then b.store(structure)
    engine = b.engine(structure, store)  # with b.optimizer() unless one is given
    loader = b.loader(data.train); schedule = b.schedule(total_steps)
    metrics = b.metrics(total_steps=..., start_step=...); b.export(store)

The recipes (recipes/base.py, which `train` and `grpo` run) use all of it, `verify` the model,
store and engine (its reference is plain PyTorch), `estimate` only the plan (`PlanBuilder`,
planning/builder.py, which RunBuilder extends), `export` the model and store, `data` the
tokenizer and data.

Invariants:
- The engine's settings are read from the config (or one of its derived properties) here and
  nowhere else: the compute dtype (`cfg.model.torch_dtype`), clipping (`cfg.optimizer.
  clip_norm`), the row length (`cfg.seq_len`), the slot count (`cfg.memory.num_slots`) and the
  batch (`batch()`: the config's, or the plan's when "auto").
- The resource plan is computed before anything large is allocated, from the model's config
  alone (meta device); the run's own plan is cached, so the batch the run uses is the one that
  was checked. A recipe whose other phases need GPU room gives `gpu_reserve` at construction
  (GRPO's rollout); the plan changes only by `step_down` (a step that ran out of GPU memory,
  recipes/oom.py).
- Components receive plain keyword arguments, never the config (STYLE: only the recipe reads it).

Ranks: under torchrun (megatrain/distributed.py) the placement is this rank's (cuda:LOCAL_RANK,
the process group joined), the store is built sharded (store/shard.py), the training loader
reads this rank's rows (data/ranks.py), a GPU tier is sharded over the ranks' GPUs (one count
on every rank: the least any rank planned), metrics and trackers from rank 0. A plain run is a
world of one. `reference()` is a frozen host copy of the store's weights (GRPO's KL
reference), not a second model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from megatrain.checkpoint.export import export_hf, export_sharded
from megatrain.config import TrainConfig, config_to_dict
from megatrain.data import BatchLoader, PreparedData, PretrainCorpus, make_loader, prepare_data
from megatrain.data.ranks import RankLoader
from megatrain.data.sample import Sample
from megatrain.distributed import (
    Placement,
    least_on_ranks,
    node_turns,
    on_rank0,
    placement_here,
    rank_max,
    rank_mins,
)
from megatrain.engine.engine import StreamingEngine
from megatrain.engine.plan import EnginePlan, tier_names
from megatrain.metrics import MetricsLogger, peak_flops
from megatrain.model.kernels import fall_back_where_refused
from megatrain.model.loading import load_causal_lm
from megatrain.model.multimodal import trained_vision
from megatrain.model.structure import ModelStructure, discover
from megatrain.model.tokenizer import load_tokenizer, processor_source
from megatrain.optim.adamw import AdamWHyper, CpuAdamW
from megatrain.optim.schedule import LRSchedule, warmup_steps_for
from megatrain.planning.builder import PlanBuilder
from megatrain.planning.hardware import GIB, RATES, Hardware, probe
from megatrain.run_files import HF_MODEL_DIR
from megatrain.store.host import HostStore
from megatrain.store.reference import ReferenceWeights
from megatrain.store.shard import shard_master
from megatrain.threads import optimizer_threads
from megatrain.trackers import Tracker, TrackerRun, open_trackers, tracker_names


class RunBuilder(PlanBuilder):
    """Builds the parts of one run from its config; owns no state beyond caches of what it built.
    Its plan and the settings read from it come from `PlanBuilder` (planning/builder.py).

    The cached pieces (`hf_config`, `spec`, `plan`, `tokenizer`, `data`) are built at most once,
    so commands that need them in several places see one object. `model()` and `store()` build
    a new model each call (a second role would need its own copy).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        hardware: Hardware | None = None,
        placement: Placement | None = None,
        gpu_reserve: Callable[[PlanBuilder], int] | None = None,
    ) -> None:
        """`placement` None: this process's, on `training.device` (under torchrun its rank's:
        the process group is joined here, distributed.placement_here)."""
        super().__init__(
            cfg,
            placement=placement or placement_here(cfg.training.device),
            hardware=hardware,
            gpu_reserve=gpu_reserve,
        )
        self.load_seconds: dict[str, float] = {}  # model_and_store: seconds of each part

    def _machine(self) -> Hardware:
        """detect()'s, with the rates that decide the plan measured here (memory.probe_rates,
        a GPU run): local rank 0 of each node probes while its node's other ranks wait, then
        every rank takes the slowest node's, so every rank plans the same. A probe that fails
        leaves the assumed rates, said in one line."""
        hw, cfg, p = super()._machine(), self.cfg, self.placement
        if not (cfg.memory.probe_rates and p.is_cuda):
            return hw
        opt, threads = cfg.optimizer, self._node_threads(hw).optimizer_threads
        began, rates = time.perf_counter(), [math.inf] * len(RATES)
        if p.local_rank == 0:
            try:
                probed = probe(
                    optimizer_threads=threads,
                    state_dtype=opt.state_dtype,
                    impl=opt.impl,
                    matmul=False,
                )
                rates = [float(getattr(probed, name)) for name in RATES]
            except (RuntimeError, MemoryError, OSError) as error:
                print(f"rates: not measured ({error}); the plan assumes the test host's")
        rates = rank_mins(rates)
        if not all(map(math.isfinite, rates)):
            return hw
        measured = dict(zip(RATES, rates, strict=True))
        if p.rank == 0:
            print(
                f"rates measured here: host-to-GPU {measured['h2d_gbps']:.1f} GB/s, "
                f"GPU-to-host {measured['d2h_gbps']:.1f} GB/s, CPU AdamW "
                f"{measured['optimizer_gparams_s']:.2f} Gparams/s ({opt.state_dtype} states, "
                f"{threads} threads) in {time.perf_counter() - began:.1f} s "
                "(memory.probe_rates: false plans with the test host's)",
                flush=True,
            )
        return dataclasses.replace(
            hw,
            **measured,  # type: ignore[arg-type]
            optimizer_state_dtype=opt.state_dtype,
            optimizer_threads=threads,
            measured=tuple(sorted({*hw.measured, *RATES, "optimizer_threads"})),
        )

    # ---------------------------------------------------------------- data

    @functools.cached_property
    def _tokenizer(self) -> Any:
        m = self.cfg.model
        tokenizer = load_tokenizer(
            m.tokenizer, m.name_or_path, trust_remote_code=m.trust_remote_code
        )
        vocab = self.hf_config.get_text_config().vocab_size
        if len(tokenizer) > vocab:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
                f"{vocab}: use the model's own tokenizer (model.tokenizer), or for a random-init "
                f"model set model.config_overrides.vocab_size >= {len(tokenizer)}"
            )
        return tokenizer

    def tokenizer(self) -> Any:
        return self._tokenizer

    @functools.cached_property
    def _data(self) -> PreparedData:
        m = self.cfg.model
        source = processor_source(m.tokenizer, m.name_or_path)
        return prepare_data(self.cfg.data, self.tokenizer(), processor=source)

    def data(self) -> PreparedData:
        return self._data

    def loader(
        self, samples: list[Sample] | PretrainCorpus, *, train: bool = True
    ) -> BatchLoader | RankLoader:
        """Micro-batches of `samples` at the planned micro-batch size; shuffled when `train`.
        Several ranks: the training loader yields this rank's share (data/ranks.py); the eval
        loader is the whole set (the trainer splits it)."""
        d, p = self.cfg.data, self.placement
        loader = make_loader(
            samples,
            micro_batch_size=self.batch()[0],
            seq_len=self.cfg.seq_len,
            packing=d.packing,
            pad_token_id=self.data().pad_token_id,
            shuffle=d.shuffle if train else False,
            seed=d.seed,
            pad_to_multiple_of=d.pad_to_multiple_of,
            vision=self.data().vision,
        )
        if train and p.world_size > 1:
            return RankLoader(loader, rank=p.rank, world_size=p.world_size)
        return loader

    # ---------------------------------------------------------------- model and engine

    def model(self, *, random_init: bool | None = None) -> ModelStructure:
        """The HF model (fp32, CPU), its structure discovered; weights move into a store next.

        `random_init` None: the config's choice (export passes True: weights come from the
        checkpoint instead).
        """
        m = self.cfg.model
        model = load_causal_lm(
            m.name_or_path,
            model_type=m.model_type,
            tiny=m.tiny,
            random_init=m.random_init if random_init is None else random_init,
            trust_remote_code=m.trust_remote_code,
            attn_implementation=m.attn_implementation,
            config_overrides=dict(m.config_overrides) or None,
            seed=self.cfg.training.seed,
            init_device=self.device if self.placement.is_cuda else None,
            progress_bar=self.cfg.logging.progress_bar,
        )
        return discover(model)

    def store(
        self,
        structure: ModelStructure,
        *,
        compute_dtype: torch.dtype | None = None,
        state_dtype: str | None = None,
        master_dtype: str | None = None,
        device_blocks: Collection[str] = (),
    ) -> HostStore:
        """The host store of `structure`'s weights: this rank's shards when there are ranks;
        `device_blocks` (the run's GPU tier) move to the device as they are built."""
        opt, p, m = self.cfg.optimizer, self.placement, self.cfg.model
        vision = trained_vision(
            structure, tower=not m.freeze_vision, projector=not m.freeze_projector
        )
        if vision and p.world_size > 1:
            raise ValueError(
                "model.freeze_vision / model.freeze_projector false: training the vision modules "
                "runs on one process only for now; under torchrun keep them frozen (true), or "
                "train on one GPU"
            )
        shard = None
        if p.world_size > 1:
            shard = functools.partial(
                shard_master, rank=p.rank, world=p.world_size, pin_memory=self.pin_memory
            )
        return HostStore(
            structure,
            compute_dtype=compute_dtype or self.cfg.model.torch_dtype,
            pin_memory=self.pin_memory,
            no_decay=opt.no_decay,
            decay_1d=opt.decay_1d,
            state_dtype=state_dtype or opt.state_dtype,
            master_dtype=master_dtype or opt.master_dtype,
            grad_dtype=opt.grad_dtype,
            clipping=opt.clip_norm is not None,
            shard=shard,
            vision=vision,
            device_blocks=device_blocks,
            device=self.device,
        )

    def model_and_store(self) -> tuple[ModelStructure, HostStore]:
        """`model()` and `store()` of the run. Every rank loads one whole fp32 model and keeps
        its shards, block by block: as many of a node's ranks at once as its host holds (with
        the host margin; HostMemory.loading_at_once), the rest after them, each with its share
        of the node's cores (distributed.node_turns). The GPU tier's blocks go to the device
        as they are built (store/host.py)."""
        p = self.placement
        tier = tier_names(self.spec.num_layers, self.engine_plan().gpu_state_blocks)

        def build() -> tuple[ModelStructure, HostStore]:
            began = time.perf_counter()
            structure = self.model()
            built = time.perf_counter()
            store = self.store(structure, device_blocks=tier)
            self.load_seconds = {"model": built - began, "host store": time.perf_counter() - built}
            return structure, store

        if p.world_size == 1:
            return build()
        host = self.plan().estimate.host
        room = self.hardware.host_bytes - self.cfg.memory.host_margin_gib * GIB
        # every rank plans the same, but the hardware each measured may differ: the fewest
        at_once = -rank_max(-host.loading_at_once(room, p.local_world_size))
        if p.rank == 0:
            print(
                f"loading the model: {at_once} of each node's {p.local_world_size} ranks at "
                f"once (host peak {host.load_peak_at_once(at_once) / GIB:.1f} GiB predicted)",
                flush=True,
            )
        return node_turns(build, p, at_once=at_once)

    def optimizer(self) -> CpuAdamW:
        opt = self.cfg.optimizer
        return CpuAdamW(
            AdamWHyper(
                betas=(opt.betas[0], opt.betas[1]), eps=opt.eps, weight_decay=opt.weight_decay
            ),
            impl=opt.impl,
            num_threads=opt.threads or optimizer_threads(self.placement.local_world_size),
        )

    def engine_plan(self) -> EnginePlan:
        """The plan the engine runs; several ranks agree on one GPU-tier count (each planned
        its own GPU; the collectives of a sharded tier need one count): the least."""
        plan = super().engine_plan()
        if self.placement.world_size == 1:
            return plan
        return dataclasses.replace(plan, gpu_state_blocks=least_on_ranks(plan.gpu_state_blocks))

    def engine(
        self, structure: ModelStructure, store: HostStore, optimizer: CpuAdamW | None = None
    ) -> StreamingEngine:
        fall_back_where_refused(structure)  # a kernel package that would stop the run
        return StreamingEngine(
            structure,
            store,
            optimizer or self.optimizer(),
            self.engine_plan(),
            device=self.device,
        )

    def export(self, store: HostStore) -> Path:
        """The store's weights as a Hugging Face folder, output_dir/hf_model (with all updates
        applied: the caller waits for them). Sharded: gathered to rank 0, which writes one
        ordinary folder (checkpoint/export.py)."""
        out, dtype = (
            Path(self.cfg.training.output_dir) / HF_MODEL_DIR,
            self.cfg.checkpoint.export_dtype,
        )
        if self.placement.world_size > 1:
            return export_sharded(
                store, out, device=self.device, dtype=dtype, tokenizer=self.tokenizer()
            )
        return export_hf(store, out, dtype=dtype, tokenizer=self.tokenizer())

    def reference(self, store: HostStore) -> ReferenceWeights:
        """The store's current weights, frozen in host memory (GRPO's KL reference)."""
        return ReferenceWeights(store)

    def schedule(self, total_steps: int) -> LRSchedule:
        """The learning-rate schedule of a run of `total_steps` optimizer steps."""
        opt = self.cfg.optimizer
        return LRSchedule(
            peak_lr=opt.learning_rate,
            total_steps=total_steps,
            kind=opt.lr_scheduler,
            warmup_steps=warmup_steps_for(total_steps, opt.warmup_steps, opt.warmup_ratio),
            min_lr_ratio=opt.min_lr_ratio,
        )

    def metrics(self, *, total_steps: int, start_step: int) -> MetricsLogger:
        """The run's metrics logger in output_dir: metrics.jsonl, the trackers of
        logging.report_to, the progress bar. Rank 0 alone logs and opens trackers."""
        log, device = self.cfg.logging, self.device
        out = Path(self.cfg.training.output_dir)
        main = self.placement.rank == 0
        run = TrackerRun(
            output_dir=out,
            project=log.project,
            name=log.run_name or out.resolve().name,
            start_step=start_step,
            config=config_to_dict(self.cfg),
        )
        trackers: list[Tracker] = []

        def open_on_rank0() -> None:
            if main:
                trackers.extend(open_trackers(tracker_names(log.report_to), run))

        on_rank0(open_on_rank0)  # a tracker that fails to open stops every rank, not rank 0 alone
        return MetricsLogger(
            out,
            total_steps=total_steps,
            start_step=start_step,
            log_every=log.log_every,
            jsonl=log.jsonl and main,
            trackers=trackers,
            progress_bar=log.progress_bar and main,
            echo=main,
            flops_per_token=6 * self.spec.active_params,
            world_size=self.placement.world_size,  # the engine's tokens are the job's
            peak_flops_per_s=peak_flops(
                torch.cuda.get_device_name(device) if device.type == "cuda" else None
            ),
        )
