"""A stand-in `fla` package (a few files in tmp_path) for tests on a machine without a GPU: its
kernels refuse meta tensors (as the Triton ones do: launched on meta tensors they read address
0) and otherwise run transformers' torch reference; `FAKE_FLA_REFUSES` makes them raise as
flash-linear-attention 0.6 does on Hopper with Triton 3.6. The real package needs a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_FAKE_FLA = {
    "fla/__init__.py": '__version__ = "0.6.0"\n',
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": textwrap.dedent(
        """
        def _run(name, *args, **kwargs):
            import os
            import torch
            from transformers.models.qwen3_5 import modeling_qwen3_5 as m

            from megatrain.model.kernels import hub_function

            if os.environ.get("FAKE_FLA_REFUSES"):  # as fla 0.6 on Hopper with Triton 3.6
                raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs: refused")
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())):
                raise RuntimeError("fla kernel launched on meta tensors")
            return hub_function(getattr(m, name)).__wrapped__(*args, **kwargs)

        def chunk_gated_delta_rule(*args, **kwargs):
            return _run("torch_chunk_gated_delta_rule", *args, **kwargs)

        def fused_recurrent_gated_delta_rule(*args, **kwargs):
            return _run("torch_recurrent_gated_delta_rule", *args, **kwargs)
        """
    ),
}


def run_with_fake_fla(tmp_path: Path, script: str, **env_extra: str) -> str:
    for name, text in _FAKE_FLA.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), **env_extra)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
