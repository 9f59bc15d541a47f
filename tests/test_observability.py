"""Observability: Prometheus metrics, one log line per request, health during shutdown."""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from server_process import start_server

from geonear.clients.client import Client
from geonear.clients.errors import NotFound
from geonear.loaders.synthetic import uniform_points
from geonear.service.server import ServerParts, build_server
from geonear.service.settings import ServerSettings
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc


def _start(tmp_path: Path, **settings) -> ServerParts:
    parts = build_server(
        ServerSettings(
            host="127.0.0.1", port=0, data_dir=tmp_path / "data", backend="cpu", **settings
        )
    )
    parts.server.start()
    return parts


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_errors_latency_rows_and_datasets(tmp_path) -> None:
    parts = _start(tmp_path, metrics_port=0)
    try:
        lat, lon = uniform_points(500, seed=1)
        with Client(f"127.0.0.1:{parts.port}", timeout_s=30) as client:
            client.upload("pts", pa.table({"lat": lat, "lon": lon}))
            for _ in range(3):  # small queries: the client calls KnnCompact
                client.knn("pts", [0.0, 10.0], [0.0, 10.0], k=4)
            with pytest.raises(NotFound):
                client.knn("missing", 0.0, 0.0, k=1)
        assert parts.metrics_port
        m = _scrape(parts.metrics_port)
        assert m[("geonear_requests_total", (("code", "OK"), ("rpc", "KnnCompact")))] == 3
        assert m[("geonear_requests_total", (("code", "NOT_FOUND"), ("rpc", "KnnCompact")))] == 1
        assert m[("geonear_errors_total", (("code", "NOT_FOUND"), ("rpc", "KnnCompact")))] == 1
        assert ("geonear_errors_total", (("code", "OK"), ("rpc", "KnnCompact"))) not in m
        assert m[("geonear_request_duration_seconds_count", (("rpc", "KnnCompact"),))] == 4
        assert m[("geonear_request_duration_seconds_sum", (("rpc", "KnnCompact"),))] > 0
        assert m[("geonear_rows_total", (("rpc", "KnnCompact"),))] == 3 * 2 * 4
        assert m[("geonear_rows_total", (("rpc", "Upload"),))] == 500
        host_bytes = parts.store.get("pts").host_bytes
        assert m[("geonear_dataset_host_bytes", (("dataset", "pts"),))] == host_bytes
        assert m[("geonear_dataset_rows", (("dataset", "pts"),))] == 500
        assert m[("geonear_dataset_device_bytes", (("dataset", "pts"),))] == 0
        assert m[("geonear_datasets", ())] == 1
        assert m[("geonear_gpu_pool_used_bytes", ())] == 0  # the CPU engine has no pool
        assert m[("geonear_up", (("backend", "cpu"), ("engine", "cpu")))] == 1
        assert m[("geonear_requests_in_flight", ())] == 0
    finally:
        parts.stop(None)


def test_a_failed_call_is_counted_before_its_client_sees_the_status(tmp_path) -> None:
    # grpc.aio's abort sends the status at once: a call answered with an error must be
    # counted before that, on the event loop (KnnCompact) and on a thread (Knn) alike.
    parts = _start(tmp_path)
    registry = parts.metrics.registry
    many = np.zeros(1000)  # 1000 queries x k=5 rows: more than a compact answer holds
    try:
        with Client(f"127.0.0.1:{parts.port}", timeout_s=30) as client:
            for i in range(1, 26):
                for rpc, lat in (("KnnCompact", 0.0), ("Knn", many)):
                    with pytest.raises(NotFound):
                        client.knn("missing", lat, lat, k=5)
                    labels = {"rpc": rpc, "code": "NOT_FOUND"}
                    assert registry.get_sample_value("geonear_errors_total", labels) == i
    finally:
        parts.stop(None)


def test_one_log_line_per_request(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="geonear.requests")
    parts = _start(tmp_path)
    try:
        lat, lon = uniform_points(100, seed=2)
        with Client(f"127.0.0.1:{parts.port}", timeout_s=30) as client:
            client.upload("pts", pa.table({"lat": lat, "lon": lon}))
            client.knn("pts", 0.0, 0.0, k=3)
            with pytest.raises(NotFound):
                client.info("nope")
    finally:
        parts.stop(None)
    lines = [r.getMessage() for r in caplog.records if r.name == "geonear.requests"]
    # The client looks up the names there are to suggest one after a NOT_FOUND.
    assert len(lines) == 4
    upload, knn, info, names = lines
    assert names.startswith("rpc=ListDatasets ")
    assert upload.startswith("rpc=Upload dataset=pts rows=100 duration_ms=")
    assert upload.split(" status=")[1].startswith("OK")
    assert knn.startswith("rpc=KnnCompact dataset=pts rows=3 ")
    assert "status=NOT_FOUND" in info and "dataset=nope" in info
    assert all("peer=ipv4:127.0.0.1:" in line for line in lines)


def test_the_request_log_can_be_turned_off(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="geonear.requests")
    parts = _start(tmp_path, log_requests=False)
    try:
        with Client(f"127.0.0.1:{parts.port}", timeout_s=30) as client:
            client.datasets()
    finally:
        parts.stop(None)
    assert not [r for r in caplog.records if r.name == "geonear.requests"]


def test_health_goes_not_serving_at_shutdown_while_calls_finish(tmp_path) -> None:
    parts = _start(tmp_path)
    lat, lon = uniform_points(40_000, seed=3)
    target = f"127.0.0.1:{parts.port}"
    with Client(target, timeout_s=60) as client:
        client.upload("big", pa.table({"lat": lat, "lon": lon}))
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.GeoNearStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    check = health_pb2.HealthCheckRequest(service="geonear.v1.GeoNear")
    assert health.Check(check, timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    # A call in flight when shutdown begins finishes within the grace period.
    result: dict[str, object] = {}

    def run_kmeans() -> None:
        try:
            result["messages"] = list(
                stub.KMeans(pb.KMeansRequest(dataset="big", k=50, n_init=3), timeout=120)
            )
        except grpc.RpcError as exc:
            result["error"] = exc.code()

    worker = threading.Thread(target=run_kmeans)
    worker.start()
    while parts.admission.in_flight == 0 and worker.is_alive():
        time.sleep(0.001)
    parts.set_serving(False)
    assert health.Check(check, timeout=30).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == (
        health_pb2.HealthCheckResponse.NOT_SERVING
    )
    parts.stop(grace_s=60)
    worker.join(120)
    channel.close()
    assert "error" not in result
    messages = result["messages"]
    assert isinstance(messages, list) and messages[0].summary.n_iter >= 1


def test_sigterm_stops_the_server_process_gracefully(tmp_path) -> None:
    import signal

    log_path = tmp_path / "server.log"
    args = ["-m", "geonear", "serve", "--port", "0", "--memory-only", "--backend", "cpu"]
    proc, _ = start_server([*args, "--metrics-port", "0"], log_path, tmp_path)
    try:
        assert "metrics on http://127.0.0.1:" in log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert "shutting down: NOT_SERVING" in text
    assert text.rstrip().endswith("stopped")
