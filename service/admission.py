"""Admission: a cap on the calls running at once, and a share of it for uploads.

Beyond ``max_concurrent_rpcs`` a call is refused at once with RESOURCE_EXHAUSTED rather
than queued behind the others, so an overloaded server answers quickly and a client can
back off. The server's thread pool has two threads more than the cap, which answer
refusals and health checks while every admitted call is busy.

Uploads (the calls whose request is a stream) may hold at most ``max_concurrent_uploads``
of those slots (default: a quarter of them). A query's length is the server's work, but
an upload lasts as long as its client keeps the stream open: without a share of their
own, streams opened and left idle would take every slot and refuse every query of every
other client. Each upload is also ended once its client sends nothing for
``upload_idle_timeout_s`` (:mod:`geonear.service.interceptor`), so an idle stream gives
its slot back.

There is no limit per client. A per-peer rule would key on the peer's host, since each
connection has a port of its own, and the host is the wrong identity exactly where it
matters: every client of a sidecar, a proxy, a NAT or this machine (127.0.0.1) shares
one, while one client with many addresses has many. The upload share holds however the
clients are counted.
"""

from __future__ import annotations

import threading


class Admission:
    """Counts calls in flight against a limit, uploads also against their share of it.

    ``admit``/``leave`` bracket a call, with the same ``upload`` flag.
    """

    def __init__(self, limit: int, upload_limit: int | None = None) -> None:
        self.limit = limit
        self.upload_limit = limit if upload_limit is None else upload_limit
        self._in_flight = 0
        self._uploads = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def uploads_in_flight(self) -> int:
        return self._uploads

    def admit(self, upload: bool = False) -> str | None:
        """Take a slot: None once admitted, else the message to refuse the call with."""
        with self._lock:
            if self._in_flight >= self.limit:
                return (
                    f"the server is running max_concurrent_rpcs={self.limit} calls already "
                    "(setting GEONEAR_MAX_CONCURRENT_RPCS); retry with backoff"
                )
            if upload:
                if self._uploads >= self.upload_limit:
                    return (
                        f"the server is running max_concurrent_uploads={self.upload_limit} "
                        "uploads already (setting GEONEAR_MAX_CONCURRENT_UPLOADS); retry "
                        "with backoff"
                    )
                self._uploads += 1
            self._in_flight += 1
            return None

    def leave(self, upload: bool = False) -> None:
        with self._lock:
            self._in_flight -= 1
            if upload:
                self._uploads -= 1
