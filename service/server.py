"""Building and running the gRPC server.

``create_server(settings)`` returns ``(server, port, store)`` with the servicer, health
checking and reflection registered; tests bind port 0 and use the port returned.
``serve(settings)`` runs it until SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from geonear.service.engines import Engine, EngineUnavailable, create_engine, gpu_available
from geonear.service.host_memory import tune_allocator
from geonear.service.servicer import GeoNearServicer
from geonear.service.settings import ServerSettings
from geonear.service.store import DatasetStore
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

log = logging.getLogger("geonear.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GeoNear"].full_name


def select_engine(settings: ServerSettings) -> tuple[Engine, str]:
    """The engine for ``--backend``/``--engine`` and the backend name (cpu or gpu).

    auto: the GPU engine when CuPy sees a working device, else the CPU engine.
    gpu: the GPU engine or EngineUnavailable saying why not.
    """
    radius = settings.earth_radius_m
    if settings.engine:
        engine = create_engine(settings.engine, radius)
        return engine, engine.device_kind
    if settings.backend == "cpu":
        return create_engine("cpu", radius), "cpu"
    ok, why = gpu_available()
    if settings.backend == "gpu" and not ok:
        raise EngineUnavailable(f"--backend gpu was asked for, but {why}")
    if ok:
        try:
            return create_engine("gpu", radius), "gpu"
        except EngineUnavailable as exc:
            if settings.backend == "gpu":
                raise
            log.warning("GPU engine unavailable (%s); using the CPU engine", exc)
    else:
        log.info("no usable GPU (%s); using the CPU engine", why)
    return create_engine("cpu", radius), "cpu"


def create_server(settings: ServerSettings) -> tuple[grpc.Server, int, DatasetStore]:
    """A started-but-not-yet-serving server bound to ``settings.host:settings.port``."""
    engine, backend = select_engine(settings)
    engine.warm_up()
    store = DatasetStore(engine, settings.data_dir)
    skipped = store.load_persisted()
    if skipped:
        log.error("datasets not reloaded: %s", ", ".join(skipped))
    if settings.demo:
        _load_demo(store)
    limit = settings.limits.max_message_bytes
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=settings.max_workers, thread_name_prefix="geonear-rpc"
        ),
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_GeoNearServicer_to_server(GeoNearServicer(store, settings, backend), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    if ":" in settings.host and not settings.host.startswith("["):
        address = f"[{settings.host}]:{settings.port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    log.info(
        "engine %s (%s backend) on %s; earth radius %.1f m",
        engine.name,
        backend,
        engine.describe_device(),
        engine.earth_radius_m,
    )
    return server, port, store


def _load_demo(store: DatasetStore) -> None:
    from geonear.loaders.bundled import BUNDLED
    from geonear.service.validation import normalise_upload

    for name, load in BUNDLED.items():
        if name not in {d.name for d in store.datasets()}:
            store.upload(name, "create", normalise_upload(load()))


def serve(settings: ServerSettings) -> None:
    """Run the server until SIGINT or SIGTERM, then stop gracefully."""
    tune_allocator()
    server, port, _ = create_server(settings)
    # Handlers go in before the address is announced: a SIGTERM right after the
    # "listening" line must still stop the server gracefully.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    if not settings.is_loopback():
        log.warning(
            "listening on %s without TLS or tokens: anyone who can reach it can "
            "read and change data",
            settings.host,
        )
    log.info("geonear listening on %s:%d", settings.host, port)
    stop.wait()
    log.info("shutting down")
    server.stop(grace=5).wait()
