"""The CUDA allocator every megatrain process starts with (megatrain/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatrain.allocator import ALLOC_CONF, USER_KEYS, configure_allocator


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in USER_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_expandable_segments_unless_the_user_configured_the_allocator(clean_env) -> None:
    assert configure_allocator() is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF
    for key in USER_KEYS:
        clean_env.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        clean_env.setenv(key, "max_split_size_mb:128")
        assert configure_allocator() is False
        assert os.environ[key] == "max_split_size_mb:128"
        clean_env.delenv(key)


def test_every_command_starts_with_it(clean_env, tmp_path) -> None:
    """The CLI configures the allocator before it runs any command (here one that fails on its
    input, after the point where a command would start CUDA)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys\n"
        "from megatrain import cli\n"
        "code = cli.main(['data', '--config', sys.argv[1], '--show', '1'])\n"
        "print('ALLOC', os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))\n"
    )
    out = subprocess.run(
        [sys.executable, str(probe), str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in USER_KEYS},
        check=True,
    )
    assert f"ALLOC {ALLOC_CONF}" in out.stdout
