"""File modes: what MegaTrain writes is readable exactly as far as the user's umask allows.

Writers that go through a private temporary file (`tempfile.mkstemp`, safetensors' `save_file`)
create it with mode 0600 whatever the umask, so on a shared machine the other users could read a
run's metrics but not its checkpoint blocks or exported `model.safetensors`. `umask_mode` is the
mode `open()` gives a new file (0666 less the umask: 0644 under the usual 022); every file such a
writer produces is set to it.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask_mode() -> int:
    """0o666 less the process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask


def honour_umask(*paths: Path) -> None:
    """Give files written through a private temporary file the mode of a normal new file."""
    mode = umask_mode()
    for path in paths:
        os.chmod(path, mode)
