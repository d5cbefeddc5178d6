"""MetricsLogger's speed figures: tokens/s of the job and per GPU, TFLOPS and MFU per GPU.

A step's `tokens` are the job's (the engine sums them over the ranks). Numbers of the test: a
model of N = 1.25e9 parameters (6N = 7.5e9 FLOPs per token), 16,000 tokens in 0.2 s on 2 GPUs
whose (fake) peak is 1e15 FLOP/s: 80,000 tokens/s for the job, 40,000 per GPU, 300 TFLOPS per
GPU, MFU 0.3. Every figure is exact to its rounding (tokens/s to 0.1, TFLOPS to 0.01, MFU to
1e-4), so the checks are exact; a logger that divided the job's tokens/s by one GPU's peak
would show MFU 0.6.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.metrics import MetricsLogger

FLOPS_PER_TOKEN = 6 * 1.25e9
PEAK = 1e15
TOKENS, STEP_S = 16_000, 0.2


def _logger(
    out: Path, world_size: int, *, progress_bar: bool, peak: float | None = PEAK
) -> MetricsLogger:
    return MetricsLogger(
        out,
        total_steps=1,
        start_step=0,
        log_every=1,
        jsonl=False,
        trackers=(),
        progress_bar=progress_bar,
        flops_per_token=FLOPS_PER_TOKEN,
        peak_flops_per_s=peak,
        world_size=world_size,
    )


def _step(logger: MetricsLogger) -> dict[str, float]:
    record = {"loss": 1.0, "lr": 1e-5, "grad_norm": 1.0, "tokens": TOKENS, "step_s": STEP_S}
    return logger.log_step(1, record)


@pytest.mark.parametrize("world_size", [1, 2])
def test_speed_is_per_gpu(tmp_path: Path, world_size: int) -> None:
    logger = _logger(tmp_path, world_size, progress_bar=False)
    record = _step(logger)
    logger.close()
    per_gpu = TOKENS / STEP_S / world_size
    assert record["tokens_per_s"] == 80_000.0
    assert record["tokens_per_s_per_gpu"] == per_gpu
    assert record["tflops_per_gpu"] == round(FLOPS_PER_TOKEN * per_gpu / 1e12, 2)
    assert record["mfu"] == round(FLOPS_PER_TOKEN * per_gpu / PEAK, 4)
    assert record["mfu"] == {1: 0.6, 2: 0.3}[world_size]


def test_progress_bar_shows_per_gpu_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = _logger(tmp_path, 2, progress_bar=True)
    _step(logger)
    logger.close()  # the bar's last refresh shows the step's postfix
    err = capsys.readouterr().err
    assert "tok_s=80,000" in err and "tok_s_gpu=40,000" in err and "mfu=30.0%" in err


def test_console_line_shows_per_gpu_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = _logger(tmp_path, 2, progress_bar=False)
    _step(logger)
    logger.close()
    assert "tok_s 80,000 tok_s_gpu 40,000 mfu 30.0%" in capsys.readouterr().err


def test_no_peak_no_mfu(tmp_path: Path) -> None:
    # a CPU run, or a GPU not in the table
    logger = _logger(tmp_path, 2, progress_bar=False, peak=None)
    record = _step(logger)
    logger.close()
    assert "mfu" not in record and record["tflops_per_gpu"] == 300.0
