"""Prometheus metrics of one server, served on ``--metrics-port`` at ``/metrics``.

Per call (recorded by :mod:`geonear.service.interceptor`):

- ``geonear_requests_total{rpc, code}``: calls finished, by RPC and status code name;
- ``geonear_errors_total{rpc, code}``: the same, counting only calls that did not end OK;
- ``geonear_request_duration_seconds{rpc}``: latency histogram, seconds;
- ``geonear_rows_total{rpc}``: rows returned by queries (matrix cells for
  DistanceMatrix, labels for KMeans), received by Upload, deleted by DeleteRows.

Read when scraped, so they cost nothing per call:

- ``geonear_requests_in_flight``: calls running now (what max_concurrent_rpcs caps);
- ``geonear_datasets``, ``geonear_dataset_rows{dataset}``,
  ``geonear_dataset_host_bytes{dataset}``, ``geonear_dataset_device_bytes{dataset}``;
- ``geonear_gpu_pool_used_bytes``, ``geonear_gpu_pool_total_bytes``: the engine's device
  memory pool (0 on the CPU backend);
- ``geonear_up{backend, engine}``: 1 while serving, 0 once shutdown has begun.

Each server has its own registry, so several servers in one process (tests, notebooks)
do not collide.

When the server has bearer tokens (``--auth-tokens``), ``/metrics`` needs one as well,
of either scope, as ``Authorization: Bearer <token>`` (Prometheus: ``authorization`` in
the scrape config): the metrics name every dataset and its size. A scrape without a
token the server knows is answered 401. The endpoint is plain HTTP; keep its port
on a network the scraper alone reaches, as the token travels in clear.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from geonear.service.auth import TokenCheck, bearer_token
from geonear.service.engines import Engine
from geonear.service.store import DatasetStore

#: Latency buckets, seconds: 100 µs (a small KNN) to a minute (a large matrix).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class _StateCollector(Collector):
    """Gauges read from the store, the engine and the admission count at scrape time."""

    def __init__(
        self, store: DatasetStore, engine: Engine, in_flight: Callable[[], int], labels: dict
    ) -> None:
        self.store = store
        self.engine = engine
        self.in_flight = in_flight
        self.labels = labels
        self.serving = True

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("geonear_up", "1 while serving", labels=list(self.labels))
        up.add_metric(list(self.labels.values()), 1.0 if self.serving else 0.0)
        yield up
        yield GaugeMetricFamily(
            "geonear_requests_in_flight", "calls running now", value=self.in_flight()
        )
        datasets = self.store.datasets()
        yield GaugeMetricFamily("geonear_datasets", "datasets held", value=len(datasets))
        families = {
            "rows": GaugeMetricFamily(
                "geonear_dataset_rows", "rows of the current version", labels=["dataset"]
            ),
            "host": GaugeMetricFamily(
                "geonear_dataset_host_bytes", "host memory, index included", labels=["dataset"]
            ),
            "device": GaugeMetricFamily(
                "geonear_dataset_device_bytes", "device memory, index included", labels=["dataset"]
            ),
        }
        for d in datasets:
            families["rows"].add_metric([d.name], d.rows)
            families["host"].add_metric([d.name], d.host_bytes)
            families["device"].add_metric([d.name], d.index.device_bytes)
        yield from families.values()
        used, total = self.engine.memory_pool_bytes()
        yield GaugeMetricFamily(
            "geonear_gpu_pool_used_bytes", "device memory pool in use", value=used
        )
        yield GaugeMetricFamily(
            "geonear_gpu_pool_total_bytes", "device memory pool reserved", value=total
        )


class Metrics:
    """The metrics of one server and, once started, the HTTP endpoint serving them."""

    def __init__(
        self,
        store: DatasetStore,
        engine: Engine,
        backend: str,
        in_flight: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "geonear_requests", "calls finished", ["rpc", "code"], registry=self.registry
        )
        self.errors = Counter(
            "geonear_errors", "calls that did not end OK", ["rpc", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "geonear_request_duration_seconds",
            "call latency, seconds",
            ["rpc"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rows = Counter(
            "geonear_rows", "rows returned, received or deleted", ["rpc"], registry=self.registry
        )
        self.state = _StateCollector(
            store, engine, in_flight, {"backend": backend, "engine": engine.name}
        )
        self.registry.register(self.state)
        # Children by label values: labels() takes a lock and builds a key every time.
        self._children: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}
        self._children_lock = threading.Lock()
        self._http: Any = None

    def record(self, rpc: str, code: str, seconds: float, rows: int) -> None:
        """One finished call."""
        children = self._children.get((rpc, code))
        if children is None:
            with self._children_lock:
                children = (
                    self.requests.labels(rpc, code),
                    self.errors.labels(rpc, code) if code != "OK" else None,
                    self.latency.labels(rpc),
                    self.rows.labels(rpc),
                )
                self._children[(rpc, code)] = children
        requests, errors, latency, rows_counter = children
        requests.inc()
        if errors is not None:
            errors.inc()
        latency.observe(seconds)
        if rows:
            rows_counter.inc(rows)

    def serve_http(self, host: str, port: int, tokens: TokenCheck | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 picks a free port); returns the port.

        With ``tokens``, only to a scrape that sends one of them (module docstring).
        """
        app = make_wsgi_app(self.registry)
        if tokens is not None:
            app = _token_required(app, tokens)
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]

        class MetricsServer(ThreadingWSGIServer):
            address_family = family  # AF_INET6 for an IPv6 host

        server = make_server(str(address[0]), port, app, MetricsServer, _QuietHandler)
        threading.Thread(target=server.serve_forever, name="geonear-metrics", daemon=True).start()
        self._http = server
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _QuietHandler(WSGIRequestHandler):
    """Scrapes are not logged: one every few seconds says nothing."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


_CHALLENGE = [
    ("WWW-Authenticate", 'Bearer realm="geonear metrics"'),
    ("Content-Type", "text/plain; charset=utf-8"),
]


def _token_required(app: Callable[..., Any], tokens: TokenCheck) -> Callable[..., Any]:
    """``app`` for requests with a known bearer token; 401 for the others.

    ``TokenCheck.scope_of`` compares digests in constant time, as for gRPC calls.
    """

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        token = bearer_token([("authorization", environ.get("HTTP_AUTHORIZATION", ""))])
        if token is None or tokens.scope_of(token) is None:
            start_response("401 Unauthorized", _CHALLENGE)
            return [
                b"this server's metrics need a bearer token: send 'Authorization: Bearer "
                b"<token>' with a read or admin token of its --auth-tokens file\n"
            ]
        return app(environ, start_response)

    return guarded
