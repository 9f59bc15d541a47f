"""The server over real gRPC on port 0, with real Arrow IPC bytes and raw stubs.

Covers every RPC, health checking and reflection, versioning (failed uploads, queries
holding an old version), persistence across restarts, and the status code and message
of each bad input docs/errors.md lists (docs/design.md), after which the server must keep answering.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import geonear
from geonear.geometry import EARTH_RADIUS_M, great_circle_m
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import create_engine
from geonear.service.queries.matrix import TILE_BYTES
from geonear.service.settings import Limits
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import ipc_stream_bytes, messages_to_table, table_to_messages

Code = grpc.StatusCode
SERVICE = "geonear.v1.GeoNear"


# -- helpers ---------------------------------------------------------------------------
def points_table(lat: np.ndarray, lon: np.ndarray, **extra: Any) -> pa.Table:
    columns: dict[str, Any] = {
        "id": np.arange(lat.shape[0], dtype=np.int64),
        "lat": lat,
        "lon": lon,
    }
    columns.update(extra)
    return pa.table(columns)


def upload_requests(
    name: str, table: pa.Table, mode: int = pb.CREATE, batch_rows: int | None = None, **header: str
) -> Iterator[pb.UploadRequest]:
    """Header first, then the table as ArrowData messages (schema once, then batches)."""
    yield pb.UploadRequest(header=pb.UploadHeader(dataset=name, mode=mode, **header))
    if batch_rows is None:
        for message in table_to_messages(table):
            yield pb.UploadRequest(data=message)
        return
    schema = table.schema.serialize().to_pybytes()
    for i, batch in enumerate(table.to_batches(max_chunksize=batch_rows)):
        yield pb.UploadRequest(
            data=pb.ArrowData(
                schema=schema if i == 0 else b"",
                record_batch=batch.serialize().to_pybytes(),
                row_count=batch.num_rows,
            )
        )


def upload(stub: pb_grpc.GeoNearStub, name: str, table: pa.Table, mode: int = pb.CREATE, **kw):
    return stub.Upload(upload_requests(name, table, mode, **kw), timeout=30)


def inline(lat, lon) -> pb.Points:
    return pb.Points(lat=list(np.atleast_1d(lat)), lon=list(np.atleast_1d(lon)))


def result_table(stream) -> pa.Table:
    return messages_to_table(list(stream))


def expect_error(code: grpc.StatusCode, call: Callable[[], Any], *words: str) -> str:
    """Run ``call`` (consuming a stream), assert it fails with ``code``; return the message."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if isinstance(result, Iterator) or hasattr(result, "__next__"):
            list(result)
    error = info.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    message = error.details()
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
    return message


def matrix_from_tiles(tiles: list[pb.MatrixTile]) -> np.ndarray:
    first = tiles[0]
    dtype = "<f4" if first.dtype == pb.FLOAT32 else "<f8"
    out = np.full((first.total_rows, first.total_cols), np.nan)
    seen = np.zeros(out.shape, dtype=int)
    for t in tiles:
        values = np.frombuffer(t.values, dtype=dtype).reshape(t.row_count, t.col_count)
        rows = slice(t.row_start, t.row_start + t.row_count)
        cols = slice(t.col_start, t.col_start + t.col_count)
        out[rows, cols] = values
        seen[rows, cols] += 1
        assert (t.total_rows, t.total_cols) == (first.total_rows, first.total_cols)
        assert t.earth_radius_m == first.earth_radius_m
    np.testing.assert_array_equal(seen, 1)  # tiles cover the matrix exactly once
    return out


def test_tiles_carry_the_earth_radius(stub) -> None:
    request = pb.DistanceMatrixRequest(queries=inline(0.0, 0.0), targets=inline(0.0, 1.0))
    (tile,) = stub.DistanceMatrix(request)
    assert tile.earth_radius_m == EARTH_RADIUS_M


UNIFORM = uniform_points(2000, seed=31)
QUERIES = uniform_points(40, seed=32)


@pytest.fixture
def uniform_table() -> pa.Table:
    n = UNIFORM[0].shape[0]
    return points_table(
        *UNIFORM,
        name=pa.array([f"p{i}" for i in range(n)]),
        population=np.arange(n, dtype=np.int64) * 10,
        weight=np.linspace(0.5, 2.0, n),
    )


@pytest.fixture
def loaded(stub, uniform_table) -> pb_grpc.GeoNearStub:
    """A stub whose server holds dataset ``pts`` (the uniform table) and ``airports``."""
    upload(stub, "pts", uniform_table)
    return stub


# -- datasets --------------------------------------------------------------------------
def test_upload_create_describes_the_new_dataset(stub, uniform_table) -> None:
    response = upload(stub, "pts", uniform_table, batch_rows=300)
    assert response.rows_received == 2000
    info = response.dataset
    assert (info.name, info.version, info.rows, info.engine) == ("pts", 1, 2000, "cpu")
    assert info.id_type == "int64"
    assert info.host_bytes > 2000 * 24
    assert info.device_bytes == 0
    assert [(c.name, c.arrow_type) for c in info.columns] == [
        ("id", "int64"),
        ("lat", "double"),
        ("lon", "double"),
        ("name", "string"),
        ("population", "int64"),
        ("weight", "double"),
    ]
    box = info.bounding_box
    assert box.min_lat == pytest.approx(UNIFORM[0].min())
    assert box.max_lat == pytest.approx(UNIFORM[0].max())
    assert box.min_lon == pytest.approx(UNIFORM[1].min())
    assert box.max_lon == pytest.approx(UNIFORM[1].max())
    assert info.created_unix_s > 0
    assert stub.GetDataset(pb.GetDatasetRequest(dataset="pts")) == info


def test_upload_maps_column_names_and_numbers_rows_without_ids(stub) -> None:
    table = pa.table({"latitude": [1.0, 2.0, 3.0], "lng": [4.0, 5.0, 6.0], "tag": ["a", "b", "c"]})
    info = upload(stub, "mapped", table, lat_column="latitude", lon_column="lng").dataset
    assert [c.name for c in info.columns] == ["id", "lat", "lon", "tag"]
    found = result_table(stub.Knn(pb.KnnRequest(dataset="mapped", queries=inline(2.0, 5.0), k=3)))
    assert found.column("id").to_pylist()[0] == 1
    # appends without ids continue the numbering
    more = pa.table({"latitude": [7.0], "lng": [8.0], "tag": ["d"]})
    upload(stub, "mapped", more, pb.APPEND, lat_column="latitude", lon_column="lng")
    found = result_table(stub.Knn(pb.KnnRequest(dataset="mapped", queries=inline(7.0, 8.0), k=1)))
    assert found.column("id").to_pylist() == [3]


def test_replace_and_append_build_new_versions(loaded, uniform_table) -> None:
    stub = loaded
    small = uniform_table.slice(0, 100)
    replaced = upload(stub, "pts", small, pb.REPLACE).dataset
    assert (replaced.version, replaced.rows) == (2, 100)
    extra = uniform_table.slice(100, 50)
    appended = upload(stub, "pts", extra, pb.APPEND).dataset
    assert (appended.version, appended.rows) == (3, 150)
    # replace creates a dataset that does not exist yet
    fresh = upload(stub, "fresh", small, pb.REPLACE).dataset
    assert (fresh.version, fresh.rows) == (1, 100)
    # the appended rows answer queries
    row = 120
    q = inline(UNIFORM[0][row], UNIFORM[1][row])
    found = result_table(stub.Knn(pb.KnnRequest(dataset="pts", queries=q, k=1)))
    assert found.column("id").to_pylist() == [row]
    assert found.column("distance_m").to_pylist() == [0.0]


def test_delete_rows_by_id(loaded) -> None:
    stub = loaded
    response = stub.DeleteRows(pb.DeleteRowsRequest(dataset="pts", int_ids=[5, 6, 7, 99_999]))
    assert (response.rows_deleted, response.ids_not_found) == (3, 1)
    assert (response.dataset.version, response.dataset.rows) == (2, 1997)
    q = inline(UNIFORM[0][6], UNIFORM[1][6])
    found = result_table(stub.Knn(pb.KnnRequest(dataset="pts", queries=q, k=1)))
    assert found.column("id").to_pylist() != [6]
    nothing = stub.DeleteRows(pb.DeleteRowsRequest(dataset="pts", int_ids=[5]))
    assert (nothing.rows_deleted, nothing.ids_not_found, nothing.dataset.version) == (0, 1, 2)


def test_delete_rows_by_string_id(stub, airports_table) -> None:
    upload(stub, "airports", airports_table)
    response = stub.DeleteRows(pb.DeleteRowsRequest(dataset="airports", string_ids=["EGLL"]))
    assert response.rows_deleted == 1
    assert response.dataset.rows == airports_table.num_rows - 1
    near_lhr = result_table(
        stub.Knn(pb.KnnRequest(dataset="airports", queries=inline(51.47, -0.4543), k=1))
    )
    assert near_lhr.column("id").to_pylist() != ["EGLL"]


def test_list_datasets_is_sorted_by_name(loaded, uniform_table) -> None:
    upload(loaded, "alpha", uniform_table.slice(0, 10))
    listed = loaded.ListDatasets(pb.ListDatasetsRequest()).datasets
    assert [(d.name, d.rows) for d in listed] == [("alpha", 10), ("pts", 2000)]


def test_drop_dataset_removes_it_and_its_files(loaded, server) -> None:
    data_dir = Path(server.settings.data_dir)
    assert any((data_dir / "pts").iterdir())
    response = loaded.DropDataset(pb.DropDatasetRequest(dataset="pts"))
    assert (response.dataset, response.version) == ("pts", 1)
    expect_error(
        Code.NOT_FOUND, lambda: loaded.GetDataset(pb.GetDatasetRequest(dataset="pts")), "pts"
    )
    assert not (data_dir / "pts").exists()
    assert loaded.ListDatasets(pb.ListDatasetsRequest()).datasets == []


# -- queries ---------------------------------------------------------------------------
def test_knn_returns_the_reference_neighbours_with_attributes(loaded, uniform_table) -> None:
    request = pb.KnnRequest(
        dataset="pts", queries=inline(*QUERIES), k=5, columns=["name", "population"]
    )
    table = result_table(loaded.Knn(request))
    assert table.column_names == [
        "query_index",
        "rank",
        "id",
        "distance_m",
        "name",
        "population",
    ]
    assert table.schema.field("query_index").type == pa.int64()
    assert table.schema.field("rank").type == pa.int32()
    assert table.schema.metadata[b"geonear.earth_radius_m"] == repr(EARTH_RADIUS_M).encode()
    assert table.schema.metadata[b"geonear.version"] == b"1"
    want = create_engine("numpy-brute").build_index(*UNIFORM).knn(*QUERIES, 5)
    np.testing.assert_array_equal(table.column("query_index").to_numpy(), np.repeat(range(40), 5))
    np.testing.assert_array_equal(table.column("rank").to_numpy(), np.tile(range(5), 40))
    np.testing.assert_array_equal(table.column("id").to_numpy(), want.indices.ravel())
    np.testing.assert_allclose(table.column("distance_m").to_numpy(), want.distances_m.ravel())
    ids = table.column("id").to_numpy()
    assert table.column("name").to_pylist() == [f"p{i}" for i in ids]
    np.testing.assert_array_equal(table.column("population").to_numpy(), ids * 10)


def test_knn_query_points_as_arrow_ipc_give_the_same_answer(loaded) -> None:
    as_arrow = pb.Points(
        arrow_ipc=ipc_stream_bytes(pa.table({"lat": QUERIES[0], "lon": QUERIES[1]}))
    )
    a = result_table(loaded.Knn(pb.KnnRequest(dataset="pts", queries=as_arrow, k=3)))
    b = result_table(loaded.Knn(pb.KnnRequest(dataset="pts", queries=inline(*QUERIES), k=3)))
    assert a.equals(b)


def test_knn_with_max_distance_and_k_beyond_the_set(loaded) -> None:
    request = pb.KnnRequest(dataset="pts", queries=inline(*QUERIES), k=10, max_distance_m=200_000.0)
    table = result_table(loaded.Knn(request))
    assert 0 < table.num_rows < 400
    assert max(table.column("distance_m").to_pylist()) <= 200_000.0
    everything = result_table(
        loaded.Knn(pb.KnnRequest(dataset="pts", queries=inline(0.0, 0.0), k=5000))
    )
    assert everything.num_rows == 2000
    assert sorted(everything.column("id").to_pylist()) == list(range(2000))


def test_knn_on_airports_finds_heathrow(stub, airports_table) -> None:
    upload(stub, "airports", airports_table)
    request = pb.KnnRequest(
        dataset="airports", queries=inline([51.47], [-0.4543]), k=3, columns=["iata", "country"]
    )
    table = result_table(stub.Knn(request))
    first = table.slice(0, 1).to_pylist()[0]
    assert (first["id"], first["iata"], first["country"]) == ("EGLL", "LHR", "GB")
    assert first["distance_m"] < 2000


def test_radius_returns_every_point_within_the_radius(loaded) -> None:
    request = pb.RadiusRequest(
        dataset="pts", queries=inline(*QUERIES), radius_m=400_000.0, columns=["weight"]
    )
    table = result_table(loaded.Radius(request))
    assert table.column_names == ["query_index", "rank", "id", "distance_m", "weight"]
    want = create_engine("numpy-brute").build_index(*UNIFORM).radius(*QUERIES, 400_000.0)
    assert table.num_rows == want.indices.shape[0] > 40
    np.testing.assert_array_equal(table.column("id").to_numpy(), want.indices)
    np.testing.assert_array_equal(table.column("query_index").to_numpy(), want.query_index)
    np.testing.assert_allclose(table.column("distance_m").to_numpy(), want.distances_m)
    # ranks restart at 0 for every query, nearest first
    frame = table.to_pandas()
    for _, group in frame.groupby("query_index"):
        assert group["rank"].tolist() == list(range(len(group)))
        assert group["distance_m"].is_monotonic_increasing
    np.testing.assert_allclose(frame["weight"], np.linspace(0.5, 2.0, 2000)[frame["id"]])


def test_radius_with_no_neighbours_is_an_empty_table(loaded) -> None:
    table = result_table(
        loaded.Radius(pb.RadiusRequest(dataset="pts", queries=inline(0.0, 0.0), radius_m=1.0))
    )
    assert table.num_rows == 0
    assert table.column_names == ["query_index", "rank", "id", "distance_m"]


def _reference_matrix(lat1, lon1, lat2, lon2) -> np.ndarray:
    return great_circle_m(
        np.asarray(lat1)[:, None], np.asarray(lon1)[:, None], lat2[None, :], lon2[None, :]
    )


def test_distance_matrix_to_a_dataset_reassembles_many_tiles(loaded) -> None:
    rows = uniform_points(300, seed=33)
    request = pb.DistanceMatrixRequest(queries=inline(*rows), dataset="pts")
    tiles = list(loaded.DistanceMatrix(request))
    assert TILE_BYTES < 300 * 2000 * 8  # the matrix is larger than one tile
    assert len(tiles) > 1
    assert all(len(t.values) <= TILE_BYTES for t in tiles)
    assert all(t.dtype == pb.FLOAT64 for t in tiles)
    got = matrix_from_tiles(tiles)
    np.testing.assert_allclose(got, _reference_matrix(*rows, *UNIFORM), rtol=0, atol=1e-3)


def test_distance_matrix_to_a_subset_by_id_keeps_the_id_order(loaded) -> None:
    ids = [17, 3, 1999, 3]
    request = pb.DistanceMatrixRequest(
        queries=inline(*QUERIES), dataset="pts", ids=pb.IdList(int_ids=ids)
    )
    got = matrix_from_tiles(list(loaded.DistanceMatrix(request)))
    assert got.shape == (40, 4)
    want = _reference_matrix(*QUERIES, UNIFORM[0][ids], UNIFORM[1][ids])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)


def test_distance_matrix_between_two_inline_sets_in_float32(stub) -> None:
    lat2, lon2 = np.array([90.0, -90.0, 0.0, 0.0]), np.array([0.0, 0.0, 180.0, -179.9])
    request = pb.DistanceMatrixRequest(
        queries=inline(*QUERIES), targets=inline(lat2, lon2), dtype=pb.FLOAT32
    )
    tiles = list(stub.DistanceMatrix(request))
    assert all(t.dtype == pb.FLOAT32 for t in tiles)
    assert sum(len(t.values) for t in tiles) == 40 * 4 * 4
    got = matrix_from_tiles(tiles)
    np.testing.assert_allclose(got, _reference_matrix(*QUERIES, lat2, lon2), rtol=0, atol=4.0)
    exact = matrix_from_tiles(
        list(
            stub.DistanceMatrix(
                pb.DistanceMatrixRequest(queries=inline(*QUERIES), targets=inline(lat2, lon2))
            )
        )
    )
    np.testing.assert_allclose(exact, _reference_matrix(*QUERIES, lat2, lon2), rtol=0, atol=1e-3)


def test_distance_matrix_by_string_ids(stub, airports_table) -> None:
    upload(stub, "airports", airports_table)
    request = pb.DistanceMatrixRequest(
        queries=inline([51.4700], [-0.4543]),
        dataset="airports",
        ids=pb.IdList(string_ids=["KJFK", "EGLL"]),
    )
    got = matrix_from_tiles(list(stub.DistanceMatrix(request)))
    assert got[0, 1] < 2_000
    assert got[0, 0] == pytest.approx(5_550_000, abs=20_000)


def test_kmeans_with_labels(stub) -> None:
    lat, lon = clustered_points(1500, seed=34, n_clusters=6, spread_m=30_000.0)
    table = points_table(lat, lon, w=np.ones(1500))
    upload(stub, "clusters", table)
    request = pb.KMeansRequest(dataset="clusters", k=6, seed=3, n_init=2, return_labels=True)
    messages = list(stub.KMeans(request))
    summary = messages[0].summary
    assert summary.dataset_version == 1 and summary.earth_radius_m == EARTH_RADIUS_M
    assert summary.n_iter >= 1 and summary.inertia_m2 > 0
    centroids = messages_to_table([summary.centroids])
    assert centroids.column_names == ["cluster", "lat", "lon", "size"]
    assert centroids.column("cluster").to_pylist() == list(range(6))
    assert sum(centroids.column("size").to_pylist()) == 1500
    assert all(not m.HasField("summary") for m in messages[1:])
    labels = messages_to_table([m.labels for m in messages[1:]])
    assert labels.column_names == ["id", "cluster"]
    assert labels.column("id").to_pylist() == list(range(1500))
    sizes = np.bincount(labels.column("cluster").to_numpy(), minlength=6)
    np.testing.assert_array_equal(sizes, centroids.column("size").to_numpy())
    want = create_engine("numpy-brute").build_index(lat, lon).kmeans(6, seed=3, n_init=2)
    assert summary.inertia_m2 == pytest.approx(want.inertia_m2, rel=1e-6)
    np.testing.assert_array_equal(labels.column("cluster").to_numpy(), want.labels)
    # the same request with weights of 1 gives the same clustering
    weighted = list(
        stub.KMeans(pb.KMeansRequest(dataset="clusters", k=6, seed=3, n_init=2, weight_column="w"))
    )
    assert weighted[0].summary.inertia_m2 == pytest.approx(summary.inertia_m2, rel=1e-9)
    without_labels = list(stub.KMeans(pb.KMeansRequest(dataset="clusters", k=6, seed=3)))
    assert len(without_labels) == 1


def test_server_info(stub, server_factory) -> None:
    info = stub.ServerInfo(pb.ServerInfoRequest())
    assert info.version == geonear.__version__
    assert info.backend == "cpu"
    assert info.device.startswith("cpu")
    assert info.earth_radius_m == EARTH_RADIUS_M
    assert info.engines[0] == "cpu" and {"sklearn", "numpy-brute"} <= set(info.engines)
    assert info.limits.max_k == Limits().max_k
    assert (info.pool_used_bytes, info.pool_total_bytes) == (0, 0)
    other = server_factory(
        data_dir=None, earth_radius_m=1000.0, limits=Limits(max_k=7, max_matrix_cells=99)
    )
    with grpc.insecure_channel(other.target) as channel:
        other_stub = pb_grpc.GeoNearStub(channel)
        info = other_stub.ServerInfo(pb.ServerInfoRequest())
        assert info.earth_radius_m == 1000.0
        assert (info.limits.max_k, info.limits.max_matrix_cells) == (7, 99)
        tiles = list(
            other_stub.DistanceMatrix(
                pb.DistanceMatrixRequest(queries=inline(0.0, 0.0), targets=inline(0.0, 90.0))
            )
        )
        assert matrix_from_tiles(tiles)[0, 0] == pytest.approx(1000.0 * np.pi / 2)


def test_health_check_is_serving(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == Code.NOT_FOUND


def test_reflection_lists_the_service(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for s in responses[0].list_services_response.service}
        assert SERVICE in names and "grpc.health.v1.Health" in names
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)
        (described,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
        assert described.file_descriptor_response.file_descriptor_proto


# -- versioning ------------------------------------------------------------------------
def test_failed_upload_leaves_the_old_version_untouched(loaded, uniform_table, server) -> None:
    before = loaded.GetDataset(pb.GetDatasetRequest(dataset="pts"))
    stored = sorted(p.name for p in (Path(server.settings.data_dir) / "pts").iterdir())
    lat = np.array(UNIFORM[0])
    lat[1500] = 90.5  # a bad coordinate in a later batch
    bad = uniform_table.set_column(1, "lat", pa.array(lat))
    for mode in (pb.REPLACE, pb.APPEND):
        message = expect_error(
            Code.INVALID_ARGUMENT,
            lambda mode=mode: upload(loaded, "pts", bad, mode, batch_rows=400),
            "row 1500",
            "90.5",
        )
        assert "[-90, 90]" in message
    after = loaded.GetDataset(pb.GetDatasetRequest(dataset="pts"))
    assert after == before
    assert sorted(p.name for p in (Path(server.settings.data_dir) / "pts").iterdir()) == stored
    table = result_table(loaded.Knn(pb.KnnRequest(dataset="pts", queries=inline(*QUERIES), k=2)))
    assert table.schema.metadata[b"geonear.version"] == b"1"


def test_cancelled_upload_stores_nothing(loaded, uniform_table) -> None:
    sent = threading.Event()
    release = threading.Event()

    def requests() -> Iterator[pb.UploadRequest]:
        messages = upload_requests("pts", uniform_table.slice(0, 10), pb.REPLACE, batch_rows=5)
        yield next(messages)
        yield next(messages)
        sent.set()
        release.wait(10)
        yield from messages

    future = loaded.Upload.future(requests(), timeout=30)
    assert sent.wait(10)
    future.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    info = loaded.GetDataset(pb.GetDatasetRequest(dataset="pts"))
    assert (info.version, info.rows) == (1, 2000)


def test_a_query_holding_an_old_version_finishes_on_it(loaded, server) -> None:
    rows = uniform_points(300, seed=35)
    stream = loaded.DistanceMatrix(pb.DistanceMatrixRequest(queries=inline(*rows), dataset="pts"))
    first = next(stream)
    # the dataset changes while the matrix streams
    moved = points_table(np.clip(UNIFORM[0] + 1.0, -90, 90), UNIFORM[1])
    assert upload(loaded, "pts", moved, pb.REPLACE).dataset.version == 2
    tiles = [first, *stream]
    assert len(tiles) > 1
    got = matrix_from_tiles(tiles)
    np.testing.assert_allclose(got, _reference_matrix(*rows, *UNIFORM), rtol=0, atol=1e-3)
    # a new query sees the new version
    new = matrix_from_tiles(
        list(loaded.DistanceMatrix(pb.DistanceMatrixRequest(queries=inline(*rows), dataset="pts")))
    )
    np.testing.assert_allclose(
        new, _reference_matrix(*rows, moved["lat"].to_numpy(), UNIFORM[1]), rtol=0, atol=1e-3
    )
    # a version held in the store keeps answering from its own index
    held = server.store.get("pts")
    upload(loaded, "pts", points_table(*uniform_points(10, seed=36)), pb.REPLACE)
    assert held.version == 2 and held.rows == 2000
    assert held.index.knn(np.array([0.0]), np.array([0.0]), 3).indices.shape == (1, 3)


# -- persistence -----------------------------------------------------------------------
def test_datasets_survive_a_restart(
    server_factory, tmp_path, uniform_table, airports_table
) -> None:
    data_dir = tmp_path / "persist"
    first = server_factory(data_dir=data_dir)
    with grpc.insecure_channel(first.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        upload(stub, "pts", uniform_table)
        stub.DeleteRows(pb.DeleteRowsRequest(dataset="pts", int_ids=[1, 2, 3]))
        upload(stub, "airports", airports_table)
        before = {d.name: d for d in stub.ListDatasets(pb.ListDatasetsRequest()).datasets}
        answer = result_table(
            stub.Knn(pb.KnnRequest(dataset="pts", queries=inline(*QUERIES), k=4, columns=["name"]))
        )
    first.stop()
    second = server_factory(data_dir=data_dir)
    with grpc.insecure_channel(second.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        after = {d.name: d for d in stub.ListDatasets(pb.ListDatasetsRequest()).datasets}
        assert sorted(after) == ["airports", "pts"]
        for name in after:
            assert after[name].version == before[name].version
            assert after[name].rows == before[name].rows
            assert list(after[name].columns) == list(before[name].columns)
            assert after[name].bounding_box == before[name].bounding_box
        assert after["pts"].version == 2 and after["pts"].rows == 1997
        again = result_table(
            stub.Knn(pb.KnnRequest(dataset="pts", queries=inline(*QUERIES), k=4, columns=["name"]))
        )
        assert again.equals(answer)
        # the next change continues the version numbering
        assert upload(stub, "pts", uniform_table, pb.REPLACE).dataset.version == 3


def test_a_corrupt_dataset_file_is_skipped_at_start(
    server_factory, tmp_path, uniform_table
) -> None:
    data_dir = tmp_path / "corrupt"
    first = server_factory(data_dir=data_dir)
    with grpc.insecure_channel(first.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        upload(stub, "good", uniform_table)
        upload(stub, "bad", uniform_table.slice(0, 100))
    first.stop()
    (bad_file,) = (data_dir / "bad").iterdir()
    bad_file.write_bytes(b"this is not an Arrow file" * 10)
    second = server_factory(data_dir=data_dir)
    with grpc.insecure_channel(second.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        names = [d.name for d in stub.ListDatasets(pb.ListDatasetsRequest()).datasets]
        assert names == ["good"]
        expect_error(
            Code.NOT_FOUND, lambda: stub.GetDataset(pb.GetDatasetRequest(dataset="bad")), "bad"
        )
        table = result_table(stub.Knn(pb.KnnRequest(dataset="good", queries=inline(0.0, 0.0), k=1)))
        assert table.num_rows == 1
        # the name can be used again
        assert upload(stub, "bad", uniform_table.slice(0, 5), pb.REPLACE).dataset.rows == 5


def test_memory_only_server_keeps_no_files(server_factory, tmp_path, uniform_table) -> None:
    running = server_factory(data_dir=None)
    assert running.settings.data_dir is None
    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        assert upload(stub, "pts", uniform_table).dataset.rows == 2000
    assert not (tmp_path / "data").exists()


# -- bad input: status codes and messages ----------------------------------------------
@pytest.fixture
def limited(server_factory, uniform_table) -> pb_grpc.GeoNearStub:
    """A stub on a server with small limits, holding dataset ``pts``."""
    running = server_factory(
        limits=Limits(max_k=50, max_matrix_cells=10_000, max_query_points=500, max_upload_rows=3000)
    )
    channel = grpc.insecure_channel(running.target)
    stub = pb_grpc.GeoNearStub(channel)
    upload(stub, "pts", uniform_table)
    yield stub
    channel.close()


def _knn(stub, **fields):
    fields.setdefault("dataset", "pts")
    fields.setdefault("queries", inline(*QUERIES))
    fields.setdefault("k", 3)
    return lambda: stub.Knn(pb.KnnRequest(**fields))


def _upload(stub, table, name="other", mode=pb.CREATE, **header):
    return lambda: upload(stub, name, table, mode, **header)


def _schema_only_and_garbage_batch() -> Iterator[pb.UploadRequest]:
    schema = pa.schema([("lat", pa.float64()), ("lon", pa.float64())]).serialize().to_pybytes()
    yield pb.UploadRequest(header=pb.UploadHeader(dataset="other"))
    yield pb.UploadRequest(data=pb.ArrowData(schema=schema, record_batch=b"\x00garbage" * 20))


BAD_INPUTS: dict[
    str, tuple[grpc.StatusCode, Callable[[Any], Callable[[], Any]], tuple[str, ...]]
] = {
    # coordinates
    "upload latitude out of range": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0, 91.0], "lon": [0.0, 0.0]})),
        ("row 1", "lat=91.0", "[-90, 90]"),
    ),
    "upload longitude out of range": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0], "lon": [180.5]})),
        ("row 0", "[-180, 180]"),
    ),
    "upload NaN coordinate": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0, float("nan")], "lon": [0.0, 1.0]})),
        ("row 1", "finite"),
    ),
    "upload null coordinate": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0, None], "lon": [0.0, 1.0]})),
        ("null",),
    ),
    "query latitude out of range": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, queries=inline([0.0, -95.0], [0.0, 0.0])),
        ("query points", "row 1", "-95.0"),
    ),
    "query infinite longitude": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, queries=inline([0.0], [float("inf")])),
        ("finite",),
    ),
    "query lat and lon of different lengths": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, queries=pb.Points(lat=[1.0, 2.0], lon=[1.0])),
        ("differ in length",),
    ),
    "matrix targets out of range": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.DistanceMatrix(
                pb.DistanceMatrixRequest(queries=inline(0.0, 0.0), targets=inline(100.0, 0.0))
            )
        ),
        ("matrix columns", "[-90, 90]"),
    ),
    # schema
    "upload without a lat column": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"latitude": [0.0], "lon": [0.0]})),
        ("lat", "latitude", "lat_column"),
    ),
    "upload mapping a missing column": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0], "lon": [0.0]}), lon_column="lng"),
        ("'lng'", "columns found"),
    ),
    "upload with text coordinates": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": ["north"], "lon": [0.0]})),
        ("numeric", "string"),
    ),
    "upload with float ids": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"id": [1.5], "lat": [0.0], "lon": [0.0]})),
        ("integer or string",),
    ),
    "upload with duplicate ids": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"id": [4, 4, 5], "lat": [0.0] * 3, "lon": [0.0] * 3})),
        ("more than once", "4"),
    ),
    "upload with null ids": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"id": ["a", None], "lat": [0.0] * 2, "lon": [0.0] * 2})),
        ("null ids",),
    ),
    "upload with no rows": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(
            s, pa.table({"lat": pa.array([], pa.float64()), "lon": pa.array([], pa.float64())})
        ),
        ("no rows",),
    ),
    "upload reusing a stored column name": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(
            s, pa.table({"y": [0.0], "x": [0.0], "lat": [1.0]}), lat_column="y", lon_column="x"
        ),
        ("'lat'", "clashes"),
    ),
    "query arrow without a lon column": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, queries=pb.Points(arrow_ipc=ipc_stream_bytes(pa.table({"lat": [1.0]})))),
        ("lon", "missing"),
    ),
    "query arrow and inline together": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(
            s,
            queries=pb.Points(
                lat=[1.0],
                lon=[1.0],
                arrow_ipc=ipc_stream_bytes(pa.table({"lat": [1.0], "lon": [1.0]})),
            ),
        ),
        ("not both",),
    ),
    "asking for a stored column as an attribute": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, columns=["id"]),
        ("always returned",),
    ),
    "delete with the wrong id type": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.DeleteRows(pb.DeleteRowsRequest(dataset="pts", string_ids=["x"])),
        ("int64 ids",),
    ),
    "matrix ids not in the dataset": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.DistanceMatrix(
                pb.DistanceMatrixRequest(
                    queries=inline(0.0, 0.0), dataset="pts", ids=pb.IdList(int_ids=[1, 123456])
                )
            )
        ),
        ("123456", "not in"),
    ),
    "matrix with neither dataset nor targets": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.DistanceMatrix(pb.DistanceMatrixRequest(queries=inline(0.0, 0.0))),
        ("dataset or inline targets",),
    ),
    "matrix with dataset and targets": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.DistanceMatrix(
                pb.DistanceMatrixRequest(
                    queries=inline(0.0, 0.0), dataset="pts", targets=inline(0.0, 0.0)
                )
            )
        ),
        ("not both",),
    ),
    # k and other numbers
    "k of zero": (Code.INVALID_ARGUMENT, lambda s: _knn(s, k=0), ("k must be at least 1",)),
    "negative max distance": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, max_distance_m=-1.0),
        ("max_distance_m",),
    ),
    "negative radius": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.Radius(
                pb.RadiusRequest(dataset="pts", queries=inline(0.0, 0.0), radius_m=-5.0)
            )
        ),
        ("radius_m", ">= 0"),
    ),
    "NaN radius": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.Radius(
                pb.RadiusRequest(dataset="pts", queries=inline(0.0, 0.0), radius_m=float("nan"))
            )
        ),
        ("radius_m",),
    ),
    "k-means k beyond the rows": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.KMeans(pb.KMeansRequest(dataset="tiny", k=10)),
        ("k must be between 1 and", "5 rows"),
    ),
    "k-means k of zero": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.KMeans(pb.KMeansRequest(dataset="pts", k=0)),
        ("k must be between 1",),
    ),
    "k-means weight column that is text": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.KMeans(pb.KMeansRequest(dataset="pts", k=2, weight_column="name")),
        ("'name'", "numeric"),
    ),
    "k-means unknown weight column": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.KMeans(pb.KMeansRequest(dataset="pts", k=2, weight_column="nope")),
        ("'nope'",),
    ),
    # names
    "invalid dataset name": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0], "lon": [0.0]}), name="bad name/.."),
        ("invalid dataset name", "[A-Za-z0-9_.-]"),
    ),
    "empty dataset name": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0], "lon": [0.0]}), name=""),
        ("invalid dataset name",),
    ),
    "dataset name too long": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(s, pa.table({"lat": [0.0], "lon": [0.0]}), name="x" * 129),
        ("128",),
    ),
    # bytes
    "garbage Arrow schema in an upload": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.Upload(
                iter(
                    [
                        pb.UploadRequest(header=pb.UploadHeader(dataset="other")),
                        pb.UploadRequest(data=pb.ArrowData(schema=b"not arrow at all")),
                    ]
                )
            )
        ),
        ("invalid Arrow schema",),
    ),
    "garbage Arrow record batch in an upload": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.Upload(_schema_only_and_garbage_batch()),
        ("invalid Arrow record batch",),
    ),
    "dictionary-encoded column in an upload's schema": (
        Code.INVALID_ARGUMENT,
        lambda s: _upload(
            s,
            pa.table({"lat": [0.0], "lon": [0.0], "kind": pa.array(["a"]).dictionary_encode()}),
            batch_rows=1,  # the raw schema, as a client other than geonear's would send it
        ),
        ("dictionary-encoded", "'kind'", "send their values"),
    ),
    "record batch before any schema": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.Upload(
                iter(
                    [
                        pb.UploadRequest(header=pb.UploadHeader(dataset="other")),
                        pb.UploadRequest(
                            data=pb.ArrowData(
                                record_batch=pa.record_batch({"lat": [0.0]})
                                .serialize()
                                .to_pybytes()
                            )
                        ),
                    ]
                )
            )
        ),
        ("schema",),
    ),
    "wrong row count": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.Upload(
                iter(
                    [
                        pb.UploadRequest(header=pb.UploadHeader(dataset="other")),
                        pb.UploadRequest(
                            data=pb.ArrowData(
                                schema=pa.schema([("lat", pa.float64()), ("lon", pa.float64())])
                                .serialize()
                                .to_pybytes(),
                                record_batch=pa.record_batch({"lat": [0.0], "lon": [0.0]})
                                .serialize()
                                .to_pybytes(),
                                row_count=7,
                            )
                        ),
                    ]
                )
            )
        ),
        ("row_count",),
    ),
    "upload without a header": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.Upload(iter([pb.UploadRequest(data=pb.ArrowData(schema=b"x"))])),
        ("header",),
    ),
    "empty upload stream": (
        Code.INVALID_ARGUMENT,
        lambda s: lambda: s.Upload(iter([])),
        ("empty",),
    ),
    "upload with a header and no schema": (
        Code.INVALID_ARGUMENT,
        lambda s: (
            lambda: s.Upload(iter([pb.UploadRequest(header=pb.UploadHeader(dataset="other"))]))
        ),
        ("schema",),
    ),
    "garbage Arrow bytes as query points": (
        Code.INVALID_ARGUMENT,
        lambda s: _knn(s, queries=pb.Points(arrow_ipc=b"\xff\xff\xff\xff garbage")),
        ("invalid Arrow IPC stream",),
    ),
    # unknown things
    "knn on an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: _knn(s, dataset="missing"),
        ("'missing'", "ListDatasets"),
    ),
    "radius on an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: (
            lambda: s.Radius(
                pb.RadiusRequest(dataset="missing", queries=inline(0.0, 0.0), radius_m=1.0)
            )
        ),
        ("'missing'",),
    ),
    "matrix on an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: (
            lambda: s.DistanceMatrix(
                pb.DistanceMatrixRequest(queries=inline(0.0, 0.0), dataset="missing")
            )
        ),
        ("'missing'",),
    ),
    "k-means on an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: lambda: s.KMeans(pb.KMeansRequest(dataset="missing", k=1)),
        ("'missing'",),
    ),
    "describe an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: lambda: s.GetDataset(pb.GetDatasetRequest(dataset="missing")),
        ("'missing'",),
    ),
    "drop an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: lambda: s.DropDataset(pb.DropDatasetRequest(dataset="missing")),
        ("'missing'",),
    ),
    "delete from an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: lambda: s.DeleteRows(pb.DeleteRowsRequest(dataset="missing", int_ids=[1])),
        ("'missing'",),
    ),
    "append to an unknown dataset": (
        Code.NOT_FOUND,
        lambda s: _upload(
            s, pa.table({"lat": [0.0], "lon": [0.0]}), name="missing", mode=pb.APPEND
        ),
        ("'missing'", "create"),
    ),
    "unknown attribute column": (
        Code.NOT_FOUND,
        lambda s: _knn(s, columns=["name", "colour"]),
        ("'colour'", "name", "population", "weight"),
    ),
    # state
    "create over an existing name": (
        Code.ALREADY_EXISTS,
        lambda s: _upload(s, pa.table({"lat": [0.0], "lon": [0.0]}), name="pts"),
        ("'pts'", "replace or append"),
    ),
    "append with another schema": (
        Code.FAILED_PRECONDITION,
        lambda s: _upload(
            s, pa.table({"id": [5000], "lat": [0.0], "lon": [0.0]}), name="pts", mode=pb.APPEND
        ),
        ("columns and types", "name: string", "population: int64"),
    ),
    "delete every row": (
        Code.FAILED_PRECONDITION,
        lambda s: (
            lambda: s.DeleteRows(pb.DeleteRowsRequest(dataset="tiny", int_ids=list(range(5))))
        ),
        ("empty", "drop"),
    ),
    # limits
    "k beyond max_k": (
        Code.RESOURCE_EXHAUSTED,
        lambda s: _knn(s, k=51),
        ("max_k=50", "GEONEAR_MAX_K"),
    ),
    "k-means k beyond max_k": (
        Code.RESOURCE_EXHAUSTED,
        lambda s: lambda: s.KMeans(pb.KMeansRequest(dataset="pts", k=51)),
        ("max_k=50",),
    ),
    "matrix beyond max_matrix_cells": (
        Code.RESOURCE_EXHAUSTED,
        lambda s: (
            lambda: s.DistanceMatrix(
                pb.DistanceMatrixRequest(queries=inline(*QUERIES), dataset="pts")
            )
        ),
        ("40 x 2000", "80000", "max_matrix_cells=10000", "GEONEAR_MAX_MATRIX_CELLS"),
    ),
    "too many query points": (
        Code.RESOURCE_EXHAUSTED,
        lambda s: _knn(s, queries=inline(np.zeros(501), np.zeros(501))),
        ("501", "max_query_points=500"),
    ),
    "upload beyond max_upload_rows": (
        Code.RESOURCE_EXHAUSTED,
        lambda s: _upload(s, pa.table({"lat": np.zeros(3001), "lon": np.zeros(3001)})),
        ("max_upload_rows=3000", "append"),
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_the_right_status_and_message(limited, uniform_table, case: str) -> None:
    code, make_call, words = BAD_INPUTS[case]
    upload(limited, "tiny", uniform_table.slice(0, 5))
    before = {d.name: d for d in limited.ListDatasets(pb.ListDatasetsRequest()).datasets}
    expect_error(code, make_call(limited), *words)
    # the server keeps answering and the stored data is untouched
    after = {d.name: d for d in limited.ListDatasets(pb.ListDatasetsRequest()).datasets}
    assert after == before
    table = result_table(limited.Knn(pb.KnnRequest(dataset="pts", queries=inline(*QUERIES), k=2)))
    assert table.num_rows == 80
    assert limited.ServerInfo(pb.ServerInfoRequest()).backend == "cpu"


def test_limits_allow_requests_at_the_limit(limited) -> None:
    assert result_table(_knn(limited, k=50)()).num_rows == 40 * 50
    tiles = list(
        limited.DistanceMatrix(
            pb.DistanceMatrixRequest(queries=inline(np.zeros(5), np.zeros(5)), dataset="pts")
        )
    )
    assert matrix_from_tiles(tiles).shape == (5, 2000)
