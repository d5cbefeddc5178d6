"""The Hugging Face hub: fail fast when it cannot be reached, and one paragraph when a fetch fails.

huggingface_hub retries a metadata request five times with back-off (about 25 s and eleven
warning lines) before transformers gives up on an unreachable hub. `go_offline_if_unreachable`,
called before the first fetch of a hub id, opens one TCP connection to the hub endpoint
(`HF_ENDPOINT`, or the proxy that reaches it) with a short timeout; when that fails, the process
switches huggingface_hub to offline mode, as `HF_HUB_OFFLINE=1` does: files already in the hub
cache still load, the rest fail at once, and `hub_error` says why.

Invariants: `HF_HUB_OFFLINE` set by the user is respected (no probe); the probe runs once a
process; nothing here imports torch or transformers.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0
"""How long the probe waits for a TCP connection: a reachable hub answers in well under a second."""

LOGIN = "`hf auth login`, or set HF_TOKEN"
"""How a user gives the hub their access token (huggingface_hub >= 1.0's command)."""


def go_offline_if_unreachable() -> None:
    """Put huggingface_hub in offline mode for this process if the hub cannot be reached."""
    if unreachable() is None:
        return
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True  # what transformers and huggingface_hub read per request
    os.environ["HF_HUB_OFFLINE"] = "1"  # and processes started from this one


@functools.cache
def unreachable() -> str | None:
    """Why the hub endpoint cannot be reached ("http://host:port: connection refused"), or None:
    reachable, or offline mode already set (then nothing is fetched anyway)."""
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    url = urlsplit(constants.ENDPOINT)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = via.hostname or "", via.port or 80
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:  # refused, no route, DNS failure, timeout
        return f"{host}:{port}: {_reason(e)}"
    return None


def hub_error(key: str, source: str, error: OSError, *, what: str) -> ValueError:
    """One paragraph for a hub id whose files could not be fetched (offline, unknown, gated)."""
    down = unreachable()
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    cause = f"unreachable, {down}, and not in the local hub cache" if down else first
    cause = cause or type(error).__name__
    return ValueError(
        f"{key}={source!r}: cannot load the {what} from the Hugging Face hub ({cause}). "
        "Offline (HF_HUB_OFFLINE=1, or the hub unreachable), only models already in the hub "
        f"cache load: download it once where the hub is reachable (`hf download {source}`), or "
        "give a local folder that holds it; check the id's spelling, and for a gated model "
        f"accept its license on the hub and log in ({LOGIN})"
    )


def _reason(e: OSError) -> str:
    if isinstance(e, socket.gaierror):
        return "host name not resolved (no network?)"
    if isinstance(e, TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    return (e.strerror or str(e) or type(e).__name__).lower()
