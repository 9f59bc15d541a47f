"""Where a call's time went, stage by stage, sent back in its trailing metadata.

A bulk call's stages (decoding the request, the engine's search, assembling the result,
Arrow IPC and protobuf encoding, sending) are timed as they run and returned to the
client in the ``geonear-timing`` trailer, written like HTTP's Server-Timing header::

    geonear-timing: decode;dur=0.41, search;dur=11.9, assemble;dur=3.2, encode;dur=2.5

(durations in milliseconds, summed over the slices of a streamed call). ``geonear bench
--served`` prints them beside the client's own stages; any gRPC client can read them
with :func:`geonear.wire.parse_timing`. The key and its parser are part of the wire
protocol, so they live in :mod:`geonear.wire`; this module times the stages. Timing
costs two ``perf_counter`` calls a stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

# Re-exported: the servicer names the trailer through this module.
from geonear.wire import TIMING_KEY as TIMING_KEY

T = TypeVar("T")


class StageTimes:
    """Seconds spent in each named stage of one call, in the order first seen."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, items: Iterable[T], name: str, *, nested: bool = False) -> Iterator[T]:
        """The items, the time spent making each one counted as stage ``name``; with
        ``nested``, less what stages timed inside it counted meanwhile."""
        iterator = iter(items)
        while True:
            inner = sum(self.seconds.values()) if nested else 0.0
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                elapsed = time.perf_counter() - start
                if nested:
                    elapsed -= sum(self.seconds.values()) - inner
                self.add(name, elapsed)
            yield item

    def header(self) -> str:
        """The trailer's value: ``name;dur=MS`` entries, comma-separated."""
        return ", ".join(f"{name};dur={s * 1e3:.3f}" for name, s in self.seconds.items())
