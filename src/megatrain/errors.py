"""Errors that stop a run with one paragraph for the user (no traceback); no torch import.

`megatrain.cli` prints a `RunStopped` as it prints a bad key or path: its message names what
happened and the setting to change. MEGATRAIN_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why and what to change."""


class GpuOutOfMemory(RunStopped):
    """A step ran out of GPU memory and no smaller plan was left to run it with."""


class NonFiniteLoss(RunStopped):
    """A step's loss was NaN or infinite: the run stops without saving (the checkpoints
    already written stay as they were); the message names the settings to change and the last
    checkpoint."""


class MissingPath(FileNotFoundError):
    """A path the user gave (`path`) is not there; the message names its key and the fix. The
    CLI adds the command of the config file's header that makes it, if there is one."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path
