"""Training progress and metrics: a progress bar, metrics.jsonl, the trackers of report_to.

One `MetricsLogger` per run. Every optimizer step's record goes to `<output_dir>/metrics.jsonl`
(one JSON object per line, appended, flushed each line, so a crash loses at most the step in
flight) and to each tracker the run opened (megatrain/trackers.py: TensorBoard by default,
W&B, MLflow, SwanLab, Trackio) as `train/<key>` / `eval/<key>` scalars at the record's step.
The console shows a tqdm bar with loss, tokens/s, MFU and ETA, or (without a bar) one line
every `log_every` steps.

Speed under ranks: a step's `tokens` are the whole job's (the engine sums them over the ranks),
so `tokens_per_s` is the job's and `tokens_per_s_per_gpu` divides it by the world size. Model
FLOPs are per GPU: `tflops_per_gpu` = flops_per_token x tokens_per_s_per_gpu, and `mfu` is that
over one GPU's peak (two GPUs at 42% each show 42%, not 84%).

Resume: the logger starts at the checkpoint's step. Records of the interrupted run after that
step (kill at 48, resume from 45: steps 46-48) are dropped from metrics.jsonl before the first
new line (the file is rewritten to a temporary file and renamed over, so a crash leaves either
the old or the cut log); the trackers handle their own history (trackers.py).
So the log of a resumed run continues the checkpoint's history with every step once.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from megatrain.run_files import METRICS_FILE
from megatrain.trackers import Tracker

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
        trackers: Sequence[Tracker],
        progress_bar: bool,
        flops_per_token: float,
        peak_flops_per_s: float | None,
        world_size: int = 1,
        echo: bool = True,
    ) -> None:
        """`flops_per_token`: model FLOPs per trained token (6 x active parameters);
        `peak_flops_per_s`: one GPU's peak (None: no MFU); `world_size`: the GPUs of the job;
        `trackers`: opened for this run (trackers.open_trackers), closed by `close()`;
        `echo` False: nothing on the console (ranks other than 0 of a multi-process run)."""
        self.output_dir = Path(output_dir)
        self.echo = echo
        self.log_every = max(1, log_every)
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_per_s
        self.world_size = world_size
        path = self.output_dir / METRICS_FILE
        if jsonl and path.exists():
            truncate_metrics(path, start_step)
        self._jsonl_path = path if jsonl else None
        self._opened = False  # metrics.jsonl is created at the first record (_open)
        self._jsonl: IO[str] | None = None
        self._trackers = list(trackers)
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
        record = dict(record, step=step) | self._speed(record["tokens"], record["step_s"])
        self._write(record, "train")
        shown = self._speed_postfix(record) | _grpo_postfix(record) | _dpo_postfix(record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({"loss": f"{record['loss']:.4f}"} | shown, refresh=False)
        elif step % self.log_every == 0 or step == self._total:
            self.console(
                f"step {step}/{self._total} loss {record['loss']:.4f} lr "
                f"{record['lr']:.2e} grad_norm {record['grad_norm']:.3f} "
                + " ".join(f"{k} {v}" for k, v in shown.items())
            )
        return record

    def _speed(self, tokens: int, step_s: float) -> dict[str, float]:
        """A step's speed from the job's `tokens`: tokens/s of the job and per GPU, model
        TFLOPS per GPU, and MFU (per GPU, against one GPU's peak; absent without a peak)."""
        tokens_per_s = tokens / step_s if step_s > 0 else 0.0
        per_gpu = tokens_per_s / self.world_size
        flops_per_gpu = self.flops_per_token * per_gpu
        out = {
            "tokens_per_s": round(tokens_per_s, 1),
            "tokens_per_s_per_gpu": round(per_gpu, 1),
            "tflops_per_gpu": round(flops_per_gpu / 1e12, 2),
        }
        if self.peak:
            out["mfu"] = round(flops_per_gpu / self.peak, 4)
        return out

    def _speed_postfix(self, record: dict[str, Any]) -> dict[str, str]:
        """The job's tokens/s, then per GPU (with several ranks) and MFU, for the console."""
        out = {"tok_s": f"{record['tokens_per_s']:,.0f}"}
        if self.world_size > 1:
            out["tok_s_gpu"] = f"{record['tokens_per_s_per_gpu']:,.0f}"
        out["mfu"] = f"{record['mfu']:.1%}" if "mfu" in record else "-"
        return out

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

    def log_event(self, step: int, kind: str, record: dict[str, Any], message: str) -> None:
        """Something the run changed on its own at `step` (e.g. "plan_step_down"): one record
        of that kind in metrics.jsonl (its numbers to the trackers too) and `message` on the
        console."""
        self._write({"step": step, **record}, kind)
        self.console(message)

    def console(self, message: str) -> None:
        if not self.echo:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def _open(self) -> None:
        """Create metrics.jsonl at the first record: a start that fails before its first step
        leaves none (checkpoint/output_dir.py counts a folder holding only its config.yaml as free;
        the
        trackers' folders are made when they open, at the start of training)."""
        self._opened = True
        if self._jsonl_path is not None:
            # held open for the run (closed in close()): one line per step, flushed each time
            self._jsonl = open(self._jsonl_path, "a")  # noqa: SIM115

    def _write(self, record: dict[str, Any], kind: str) -> None:
        if not self._opened:
            self._open()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"kind": kind, **record}) + "\n")
            self._jsonl.flush()
        if self._trackers:
            scalars = {
                f"{kind}/{key}": float(value)
                for key, value in record.items()
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)
            }
            for tracker in self._trackers:
                tracker.log(scalars, record["step"])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        for tracker in self._trackers:
            tracker.close()


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


def _dpo_postfix(record: dict[str, Any]) -> dict[str, str]:
    """A preference step's share of pairs ranked right and reward margin (empty otherwise)."""
    if "rewards/accuracies" not in record:
        return {}
    return {
        "acc": f"{record['rewards/accuracies']:.3f}",
        "margin": f"{record['rewards/margins']:.3f}",
    }


def _grpo_postfix(record: dict[str, Any]) -> dict[str, str]:
    """A GRPO step's reward, KL and generation time for the progress line (empty for SFT)."""
    if "reward" not in record:
        return {}
    return {
        "reward": f"{record['reward']:.3f}",
        "kl": f"{record['kl']:.4f}",
        "gen_s": f"{record['time/generation_s']:.1f}",
    }
