"""megatrain.hub: a hub id with the hub unreachable fails at once, with the current commands.

The hub is made unreachable whatever this machine's network: HF_ENDPOINT points at a local
port that is bound but not listening (a connection there is refused), and the hub cache is an
empty folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HUB_ID = "megatrain-tests/no-such-model"


def test_an_unreachable_hub_fails_fast_naming_the_commands_and_token(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
        env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
        start = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "megatrain", "estimate", "--model", HUB_ID, "--seq-len", "64"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        elapsed_s = time.monotonic() - start
    assert run.returncode == 2, run.stderr
    # huggingface_hub's retries alone take 1 + 2 + 4 + 8 + 8 = 23 s; the rest is importing torch
    assert elapsed_s < 20, elapsed_s
    err = run.stderr
    assert "Retrying" not in err and len(err.strip().splitlines()) == 1, err
    assert f"model.name_or_path='{HUB_ID}': cannot load the model config" in err
    assert f"unreachable, 127.0.0.1:{port}: connection refused" in err
    assert f"`hf download {HUB_ID}`" in err and "`hf auth login`, or set HF_TOKEN" in err
    assert "huggingface-cli" not in err
