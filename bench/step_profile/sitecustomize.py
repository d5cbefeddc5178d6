"""Kernel profile of one `megatrain train` step: which CUDA kernels the engine's forward, loss
and backward spend their GPU time in. A diagnostic harness, not a product switch: nothing in
src/ reads it.

With this folder first on PYTHONPATH and MT_STEP_PROFILE=N, every Python process of the run
(bench/cli_train.py starts `python -m megatrain train` with the environment as it is) wraps the
N-th call of `StreamingEngine.train_step` (1-based) in torch.profiler (CPU and CUDA activity)
and marks the engine's `_forward`, `_loss` and `_backward` with record_function, so each kernel
can be placed in its phase. Into MT_STEP_PROFILE_OUT (default: the working directory) it writes
`trace.json.gz` (the Chrome trace) and `kernels.json`: each kernel's name with its phase, call
count and summed device time; bench/step_profile/step_kernels.py sums it by kind of kernel.

MT_SINKS_SDPA=1 (with or without a profile): attention sinks on model/sink_attention.py's sdpa
path on CUDA too, as before model/flex_sinks.py (the baseline of docs/performance.md run 78).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

from import_patches import install

STEP = int(os.environ.get("MT_STEP_PROFILE", "0") or 0)
SINKS_SDPA = os.environ.get("MT_SINKS_SDPA") == "1"
OUT = Path(os.environ.get("MT_STEP_PROFILE_OUT", "."))
PHASES = ("_forward", "_loss", "_backward")


def _patch(module: Any) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = module.StreamingEngine
    for name in PHASES:
        plain = getattr(engine, name)

        def marked(self: Any, *args: Any, _plain: Any = plain, _n: str = name, **kw: Any) -> Any:
            with record_function(f"mt:{_n.strip('_')}"):
                return _plain(self, *args, **kw)

        setattr(engine, name, marked)
    step = engine.train_step
    calls = [0]

    def profiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] != STEP:
            return step(self, *args, **kwargs)
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            out = step(self, *args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        OUT.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(OUT / "trace.json.gz"))  # torch gzips a .gz path
        with gzip.open(OUT / "trace.json.gz", "rt") as f:
            trace = json.load(f)
        from step_kernels import kernel_totals

        (OUT / "kernels.json").write_text(json.dumps(kernel_totals(trace)))
        print(f"step_profile: step {STEP} profiled into {OUT}", flush=True)
        return out

    engine.train_step = profiled


def _sdpa_sinks(module: Any) -> None:
    module.flex_ready = lambda *args: False


PATCHES = {
    **({"megatrain.engine.engine": _patch} if STEP > 0 else {}),
    **({"megatrain.model.sink_attention": _sdpa_sinks} if SINKS_SDPA else {}),
}


install(PATCHES)
