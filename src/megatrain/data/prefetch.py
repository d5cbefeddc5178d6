"""A bounded prefetch: items made on one worker thread, a fixed number ahead, yielded in order.

Used by the loader for micro-batches with images, whose pixels are decoded and processed on the
worker while the training thread runs the previous step. The order is the input order (one
worker, results taken first-in first-out), so the stream is identical to making the items on the
calling thread; an exception raised by `make` is raised at the item's turn. Closing the iterator
(or dropping it) cancels what is queued and waits for the one item in progress.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

DEPTH = 2
"""Items made ahead of the one the consumer holds: memory for two micro-batches of pixels."""


def prefetched(make: Callable[[T], R], items: Iterable[T], *, depth: int = DEPTH) -> Iterator[R]:
    """`make(item)` for each of `items`, in order, up to `depth` of them computed ahead."""
    assert depth >= 1, depth
    source = iter(items)
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-prefetch") as pool:
        try:
            for item in source:
                pending.append(pool.submit(make, item))
                if len(pending) > depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
