"""Training progress and metrics: a progress bar, metrics.jsonl, TensorBoard.

One `MetricsLogger` per run. Every optimizer step's record goes to `<output_dir>/metrics.jsonl`
(one JSON object per line, appended, flushed each line, so a crash loses at most the step in
flight) and, when the tensorboard package is installed, to TensorBoard event files under
`<output_dir>/tensorboard`. The console shows a tqdm bar with loss, tokens/s, MFU and ETA, or
(without a bar) one line every `log_every` steps.

Resume: the logger starts at the checkpoint's step. Records of the interrupted run after that
step (kill at 48, resume from 45: steps 46-48) are dropped from metrics.jsonl before the first
new line (the file is rewritten to a temporary file and renamed over, so a crash leaves either
the old or the cut log), and TensorBoard purges its events from that step on (`purge_step`).
So the log of a resumed run continues the checkpoint's history with every step once.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name().
_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("4090", 165e12),
    ("3090", 71e12),
)


def peak_flops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, flops in _PEAK_FLOPS:
        if key in device_name:
            return flops
    return None


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        *,
        total_steps: int,
        start_step: int,
        log_every: int,
        jsonl: bool,
        tensorboard: bool,
        progress_bar: bool,
        flops_per_token: float,
        peak_flops_per_s: float | None,
        echo: bool = True,
    ) -> None:
        """`echo` False: nothing on the console (ranks other than 0 of a multi-process run)."""
        self.output_dir = Path(output_dir)
        self.echo = echo
        self.log_every = max(1, log_every)
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_s
        path = self.output_dir / "metrics.jsonl"
        if jsonl and path.exists():
            truncate_metrics(path, start_step)
        self._jsonl_path = path if jsonl else None
        self._tensorboard, self._purge_step = tensorboard, start_step + 1
        self._opened = False  # the files are created at the first record (_open)
        self._jsonl: IO[str] | None = None
        self._tb: Any = None
        self._bar = (
            tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if progress_bar
            else None
        )
        self._t_start = time.perf_counter()
        self._total = total_steps

    def log_step(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        tokens_per_s = record["tokens"] / record["step_s"] if record["step_s"] > 0 else 0.0
        record = dict(record, step=step, tokens_per_s=round(tokens_per_s, 1))
        if self.peak:
            record["mfu"] = round(self.flops_per_token * tokens_per_s / self.peak, 4)
        self._write(record, "train")
        if self._bar is not None:
            self._bar.update(1)
            postfix = {
                "loss": f"{record['loss']:.4f}",
                "tok_s": f"{tokens_per_s:,.0f}",
                "mfu": f"{record['mfu']:.1%}" if "mfu" in record else "-",
            }
            self._bar.set_postfix(postfix | _grpo_postfix(record), refresh=False)
        elif step % self.log_every == 0 or step == self._total:
            grpo = " ".join(f"{k} {v}" for k, v in _grpo_postfix(record).items())
            self.console(
                f"step {step}/{self._total} loss {record['loss']:.4f} lr "
                f"{record['lr']:.2e} grad_norm {record['grad_norm']:.3f} "
                f"{tokens_per_s:,.0f} tok/s" + (f" {grpo}" if grpo else "")
            )
        return record

    def log_eval(self, step: int, loss: float, tokens: int) -> None:
        record = {
            "step": step,
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 50.0)),
            "eval_tokens": tokens,
        }
        self._write(record, "eval")
        self.console(
            f"step {step}: eval loss {loss:.4f} (ppl {record['eval_ppl']:.2f}) over "
            f"{tokens:,} tokens"
        )

    def console(self, message: str) -> None:
        if not self.echo:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def _open(self) -> None:
        """Create the log files, at the first record: a start that fails before its first step
        leaves none (output_dir.py counts a folder holding only its config.yaml as free)."""
        self._opened = True
        if self._jsonl_path is not None:
            # held open for the run (closed in close()): one line per step, flushed each time
            self._jsonl = open(self._jsonl_path, "a")  # noqa: SIM115
        if self._tensorboard:
            tb_dir = self.output_dir / "tensorboard"
            self._tb = _tensorboard_writer(tb_dir, purge_step=self._purge_step)

    def _write(self, record: dict[str, Any], kind: str) -> None:
        if not self._opened:
            self._open()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"kind": kind, **record}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, record["step"])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep only the records of steps <= `last_step` in a metrics.jsonl; returns those dropped.

    Atomic: the kept lines go to a temporary file that is renamed over the log. A line cut off
    by a crash (no valid JSON) is dropped too.
    """
    kept: list[str] = []
    dropped = 0
    with open(path) as f:
        for line in f:
            try:
                step = json.loads(line).get("step")
            except ValueError:
                step = None
            if isinstance(step, int) and step <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def _tensorboard_writer(path: Path, *, purge_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            "logging.tensorboard is on but the tensorboard package is not installed; "
            "pip install tensorboard, or set logging.tensorboard: false",
            stacklevel=3,
        )
        return None
    return SummaryWriter(str(path), purge_step=purge_step)


def _grpo_postfix(record: dict[str, Any]) -> dict[str, str]:
    """A GRPO step's reward, KL and generation time for the progress line (empty for SFT)."""
    if "reward" not in record:
        return {}
    return {
        "reward": f"{record['reward']:.3f}",
        "kl": f"{record['kl']:.4f}",
        "gen_s": f"{record['time/generation_s']:.1f}",
    }
