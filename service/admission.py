"""Admission: a cap on the calls running at once.

Beyond ``max_concurrent_rpcs`` a call is refused at once with RESOURCE_EXHAUSTED rather
than queued behind the others, so an overloaded server answers quickly and a client can
back off. The server's thread pool has two threads more than the cap, which answer
refusals and health checks while every admitted call is busy.
"""

from __future__ import annotations

import threading


class Admission:
    """Counts calls in flight against a limit; ``try_enter``/``leave`` bracket a call."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def try_enter(self) -> bool:
        with self._lock:
            if self._in_flight >= self.limit:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def refusal(self) -> str:
        return (
            f"the server is running max_concurrent_rpcs={self.limit} calls already "
            "(setting GEONEAR_MAX_CONCURRENT_RPCS); retry with backoff"
        )
