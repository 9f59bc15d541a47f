"""Building and running the gRPC server.

``create_server(settings)`` returns ``(server, port, store)`` with the servicer, health
checking and reflection registered; tests bind port 0 and use the port returned.
``build_server(settings)`` returns the same and what runs beside it (health, admission,
metrics; :class:`ServerParts`). ``serve(settings)`` runs it until SIGINT/SIGTERM.

The server is a ``grpc.aio`` server on an event loop of its own thread
(:class:`LoopServer`, which callers drive synchronously). KnnCompact and RadiusCompact,
the small-query RPCs, run on the loop and await their batch; every other RPC runs on
the server's thread pool as a plain function. Measured on a 2-core host, the same
single-point KNN load gets 1.4x the requests/s of a thread-pool server, because a
request no longer hands the GIL to a thread and back while it waits for its batch
(docs/benchmarks.md, "Small queries").

Health checks report SERVING while the server can serve, and NOT_SERVING only when it
cannot: from the start of shutdown (a signal) and after a fatal device error, never to
come back in this process (:mod:`geonear.service.lifecycle`). A server whose admission
cap is full still serves: it refuses what does not fit at once with RESOURCE_EXHAUSTED
and takes calls again as slots free up, and uploads cannot hold every slot
(:mod:`geonear.service.admission`). Reporting NOT_SERVING for that would have a load
balancer move the same load onto the other servers and leave this one idle.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Coroutine
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from geonear.allocator import tune_allocator
from geonear.service.admission import Admission
from geonear.service.auth import TokenCheck, load_tokens
from geonear.service.engines import Engine, EngineUnavailable, create_engine, gpu_available
from geonear.service.interceptor import ServerInterceptor
from geonear.service.lifecycle import Lifecycle
from geonear.service.metrics import Metrics
from geonear.service.servicer import GeoNearServicer
from geonear.service.settings import ServerSettings
from geonear.service.store import DatasetStore
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import serialized

log = logging.getLogger("geonear.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GeoNear"].full_name


def select_engine(settings: ServerSettings) -> tuple[Engine, str]:
    """The engine for ``--backend``/``--engine``/``--dask-*`` and the backend's name.

    auto: the GPU engine when CuPy sees a working device, else the CPU engine.
    gpu: the GPU engine or EngineUnavailable saying why not.
    With a Dask scheduler or local workers: the Dask engine, its workers indexing with
    the GPU engine on GPU hosts (unless --backend cpu) and the CPU engine otherwise.
    """
    radius = settings.earth_radius_m
    if settings.engine:
        engine = create_engine(settings.engine, radius)
        return engine, engine.device_kind
    ok, why = gpu_available()
    if settings.backend == "gpu" and not ok:
        raise EngineUnavailable(f"--backend gpu was asked for, but {why}")
    if settings.dask_scheduler or settings.dask_local_workers:
        worker_engine = "gpu" if ok and settings.backend != "cpu" else "cpu"
        partitions = None if settings.data_dir is None else settings.data_dir / "_partitions"
        engine = create_engine(
            "dask",
            radius,
            scheduler=settings.dask_scheduler,
            local_workers=settings.dask_local_workers or 1,
            partition_dir=partitions,
            worker_engine=worker_engine,
        )
        return engine, f"dask-{worker_engine}"
    if settings.backend == "cpu":
        return create_engine("cpu", radius), "cpu"
    if ok:
        try:
            gpu = create_engine(
                "gpu",
                radius,
                pool_size_bytes=settings.gpu_pool_size_bytes,
                managed_memory=settings.managed_memory,
            )
            return gpu, "gpu"
        except EngineUnavailable as exc:
            if settings.backend == "gpu":
                raise
            log.warning("GPU engine unavailable (%s); using the CPU engine", exc)
    else:
        log.info("no usable GPU (%s); using the CPU engine", why)
    return create_engine("cpu", radius), "cpu"


class EventLoopThread:
    """An asyncio event loop running on a daemon thread of its own."""

    def __init__(self, name: str = "geonear-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` on the loop and return its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class LoopServer:
    """A grpc.aio server on its event-loop thread, with a synchronous face.

    ``start()``, ``stop(grace)`` (which returns an Event, set once stopped, as
    ``grpc.Server.stop`` does) and ``add_insecure_port``/``add_secure_port``; ``aio``
    is the grpc.aio server itself, for registering servicers.
    """

    def __init__(
        self, loop: EventLoopThread, server: grpc.aio.Server, pool: futures.ThreadPoolExecutor
    ) -> None:
        self._loop = loop
        self.aio = server
        self._pool = pool
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    def add_insecure_port(self, address: str) -> int:
        return int(self.aio.add_insecure_port(address))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return int(self.aio.add_secure_port(address, credentials))

    def start(self) -> None:
        self._loop.run(self.aio.start())

    def stop(self, grace: float | None = None) -> threading.Event:
        """Refuse new calls, give calls in flight ``grace`` seconds, then end them."""
        with self._stop_lock:
            if not self._stopped.is_set():
                self._loop.run(self.aio.stop(grace))
                self._loop.close()
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._stopped.set()
        return self._stopped


@dataclass
class ServerParts:
    """A built server and what runs beside it.

    Attributes
    ----------
    server : LoopServer
        Bound, not yet started.
    port : int
        The port bound (the one picked when the settings say 0).
    store : DatasetStore
    health : health.HealthServicer
        Serving status of "" and the GeoNear service; NOT_SERVING once shutdown begins
        or the device is lost, never because admission is full (module docstring).
    admission : Admission
        Calls in flight against ``max_concurrent_rpcs``, uploads also against
        ``max_concurrent_uploads``.
    metrics : Metrics
    lifecycle : Lifecycle
        Serving status and the request to stop (a signal, or a fatal device error).
    metrics_port : int or None
        Port of the ``/metrics`` endpoint, when ``metrics_port`` is set.
    """

    server: LoopServer
    port: int
    store: DatasetStore
    health: health.aio.HealthServicer
    admission: Admission
    metrics: Metrics
    lifecycle: Lifecycle
    metrics_port: int | None = None
    settings: ServerSettings | None = None

    def set_serving(self, serving: bool) -> None:
        self.lifecycle.set_serving(serving)

    def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, refuse new calls, give in-flight ones ``grace_s`` to finish."""
        self.set_serving(False)
        self.server.stop(grace=grace_s).wait()
        self.metrics.stop_http()
        close = getattr(self.store.engine, "close", None)
        if close is not None:  # e.g. the dask engine's local cluster
            close()


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read {path}: {exc.strerror}") from exc


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings; mutual TLS when a client CA is given."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    client_ca = _read(settings.tls_client_ca) if settings.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key), _read(settings.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class _CaughtHandlers:
    """Stands in for a server while the generated code registers its method handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_geonear_service(servicer: GeoNearServicer, server: grpc.aio.Server) -> None:
    """The generated registration, each response serializer ``geonear.wire.serialized``:
    an ArrowData stream's messages may come encoded already (``EncodedArrowData``)."""
    caught = _CaughtHandlers()
    pb_grpc.add_GeoNearServicer_to_server(servicer, caught)
    handlers = {
        name: handler._replace(response_serializer=serialized)  # type: ignore[attr-defined]
        for name, handler in caught.handlers.items()
    }
    generic = grpc.method_handlers_generic_handler(caught.service, handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(caught.service, handlers)


def build_server(
    settings: ServerSettings, engine: Engine | None = None, worker: tuple[int, int] | None = None
) -> ServerParts:
    """A bound, not yet started server with everything beside it (see ServerParts).

    ``engine``, when given, is used instead of the one the settings select. ``worker``
    is (index, count) for one of several processes sharing the port (SO_REUSEPORT):
    its datasets are read-only and the data directory is left as it is.
    """
    tune_allocator()
    tokens = TokenCheck(load_tokens(settings.auth_tokens)) if settings.auth_tokens else None
    credentials = server_credentials(settings)
    if engine is None:
        engine, backend = select_engine(settings)
    else:
        backend = engine.device_kind
    engine.warm_up()
    limits = settings.limits
    store = DatasetStore(engine, settings.data_dir, limits)
    if worker is not None:
        store.read_only_reason = (
            f"this server runs {worker[1]} worker processes, which serve the data directory's "
            "datasets read-only; change datasets with a single-process server "
            "(without --processes) on the same data directory, then restart"
        )
    skipped = store.load_persisted()
    if skipped:
        log.error("datasets not reloaded: %s", ", ".join(skipped))
    if settings.demo:
        _load_demo(store)
    admission = Admission(limits.max_concurrent_rpcs, settings.upload_slots())
    metrics = Metrics(store, engine, backend, lambda: admission.in_flight)
    loop = EventLoopThread()
    health_servicer = health.aio.HealthServicer()
    lifecycle = Lifecycle(health_servicer, (SERVICE_NAME,), loop.loop, metrics)
    interceptor = ServerInterceptor(
        admission,
        max_message_bytes=limits.max_message_bytes,
        tokens=tokens,
        metrics=metrics,
        log_requests=settings.log_requests,
        lifecycle=lifecycle,
        upload_idle_timeout_s=settings.upload_idle_timeout_s,
    )
    # Each admitted call that is not on the event loop holds a thread while it runs;
    # two beyond the admission cap answer refusals while every admitted call is busy.
    threads = max(settings.max_workers, limits.max_concurrent_rpcs) + 2
    pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="geonear-rpc")
    loop.loop.set_default_executor(pool)  # what the loop's RPCs hand blocking work to
    options = [
        ("grpc.max_send_message_length", limits.max_message_bytes),
        # Twice the limit, so that geonear (not gRPC) refuses a message just above it
        # with a message naming the setting (see geonear.service.interceptor).
        ("grpc.max_receive_message_length", 2 * limits.max_message_bytes),
        ("grpc.so_reuseport", 1 if worker is not None else 0),
    ]

    async def make() -> grpc.aio.Server:
        return grpc.aio.server(
            migration_thread_pool=pool,
            interceptors=[interceptor],
            options=options,
        )

    server = LoopServer(loop, loop.run(make()), pool)
    servicer = GeoNearServicer(store, settings, backend, worker or (0, 1))
    add_geonear_service(servicer, server.aio)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server.aio)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server.aio,
    )
    address = f"{settings.host}:{settings.port}"
    if ":" in settings.host and not settings.host.startswith("["):
        address = f"[{settings.host}]:{settings.port}"
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    parts = ServerParts(
        server, port, store, health_servicer, admission, metrics, lifecycle, settings=settings
    )
    parts.set_serving(True)
    if settings.metrics_port is not None:
        # With tokens, scrapes need one too: the metrics name every dataset and its size.
        parts.metrics_port = metrics.serve_http(settings.host, settings.metrics_port, tokens)
        log.info("metrics on http://%s:%d/metrics", settings.host, parts.metrics_port)
    log.info(
        "engine %s (%s backend) on %s; earth radius %.1f m; %s; %s",
        engine.name,
        backend,
        engine.describe_device(),
        engine.earth_radius_m,
        ("mutual TLS" if settings.tls_client_ca else "TLS") if credentials else "plaintext",
        f"{len(tokens)} bearer token(s)" if tokens else "no tokens",
    )
    return parts


def create_server(settings: ServerSettings) -> tuple[LoopServer, int, DatasetStore]:
    """A started-but-not-yet-serving server bound to ``settings.host:settings.port``."""
    parts = build_server(settings)
    return parts.server, parts.port, parts.store


def _load_demo(store: DatasetStore) -> None:
    from geonear.loaders.bundled import BUNDLED
    from geonear.service.validation import normalise_upload

    for name, load in BUNDLED.items():
        if name not in {d.name for d in store.datasets()}:
            store.upload(name, "create", normalise_upload(load()))


def exposure_warning(settings: ServerSettings) -> str | None:
    """A warning when the server is reachable beyond this host without TLS or tokens."""
    if settings.is_loopback():
        return None
    missing = [
        what
        for what, present in (("TLS", settings.tls), ("tokens", settings.auth_tokens))
        if not present
    ]
    if not missing:
        return None
    consequence = {
        "TLS": "traffic, tokens included, can be read and changed on the way",
        "tokens": "anyone who can reach it can read and change data",
    }
    return (
        f"listening on {settings.host} without "
        + " or ".join(missing)
        + ": "
        + "; ".join(consequence[m] for m in missing)
    )


def serve(
    settings: ServerSettings,
    engine: Engine | None = None,
    worker: tuple[int, int] | None = None,
    ready: Any = None,
) -> None:
    """Run the server until SIGINT or SIGTERM, then stop gracefully.

    On a signal: health turns NOT_SERVING, new calls are refused, and calls in flight
    get ``shutdown_grace_s`` seconds to finish. After a fatal device error the same
    happens with a shorter grace, then ``SystemExit(EXIT_DEVICE_LOST)`` is raised so
    that a supervisor restarts the server (see ``geonear.service.lifecycle``).
    """
    if settings.processes > 1 and worker is None:
        from geonear.service.processes import serve_processes

        serve_processes(settings)
        return
    tune_allocator()
    parts = build_server(settings, engine, worker)
    parts.server.start()
    warning = exposure_warning(settings)
    if warning:
        log.warning(warning)
    # Handlers go in before the address is announced: a SIGTERM right after the
    # "listening" line must still stop the server gracefully.
    lifecycle = parts.lifecycle
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lifecycle.request_stop)
    if worker is None:
        log.info("geonear listening on %s:%d", settings.host, parts.port)
    else:
        log.info("worker %d of %d serving on port %d", worker[0], worker[1], parts.port)
        ready.put(worker[0])  # the parent announces the port once every worker serves
    lifecycle.stop_requested.wait()
    grace_s = lifecycle.grace_s(settings.shutdown_grace_s)
    log.info("shutting down: NOT_SERVING, %.1f s for calls in flight", grace_s)
    lifecycle.force_exit_after(grace_s)
    parts.stop(grace_s)
    log.info("stopped")
    if lifecycle.exit_code:
        raise SystemExit(lifecycle.exit_code)
