"""Errors come from one tree, mapped to statuses in one seam, with machine-readable reasons;
engines are declared once, and a query an engine cannot answer is refused before the call.

Real servers on port 0; the client reads the google.rpc details the server sends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pyarrow as pa
import pytest

from geonear import GeoNearError, InvalidArgument, NotFound, ResourceExhausted
from geonear.clients.client import Client
from geonear.clients.errors import from_rpc_error
from geonear.service import errors
from geonear.service.engines import (
    ENGINES,
    Capability,
    EngineSpec,
    create_engine,
    engine_spec,
    require,
)
from geonear.service.engines.cpu import CPUEngine
from geonear.service.settings import Limits
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import points_to_message, table_to_messages


def _table(n: int = 200, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": np.arange(n),
            "lat": rng.uniform(-60, 60, n),
            "lon": rng.uniform(-180, 180, n),
            "score": rng.uniform(0, 1, n),
        }
    )


# -- the tree ---------------------------------------------------------------------------------
def _tree() -> list[type[errors.ServiceError]]:
    found, todo = [], [errors.ServiceError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == errors.__name__]


def test_every_error_of_the_tree_is_in_its_docstring_with_its_status_and_reason() -> None:
    lines = errors.__doc__.splitlines()
    for cls in _tree():
        assert grpc.StatusCode[cls.status]  # a real status code name
        row = next((line for line in lines if f" {cls.__name__} " in f"{line} "), None)
        assert row is not None, f"{cls.__name__} is missing from the errors docstring"
        assert cls.reason in row, f"{cls.__name__}'s row lacks its reason {cls.reason}"


def test_reasons_name_one_error_each() -> None:
    reasons = [cls.reason for cls in _tree()]
    assert len(reasons) == len(set(reasons))


def test_only_errors_worth_retrying_say_when() -> None:
    retryable = {cls.__name__ for cls in _tree() if cls.retry_after_s is not None}
    assert retryable == {"ServerBusy", "Unavailable", "WorkerLost", "DeviceLost"}


# -- reasons on the wire ----------------------------------------------------------------------
def test_each_refusal_carries_its_reason(server_factory) -> None:
    server = server_factory(data_dir=None, limits=Limits(max_result_rows=1_000_000))
    with Client(server.target) as client:
        client.upload("pts", _table())
        cases = [
            (lambda: client.knn("nope", 0.0, 0.0, k=1), NotFound, "DATASET_NOT_FOUND"),
            (
                lambda: client.knn("pts", 0.0, 0.0, k=1, columns=["nope"]),
                NotFound,
                "COLUMN_NOT_FOUND",
            ),
            (lambda: client.knn("pts", 95.0, 0.0, k=1), InvalidArgument, "INVALID_ARGUMENT"),
            (
                lambda: client.knn("pts", np.zeros(20_000), np.zeros(20_000), k=100),
                ResourceExhausted,
                "RESULT_TOO_LARGE",
            ),
        ]
        for call, kind, reason in cases:
            with pytest.raises(kind) as raised:
                call()
            assert raised.value.reason == reason, raised.value
            assert not raised.value.retryable
        with pytest.raises(ResourceExhausted) as too_large:
            client.knn("pts", np.zeros(20_000), np.zeros(20_000), k=100)
        assert too_large.value.metadata == {"setting": "GEONEAR_MAX_RESULT_ROWS"}


def test_a_compact_answer_too_large_is_not_a_busy_server(server_factory) -> None:
    server = server_factory(data_dir=None)
    with Client(server.target) as client:
        client.upload("pts", _table())
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        queries = points_to_message(np.zeros(10_000), np.zeros(10_000))
        with pytest.raises(grpc.RpcError) as raised:
            stub.KnnCompact(pb.KnnRequest(dataset="pts", k=10, queries=queries))
    error = from_rpc_error(raised.value)
    assert isinstance(error, ResourceExhausted)
    assert error.reason == "COMPACT_TOO_LARGE"
    assert not error.retryable


def _stalled_upload(table: pa.Table, release: threading.Event) -> Iterator[pb.UploadRequest]:
    yield pb.UploadRequest(header=pb.UploadHeader(dataset="held", mode=pb.REPLACE))
    for message in table_to_messages(table):
        yield pb.UploadRequest(data=message)
    release.wait()


def test_a_busy_server_says_retry_and_when(server_factory) -> None:
    server = server_factory(data_dir=None, limits=Limits(max_concurrent_rpcs=4))
    release = threading.Event()
    channel = grpc.insecure_channel(server.target)
    try:
        stub = pb_grpc.GeoNearStub(channel)
        calls = [stub.Upload.future(_stalled_upload(_table(), release)) for _ in range(3)]
        stop = time.monotonic() + 60  # a bound that only keeps a broken server from hanging
        while sum(f.done() for f in calls) < 2 and time.monotonic() < stop:
            time.sleep(0.01)
        refused = [f for f in calls if f.done()]
        assert len(refused) == 2  # the uploads' share of 4 slots is 1
        for call in refused:
            error = from_rpc_error(call.exception())
            assert isinstance(error, ResourceExhausted)
            assert error.reason == "SERVER_BUSY"
            assert error.retryable and error.retry_after_s == pytest.approx(0.05)
    finally:
        release.set()
        channel.close()


def test_an_unexpected_error_carries_its_error_id_as_metadata(server_factory) -> None:
    server = server_factory(data_dir=None)
    with Client(server.target) as client:
        client.upload("pts", _table())
        version = server.store.get("pts")

        def broken(*args, **kwargs):
            raise ValueError("a stray bug")

        version.index.knn = broken  # type: ignore[method-assign]
        with pytest.raises(GeoNearError) as raised:
            client.knn("pts", 0.0, 0.0, k=1)
    assert raised.value.code == grpc.StatusCode.INTERNAL
    assert raised.value.reason == "INTERNAL"
    assert raised.value.metadata["error_id"] in raised.value.message


# -- engines declared once --------------------------------------------------------------------
def test_each_engine_class_is_named_as_its_spec() -> None:
    for name, spec in ENGINES.items():
        assert spec.name == name
        assert spec.device_kind in ("cpu", "gpu")
        assert Capability.KNN in spec.capabilities  # every engine answers KNN
        if spec.device_kind == "cpu":
            engine = create_engine(name, **({"local_workers": 1} if name == "dask" else {}))
            try:
                assert engine.name == name and engine.spec is spec
                assert engine.device_kind == "cpu"
            finally:
                getattr(engine, "close", lambda: None)()


def test_a_capability_an_engine_lacks_is_refused_with_the_engines_that_have_it() -> None:
    with pytest.raises(errors.Unsupported) as raised:
        require("cuml", Capability.RADIUS, "a radius query")
    message = str(raised.value)
    assert "'cuml'" in message and "radius" in message and "cpu" in message
    assert raised.value.metadata == {"engine": "cuml", "capability": "radius"}
    require("cpu", Capability.RADIUS, "a radius query")  # no error
    with pytest.raises(errors.EngineUnavailable, match="unknown engine"):
        engine_spec("warp-drive")


class KnnOnlyEngine(CPUEngine):
    """The CPU engine, declared (below, per test) with KNN and k-means only."""

    name = "knn-only"


@pytest.fixture
def knn_only(monkeypatch: pytest.MonkeyPatch) -> str:
    spec = EngineSpec(
        "knn-only",
        f"{__name__}:KnnOnlyEngine",
        "cpu",
        frozenset({Capability.KNN, Capability.KMEANS}),
        "KNN only",
    )
    monkeypatch.setitem(ENGINES, spec.name, spec)
    return spec.name


def test_a_query_the_engine_cannot_answer_is_refused_before_the_call(
    server_factory, knn_only, monkeypatch
) -> None:
    server = server_factory(data_dir=None, engine=knn_only)
    searched: list[str] = []
    with Client(server.target) as client:
        info = client.server_info()
        assert info.engine == "knn-only" and info.capabilities == ("kmeans", "knn")
        assert info.engine_descriptions[0].summary == "KNN only"
        assert not info.engine_descriptions[0].can("radius")
        client.upload("pts", _table())
        index = server.store.get("pts").index
        for method in ("radius", "radius_count"):
            original = getattr(index, method)

            def spy(*args, _method=method, _original=original, **kwargs):
                searched.append(_method)
                return _original(*args, **kwargs)

            monkeypatch.setattr(index, method, spy)
        assert client.knn("pts", 0.0, 0.0, k=2).shape[0] == 2
        for call in (
            lambda: client.radius("pts", 0.0, 0.0, radius_m=1e6),
            lambda: client.count_within("pts", 0.0, 0.0, radius_m=1e6),
            lambda: client.distance_matrix([0.0], [0.0], name="pts"),
        ):
            with pytest.raises(GeoNearError) as raised:
                call()
            assert raised.value.code == grpc.StatusCode.UNIMPLEMENTED
            assert raised.value.reason == "UNSUPPORTED_BY_ENGINE"
            assert "'knn-only'" in raised.value.message
    assert searched == []
