"""Work ahead of the sender: the next slice of a streamed answer is made while this one goes out.

A large Knn or Radius answer is searched, assembled and encoded slice by slice; sending a
slice costs about as much as making it, so ``prefetched`` makes slice i+1 on a thread of
its own while the caller sends slice i. Memory stays bounded by ``depth`` slices waiting.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetched(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """The items of ``items``, each computed on a worker thread up to ``depth`` ahead.

    An exception of ``items`` is raised here, at the item where it happened. Closing
    this generator (the caller stopped early) stops the worker after the item it is
    making and closes ``items``.
    """
    ready: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(value: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(item):
                    break
            else:
                put(_DONE)
        except BaseException as exc:  # handed to the caller, raised there
            put(_Failed(exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    worker = threading.Thread(target=work, name="geonear-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            value = ready.get()
            if value is _DONE:
                return
            if isinstance(value, _Failed):
                raise value.error
            yield value  # type: ignore[misc]
    finally:
        stop.set()
        worker.join()
