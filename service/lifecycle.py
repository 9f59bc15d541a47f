"""How a server stops: gracefully on a signal, or at once after a fatal device error.

A :class:`Lifecycle` holds the serving status that health checks report and the request
to stop that ``serve`` waits for.

- SIGINT/SIGTERM (``request_stop``): health turns NOT_SERVING, new calls are refused and
  calls in flight get ``shutdown_grace_s`` to finish; the process exits 0.
- An unrecoverable device error (``fatal``; an engine raised
  :class:`~geonear.service.engines.base.DeviceLost`): no later call on that device can
  succeed, and only a new process gets a new CUDA context. Health turns NOT_SERVING at
  once, the failing call and every new one are answered UNAVAILABLE (the interceptor),
  calls in flight get at most ``FATAL_GRACE_S``, and the process exits with
  ``EXIT_DEVICE_LOST`` so that a supervisor (systemd ``Restart=on-failure``, a Kubernetes
  restart policy) starts it again. The new process reloads every dataset from the data
  directory: each acknowledged change was on disk before it was acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

if TYPE_CHECKING:
    from geonear.service.metrics import Metrics

log = logging.getLogger("geonear.lifecycle")

#: Exit status after a fatal device error: sysexits' EX_TEMPFAIL, "try again later".
EXIT_DEVICE_LOST = 75
#: Most seconds calls in flight get after a fatal device error: they can only fail.
FATAL_GRACE_S = 1.0
#: Seconds beyond the grace after which the process exits even if a call is stuck in
#: device code (a hung kernel would otherwise keep the interpreter from exiting).
_EXIT_MARGIN_S = 10.0


class Lifecycle:
    """Serving status and the request to stop of one server.

    Parameters
    ----------
    health_servicer : grpc_health.v1.health.aio.HealthServicer
        Answers health checks; its status is set for "" and for each of ``services``.
    services : iterable of str
        Full names of the services whose status is reported besides the server's ("").
    loop : asyncio.AbstractEventLoop
        The server's event loop, which the health servicer belongs to.
    metrics : Metrics, optional
        Its ``geonear_up`` gauge follows the serving status.
    """

    def __init__(
        self,
        health_servicer: health.aio.HealthServicer,
        services: Iterable[str],
        loop: asyncio.AbstractEventLoop,
        metrics: Metrics | None = None,
    ) -> None:
        self.health = health_servicer
        self.loop = loop
        self.services = ("", *services)
        self.metrics = metrics
        #: Set by a signal or a fatal error; ``serve`` waits for it.
        self.stop_requested = threading.Event()
        #: 0, or ``EXIT_DEVICE_LOST`` once ``fatal`` was called.
        self.exit_code = 0
        #: Why the server failed (the first fatal error's message), or None.
        self.fatal_reason: str | None = None
        self._lock = threading.Lock()

    def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING to health checks (and ``geonear_up``)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        update = asyncio.run_coroutine_threadsafe(self._set_all(status), self.loop)
        if not self._on_loop():
            update.result()  # reported before this returns; on the loop it runs next
        if self.metrics is not None:
            self.metrics.state.serving = serving

    async def _set_all(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in self.services:
            await self.health.set(name, status)

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def request_stop(self, *_: object) -> None:
        """Begin a graceful stop; usable as a signal handler."""
        self.stop_requested.set()

    def fatal(self, reason: str) -> None:
        """The device is lost: report NOT_SERVING and end ``serve`` with EXIT_DEVICE_LOST.

        Safe to call from any thread and more than once; the first reason is kept.
        """
        with self._lock:
            if self.fatal_reason is not None:
                return
            self.fatal_reason = reason
            self.exit_code = EXIT_DEVICE_LOST
        self.set_serving(False)
        log.critical(
            "unrecoverable device error: %s; NOT_SERVING, exiting with status %d so that "
            "a supervisor restarts the server",
            reason,
            EXIT_DEVICE_LOST,
        )
        self.stop_requested.set()

    def refusal(self) -> str:
        """The message of an UNAVAILABLE answer after a fatal error."""
        return (
            f"the server lost its device ({self.fatal_reason}) and is restarting; "
            "retry once health checks report SERVING"
        )

    def grace_s(self, shutdown_grace_s: float) -> float:
        """Seconds calls in flight get to finish: shorter after a fatal error."""
        return min(shutdown_grace_s, FATAL_GRACE_S) if self.exit_code else shutdown_grace_s

    def force_exit_after(self, grace_s: float) -> None:
        """After a fatal error: exit with ``exit_code`` once the grace and a margin pass.

        Does nothing while no fatal error happened (a graceful stop waits for its calls).
        """
        if not self.exit_code:
            return
        seconds = grace_s + _EXIT_MARGIN_S

        def force_exit() -> None:
            log.error("calls still running %.1f s after the fatal error; exiting", seconds)
            logging.shutdown()
            os._exit(self.exit_code)

        timer = threading.Timer(seconds, force_exit)
        timer.daemon = True
        timer.start()
