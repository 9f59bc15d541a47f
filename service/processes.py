"""Serving one port from several worker processes (``geonear serve --processes N``).

One Python process answers a few thousand calls per second, whatever the engine (the
health check alone tops out there; docs/benchmarks.md). On a host with cores to spare,
N processes bound to the same port with SO_REUSEPORT, the pattern of gRPC's
multiprocessing example, let the kernel spread connections over them.

Each worker loads every dataset of the data directory and holds its own copy, so host
memory is N times a single process's (ServerInfo reports ``worker_processes``). Datasets
are read-only while several processes serve: they would otherwise diverge. Change them
with a single-process server on the same data directory, then restart. ``--demo``
writes the bundled sets to the data directory before the workers start.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
from contextlib import closing
from typing import Any

from geonear.service.settings import ServerSettings

log = logging.getLogger("geonear.server")


def _reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket holding the port while workers bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    return sock


def _worker(settings_json: str, index: int, count: int, ready: Any, level: int) -> None:
    from geonear.service.server import serve

    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s worker {index}: %(message)s"
    )
    serve(ServerSettings.model_validate_json(settings_json), worker=(index, count), ready=ready)


def serve_processes(settings: ServerSettings) -> None:
    """Run ``settings.processes`` workers on one port until SIGINT or SIGTERM."""
    if settings.data_dir is None:
        raise ValueError("--processes needs a data directory: every worker loads it at start")
    if settings.demo:
        _write_demo(settings)
    count = settings.processes
    with closing(_reserve_port(settings.host, settings.port)) as reserved:
        port = reserved.getsockname()[1]
        worker_settings = settings.model_copy(update={"port": port, "demo": False})
        context = multiprocessing.get_context("spawn")
        ready = context.Queue()
        workers = [
            context.Process(
                target=_worker,
                args=(
                    worker_settings.model_dump_json(),
                    i,
                    count,
                    ready,
                    logging.getLogger().getEffectiveLevel(),
                ),
                name=f"geonear-worker-{i}",
            )
            for i in range(count)
        ]
        for process in workers:
            process.start()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        started = 0
        while started < count and not stop.is_set():
            try:
                ready.get(timeout=0.5)
                started += 1
            except Exception:  # queue.Empty: check that nobody died while starting
                if any(p.exitcode is not None for p in workers):
                    stop.set()
    if started == count:
        log.info("geonear listening on %s:%d (%d worker processes)", settings.host, port, count)
    while not stop.wait(0.5):
        if any(p.exitcode is not None for p in workers):
            log.error("a worker process exited; stopping the others")
            break
    for process in workers:
        if process.exitcode is None:
            process.terminate()  # SIGTERM: each worker stops gracefully
    for process in workers:
        process.join(settings.shutdown_grace_s + 15)
    codes = [p.exitcode or 0 for p in workers]
    if started < count or any(codes):
        raise SystemExit(max([1, *codes]) if started < count else max(codes))


def _write_demo(settings: ServerSettings) -> None:
    """Write the bundled data sets to the data directory with a single-process store."""
    from geonear.service.engines import create_engine
    from geonear.service.server import _load_demo
    from geonear.service.store import DatasetStore

    store = DatasetStore(
        create_engine("cpu", settings.earth_radius_m), settings.data_dir, settings.limits
    )
    store.load_persisted()
    _load_demo(store)
