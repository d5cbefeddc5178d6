"""Causal attention alone at a preset's heads: torch's default sdpa order against each backend
put first, forward and backward, bf16, over row lengths.

    python bench/attention_kernels.py --preset llama3.1-8b --seq 8192,32768,131072,524288 \
        --sdpa default,flash,cudnn

`default` is what `megatrain train` runs (torch's own order); the others put one backend first
(train_shape.py --sdpa). One RESULT line per row length and backend: time, TFLOPS (causal
FLOPs; backward counted as 2.5 x forward) and the GPU memory the backward adds, for one call
over all heads (the engine's layer below the long-row threshold).
"""

from __future__ import annotations

import argparse
import types

import torch
from common import log, preset_values, result
from train_shape import SDPA, attention_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.1-8b")
    ap.add_argument("--seq", default="8192,32768,131072")
    ap.add_argument("--sdpa", default="default,flash,cudnn", help=f"default and of {list(SDPA)}")
    ap.add_argument("--reps", type=int, default=2, help="best of; 1 above 131072 tokens")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    backends = a.sdpa.split(",")
    unknown = [b for b in backends if b != "default" and b not in SDPA]
    if unknown:
        ap.error(f"--sdpa {unknown}: choose from default, {', '.join(SDPA)}")
    _, values = preset_values(a.preset)
    config = types.SimpleNamespace(**values)
    for seq in [int(s) for s in a.seq.split(",")]:
        for backend in backends:
            reps = a.reps if seq <= 131072 else 1
            try:
                r = attention_bench(config, seq, backend, modes=("whole",), reps=reps)
            except torch.OutOfMemoryError as e:
                r = dict(attention_kernel=backend, error=str(e).splitlines()[0])
            log(f"{seq} tokens, {backend}: {r}")
            result(preset=a.preset, seq=seq, gpu=torch.cuda.get_device_name(), **r)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
