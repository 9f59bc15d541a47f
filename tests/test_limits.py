"""Limits and admission: each refusal is RESOURCE_EXHAUSTED naming the limit and its
setting, ServerInfo reports every limit, and long work stops when its caller goes away.

"Work stopped" is observed as the server's count of calls in flight returning to zero
long before the work could have finished on its own; no test asserts a duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from geonear.clients.client import Client
from geonear.clients.errors import ResourceExhausted
from geonear.loaders.synthetic import uniform_points
from geonear.service.server import ServerParts, build_server
from geonear.service.settings import Limits, ServerSettings
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import ipc_stream_bytes, table_to_messages

MIB = 1024 * 1024


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerParts]]:
    started: list[ServerParts] = []

    def make(**limits: int) -> ServerParts:
        settings = ServerSettings(
            host="127.0.0.1",
            port=0,
            data_dir=tmp_path / f"data{len(started)}",
            backend="cpu",
            limits=Limits(**limits),
        )
        parts = build_server(settings)
        parts.server.start()
        started.append(parts)
        return parts

    yield make
    for parts in started:
        parts.stop(None)


def _target(parts: ServerParts) -> str:
    return f"127.0.0.1:{parts.port}"


def _points(n: int, seed: int = 0) -> pa.Table:
    lat, lon = uniform_points(n, seed=seed)
    return pa.table({"lat": lat, "lon": lon})


def _wait_for(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Poll until ``condition()``; the bound only keeps a broken server from hanging CI."""
    stop = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > stop:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def test_server_info_reports_every_limit(make_server) -> None:
    parts = make_server(
        max_k=7,
        max_concurrent_rpcs=3,
        max_dataset_host_bytes=123_456_789,
        max_dataset_device_bytes=987_654_321,
        max_message_bytes=8 * MIB,
    )
    with Client(_target(parts), timeout_s=30) as client:
        limits = client.server_info().limits
    assert limits.max_k == 7
    assert limits.max_concurrent_rpcs == 3
    assert limits.max_dataset_host_bytes == 123_456_789
    assert limits.max_dataset_device_bytes == 987_654_321
    assert limits.max_message_bytes == 8 * MIB
    assert limits.max_upload_rows == Limits().max_upload_rows
    assert limits.max_query_points == Limits().max_query_points
    assert limits.max_matrix_cells == Limits().max_matrix_cells


def test_default_host_budget_is_three_quarters_of_memory(make_server) -> None:
    parts = make_server()
    with Client(_target(parts), timeout_s=30) as client:
        reported = client.server_info().limits.max_dataset_host_bytes
    assert reported == Limits().dataset_host_bytes() > 0


def test_a_request_message_above_max_message_bytes_names_the_setting(make_server) -> None:
    parts = make_server(max_message_bytes=4 * MIB)
    big = _points(300_000)  # 4.8 MB of Arrow in one message
    with Client(_target(parts), timeout_s=30) as client:
        client.upload("small", _points(100))
        query = pb.KnnRequest(
            dataset="small", queries=pb.Points(arrow_ipc=ipc_stream_bytes(big)), k=1
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(client._stub.Knn(query))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_message_bytes=4194304" in refused.value.details()
        assert "GEONEAR_MAX_MESSAGE_BYTES" in refused.value.details()

        def one_big_batch() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(header=pb.UploadHeader(dataset="big"))
            for message in table_to_messages(big, batch_bytes=1 << 30):
                yield pb.UploadRequest(data=message)

        with pytest.raises(grpc.RpcError) as upload_refused:
            client._stub.Upload(one_big_batch())
        assert upload_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "GEONEAR_MAX_MESSAGE_BYTES" in upload_refused.value.details()
        # the same rows in batches under the limit are fine, and nothing else changed
        assert client.upload("big", big).rows == 300_000
        assert client.info("small").version == 1


def test_the_host_memory_budget_refuses_what_does_not_fit(make_server) -> None:
    parts = make_server(max_dataset_host_bytes=600_000)
    with Client(_target(parts), timeout_s=30) as client:
        first = client.upload("a", _points(5_000))
        assert 0 < first.host_bytes < 600_000
        with pytest.raises(ResourceExhausted) as refused:
            client.upload("b", _points(20_000, seed=1))
        message = refused.value.message
        assert "max_dataset_host_bytes=600000" in message
        assert "GEONEAR_MAX_DATASET_HOST_BYTES" in message
        assert [d.name for d in client.datasets()] == ["a"]
        # replacing a dataset counts its new size instead of its old one
        assert client.upload("a", _points(6_000, seed=2), mode="replace").rows == 6_000
        with pytest.raises(ResourceExhausted):
            client.upload("a", _points(20_000), mode="append")
        assert client.info("a").rows == 6_000
    assert parts.store.host_bytes() <= 600_000


@pytest.mark.parametrize(
    ("limits", "call", "words"),
    [
        (
            {"max_k": 4},
            lambda c: c.knn("pts", 0.0, 0.0, k=5),
            ("max_k=4", "GEONEAR_MAX_K"),
        ),
        (
            {"max_k": 4},
            lambda c: c.kmeans("pts", k=5),
            ("max_k=4", "GEONEAR_MAX_K"),
        ),
        (
            {"max_matrix_cells": 999},
            lambda c: c.distance_matrix([0.0], [0.0], name="pts"),
            ("max_matrix_cells=999", "GEONEAR_MAX_MATRIX_CELLS"),
        ),
        (
            {"max_query_points": 10},
            lambda c: c.knn("pts", np.zeros(11), np.zeros(11), k=1),
            ("max_query_points=10", "GEONEAR_MAX_QUERY_POINTS"),
        ),
        (
            {"max_upload_rows": 999},
            lambda c: c.upload("more", _points(1000)),
            ("max_upload_rows=999", "GEONEAR_MAX_UPLOAD_ROWS"),
        ),
    ],
    ids=["knn k", "k-means k", "matrix cells", "query points", "upload rows"],
)
def test_each_limit_refusal_names_the_limit_and_its_setting(
    make_server, limits, call, words
) -> None:
    parts = make_server(**limits)
    with Client(_target(parts), timeout_s=30) as client:
        client.upload("pts", _points(1000) if "max_upload_rows" not in limits else _points(999))
        with pytest.raises(ResourceExhausted) as refused:
            call(client)
        for word in words:
            assert word in refused.value.message
        assert [d.name for d in client.datasets()] == ["pts"]
        assert client.knn("pts", 0.0, 0.0, k=1).shape[0] == 1


# -- concurrency and deadlines -------------------------------------------------------------
def _long_kmeans() -> pb.KMeansRequest:
    # Minutes of work if nothing stops it: many restarts of a large k, never converging
    # early (tol=0 still stops at a fixed point, so n_init carries the length).
    return pb.KMeansRequest(dataset="big", k=400, n_init=1000, max_iter=1000, tol=0.0)


@pytest.fixture
def busy_server(make_server) -> ServerParts:
    parts = make_server(max_concurrent_rpcs=2)
    with Client(_target(parts), timeout_s=60) as client:
        client.upload("big", _points(40_000))
    return parts


def test_calls_beyond_max_concurrent_rpcs_are_refused_at_once(busy_server) -> None:
    parts = busy_server
    with grpc.insecure_channel(_target(parts)) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        running = [stub.KMeans(_long_kmeans()) for _ in range(2)]
        _wait_for(lambda: parts.admission.in_flight == 2, "two calls admitted")
        with pytest.raises(grpc.RpcError) as refused:
            stub.ServerInfo(pb.ServerInfoRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent_rpcs=2" in refused.value.details()
        assert "GEONEAR_MAX_CONCURRENT_RPCS" in refused.value.details()
        # health checks are not counted and still answered
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        for call in running:
            call.cancel()
        # cancelling stops the k-means between iterations, freeing both slots
        _wait_for(lambda: parts.admission.in_flight == 0, "cancelled k-means stopped")
        assert stub.ServerInfo(pb.ServerInfoRequest(), timeout=30).backend == "cpu"


def test_kmeans_stops_when_its_deadline_passes(busy_server) -> None:
    parts = busy_server
    with grpc.insecure_channel(_target(parts)) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        with pytest.raises(grpc.RpcError) as expired:
            list(stub.KMeans(_long_kmeans(), timeout=0.5))
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_for(lambda: parts.admission.in_flight == 0, "k-means past its deadline stopped")
        codes = {
            s.labels["code"]
            for m in parts.metrics.registry.collect()
            if m.name == "geonear_requests"
            for s in m.samples
            if s.labels.get("rpc") == "KMeans" and s.name.endswith("_total")
        }
        assert codes <= {"DEADLINE_EXCEEDED", "CANCELLED"} and codes


def test_a_distance_matrix_stops_when_its_deadline_passes(busy_server) -> None:
    parts = busy_server
    lat, lon = uniform_points(40_000, seed=5)
    request = pb.DistanceMatrixRequest(
        queries=pb.Points(arrow_ipc=ipc_stream_bytes(pa.table({"lat": lat, "lon": lon}))),
        dataset="big",
    )
    with grpc.insecure_channel(_target(parts)) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        with pytest.raises(grpc.RpcError) as expired:
            for _ in stub.DistanceMatrix(request, timeout=1.0):
                pass
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # 1.6e9 cells would take minutes; the server stops between tiles
        _wait_for(lambda: parts.admission.in_flight == 0, "matrix past its deadline stopped")
        assert stub.ServerInfo(pb.ServerInfoRequest(), timeout=30).backend == "cpu"
