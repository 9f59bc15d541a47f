"""Fairness under hostile input: idle uploads cannot take every slot, refusals say why.

- Uploads have a share of ``max_concurrent_rpcs`` of their own, so streams a client
  opens and never finishes cannot keep anyone else's queries out; an upload that sends
  nothing for ``upload_idle_timeout_s`` is ended and stores nothing.
- With tokens configured, ``/metrics`` (which names datasets) needs one too.
- Each refused call gets its own denial's message, whatever was refused before it.
- DistanceMatrix refuses int and string ids together, as DeleteRows does.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from geonear.clients.client import Client
from geonear.loaders.synthetic import uniform_points
from geonear.service.server import ServerParts, build_server
from geonear.service.settings import Limits, ServerSettings
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import table_to_messages

ADMIN = "admin-token-0123456789abcdef"
READER = "read-token-0123456789abcdef"


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerParts]]:
    started: list[ServerParts] = []

    def make(**settings) -> ServerParts:
        parts = build_server(
            ServerSettings(
                host="127.0.0.1",
                port=0,
                data_dir=tmp_path / f"data{len(started)}",
                backend="cpu",
                **settings,
            )
        )
        parts.server.start()
        started.append(parts)
        return parts

    yield make
    for parts in started:
        parts.stop(None)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(f"admin {ADMIN} ops\nread {READER} dashboard\n")
    return path


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


def _stalled_upload(
    dataset: str, table: pa.Table, release: threading.Event
) -> Iterator[pb.UploadRequest]:
    """An upload that sends its header and some data, then nothing until ``release``."""
    yield pb.UploadRequest(header=pb.UploadHeader(dataset=dataset, mode=pb.REPLACE))
    for message in table_to_messages(table):
        yield pb.UploadRequest(data=message)
    release.wait()


# -- idle uploads ---------------------------------------------------------------------------
def test_idle_uploads_leave_queries_their_slots_and_end_after_the_idle_timeout(
    make_server,
) -> None:
    parts = make_server(limits=Limits(max_concurrent_rpcs=8), upload_idle_timeout_s=2.0)
    with Client(_target(parts), timeout_s=30) as owner:
        owner.upload("pts", _points(100))
    before = parts.store.get("pts")
    release = threading.Event()
    hog = grpc.insecure_channel(_target(parts))
    try:
        stub = pb_grpc.GeoNearStub(hog)
        idle = [
            stub.Upload.future(_stalled_upload("pts", _points(50, seed=i), release), timeout=120)
            for i in range(10)  # more than max_concurrent_rpcs
        ]
        # every stream is either admitted (and idle) or refused
        _wait_for(
            lambda: parts.admission.in_flight + sum(f.done() for f in idle) == len(idle),
            "every upload admitted or refused",
        )
        admitted = [f for f in idle if not f.done()]
        refused = [f for f in idle if f.done()]
        assert len(admitted) == 2  # a quarter of max_concurrent_rpcs
        for call in refused:
            assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_uploads=2" in call.details()
            assert "GEONEAR_MAX_CONCURRENT_UPLOADS" in call.details()

        # another client is served meanwhile, and health says so
        with Client(_target(parts), timeout_s=30) as other:
            assert other.knn("pts", 0.0, 0.0, k=3).shape[0] == 3
            assert [d.name for d in other.datasets()] == ["pts"]
        with grpc.insecure_channel(_target(parts)) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=30
            )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        # the idle uploads end with the documented status; the data is as it was
        for call in admitted:
            error = call.exception(timeout=60)
            assert isinstance(error, grpc.RpcError)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "upload_idle_timeout_s=2" in error.details()
            assert "GEONEAR_UPLOAD_IDLE_TIMEOUT_S" in error.details()
            assert "nothing was stored" in error.details()
        _wait_for(lambda: parts.admission.in_flight == 0, "idle uploads let go of their slots")
        after = parts.store.get("pts")
        assert (after.version, after.rows) == (before.version, before.rows) == (1, 100)
    finally:
        release.set()
        hog.close()
    # the freed slots take uploads again
    with Client(_target(parts), timeout_s=30) as owner:
        assert owner.upload("pts", _points(70), mode="replace").rows == 70


def test_an_upload_that_keeps_sending_is_not_idle(make_server) -> None:
    # Each message comes well within the idle timeout; the whole upload takes longer.
    parts = make_server(upload_idle_timeout_s=2.0)
    messages = list(table_to_messages(_points(800), batch_bytes=2_000))
    assert len(messages) >= 6

    def paced() -> Iterator[pb.UploadRequest]:
        yield pb.UploadRequest(header=pb.UploadHeader(dataset="pts"))
        for message in messages:
            time.sleep(0.4)
            yield pb.UploadRequest(data=message)

    with grpc.insecure_channel(_target(parts)) as channel:
        reply = pb_grpc.GeoNearStub(channel).Upload(paced(), timeout=60)
    assert reply.rows_received == parts.store.get("pts").rows == 800


def test_the_upload_share_must_leave_slots_for_queries() -> None:
    with pytest.raises(ValidationError, match="max_concurrent_uploads=4 must be below"):
        ServerSettings(limits=Limits(max_concurrent_rpcs=4), max_concurrent_uploads=4)
    settings = ServerSettings(limits=Limits(max_concurrent_rpcs=4), max_concurrent_uploads=3)
    assert settings.upload_slots() == 3
    assert ServerSettings(limits=Limits(max_concurrent_rpcs=512)).upload_slots() == 128
    assert ServerSettings(limits=Limits(max_concurrent_rpcs=1)).upload_slots() == 1


# -- tokens -----------------------------------------------------------------------------------
def _scrape(port: int, token: str | None) -> tuple[int, str, str | None]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode(), None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers.get("WWW-Authenticate")


def test_metrics_need_a_bearer_token_when_tokens_are_configured(make_server, token_file) -> None:
    parts = make_server(auth_tokens=token_file, metrics_port=0)
    with Client(_target(parts), timeout_s=30, token=ADMIN) as admin:
        admin.upload("secret_sites", _points(10))
    for token in (None, ADMIN[:-1] + "X", ""):
        status, body, challenge = _scrape(parts.metrics_port, token)
        assert status == 401
        assert challenge is not None and challenge.startswith("Bearer")
        assert "secret_sites" not in body
    for token in (READER, ADMIN):
        status, body, _ = _scrape(parts.metrics_port, token)
        assert status == 200
        assert 'geonear_dataset_rows{dataset="secret_sites"} 10.0' in body


def test_metrics_stay_open_without_tokens(make_server) -> None:
    parts = make_server(metrics_port=0)
    status, body, _ = _scrape(parts.metrics_port, None)
    assert status == 200 and "geonear_up" in body


def test_each_refused_call_gets_its_own_denial_message(make_server, token_file) -> None:
    parts = make_server(auth_tokens=token_file)
    missing = "authorization: Bearer <token>"
    unknown = "not one this server knows"
    with grpc.insecure_channel(_target(parts)) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        for token, words in (
            (None, missing),
            (ADMIN[:-1] + "X", unknown),
            (None, missing),
            (READER[:-1] + "X", unknown),
            (READER, None),
        ):
            metadata = [] if token is None else [("authorization", f"Bearer {token}")]
            if words is None:
                assert not stub.ListDatasets(
                    pb.ListDatasetsRequest(), metadata=metadata, timeout=30
                ).datasets
                continue
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListDatasets(pb.ListDatasetsRequest(), metadata=metadata, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert words in refused.value.details()


# -- distance matrix ------------------------------------------------------------------------
def test_distance_matrix_refuses_int_and_string_ids_together(make_server) -> None:
    parts = make_server()
    with Client(_target(parts), timeout_s=30) as client:
        client.upload("pts", _points(20))
    request = pb.DistanceMatrixRequest(
        queries=pb.Points(lat=[0.0], lon=[0.0]),
        dataset="pts",
        ids=pb.IdList(int_ids=[0, 1], string_ids=["a"]),
    )
    with grpc.insecure_channel(_target(parts)) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.DistanceMatrix(request, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "int_ids or string_ids, not both" in refused.value.details()
        # either kind alone still selects columns
        request.ids.ClearField("string_ids")
        tiles = list(stub.DistanceMatrix(request, timeout=30))
        assert sum(t.col_count for t in tiles) == 2
