"""The Python client against a real server: uploads, queries, errors and the public API."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import geonear
from geonear.clients import client as client_module
from geonear.clients.client import Client, KMeansOutcome
from geonear.geometry import EARTH_RADIUS_M, great_circle_m
from geonear.loaders.synthetic import uniform_points
from geonear.service.engines import create_engine
from geonear.service.settings import Limits

POINTS = uniform_points(2000, seed=41)
QUERIES = uniform_points(30, seed=42)


@pytest.fixture
def frame() -> pd.DataFrame:
    n = POINTS[0].shape[0]
    return pd.DataFrame(
        {
            "id": np.arange(n, dtype=np.int64),
            "latitude": POINTS[0],
            "longitude": POINTS[1],
            "label": [f"p{i}" for i in range(n)],
            "weight": np.linspace(1.0, 3.0, n),
        }
    )


@pytest.fixture
def pts(client: Client, frame: pd.DataFrame) -> Client:
    """The client, with dataset ``pts`` uploaded from a DataFrame."""
    client.upload("pts", frame, lat="latitude", lon="longitude")
    return client


REFERENCE = create_engine("numpy-brute").build_index(*POINTS)


# -- public API ------------------------------------------------------------------------
def test_public_names_are_exactly_the_intended_ones() -> None:
    assert sorted(geonear.__all__) == sorted(
        [
            "AlreadyExists",
            "Client",
            "DeadlineExceeded",
            "FailedPrecondition",
            "GeoNearError",
            "InvalidArgument",
            "NotFound",
            "PermissionDenied",
            "ResourceExhausted",
            "Unauthenticated",
            "Unavailable",
            "__version__",
            "connect",
        ]
    )
    for name in geonear.__all__:
        assert getattr(geonear, name) is not None
    for name in geonear.__all__:
        obj = getattr(geonear, name)
        if isinstance(obj, type) and name != "Client":
            assert issubclass(obj, geonear.GeoNearError)


def test_importing_geonear_imports_neither_cupy_nor_the_server() -> None:
    code = (
        "import sys, geonear\n"
        "assert 'cupy' not in sys.modules\n"
        "assert 'geonear.service.server' not in sys.modules\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- connecting ------------------------------------------------------------------------
def test_connect_without_a_target_runs_an_in_process_server(tmp_path) -> None:
    with geonear.connect(data_dir=tmp_path / "inproc") as c:
        target = c.target
        assert target.startswith("127.0.0.1:")
        assert c.server_info().backend == "cpu"
        c.upload("pts", pa.table({"lat": POINTS[0], "lon": POINTS[1]}))
        found = c.knn("pts", POINTS[0][7], POINTS[1][7], k=1)
        assert found["id"].tolist() == [7]
    assert (tmp_path / "inproc" / "manifest.json").exists()
    # closing the client stopped its server
    with Client(target, timeout_s=5) as other, pytest.raises(geonear.Unavailable):
        other.datasets()


def test_connect_in_process_with_the_demo_data() -> None:
    with geonear.connect(demo=True) as c:
        names = {d.name for d in c.datasets()}
        assert {"airports", "cities"} <= names
        nearest = c.knn("airports", 51.47, -0.4543, k=1, columns=["iata"])
        assert nearest.loc[0, "id"] == "EGLL" and nearest.loc[0, "iata"] == "LHR"


def test_connect_to_a_target(server, frame) -> None:
    with geonear.connect(server.target, timeout_s=30) as c:
        assert isinstance(c, Client)
        assert c.timeout_s == 30
        c.upload("pts", frame, lat="latitude", lon="longitude")
    assert [d.name for d in server.store.datasets()] == ["pts"]


# -- uploads ---------------------------------------------------------------------------
def test_upload_a_dataframe(client, frame) -> None:
    info = client.upload("pts", frame, lat="latitude", lon="longitude")
    assert (info.name, info.version, info.rows) == ("pts", 1, 2000)
    assert [c.name for c in info.columns] == ["id", "lat", "lon", "label", "weight"]
    assert client.info("pts") == info


def test_categorical_and_dictionary_columns_travel_as_their_values(client, frame) -> None:
    frame = frame.assign(label=frame["label"].astype("category"))
    info = client.upload("pts", frame, lat="latitude", lon="longitude")
    assert {c.name: c.arrow_type for c in info.columns}["label"] in ("string", "large_string")
    found = client.knn("pts", frame["latitude"][:3], frame["longitude"][:3], k=1, columns=["label"])
    assert found["label"].tolist() == frame["label"][:3].astype(str).tolist()
    table = pa.table({"lat": [1.0], "lon": [2.0], "kind": pa.array(["port"]).dictionary_encode()})
    assert client.upload("t", table).rows == 1


def test_upload_a_pyarrow_table_and_a_record_batch(client) -> None:
    table = pa.table({"id": ["a", "b", "c"], "lat": [1.0, 2.0, 3.0], "lon": [4.0, 5.0, 6.0]})
    assert client.upload("t", table).id_type == "string"
    assert client.upload("b", table.to_batches()[0]).rows == 3


def test_upload_a_record_batch_reader_in_several_batches(client) -> None:
    table = pa.table({"lat": POINTS[0], "lon": POINTS[1]})
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=300))
    info = client.upload("streamed", reader)
    assert info.rows == 2000
    assert client.knn("streamed", POINTS[0][1999], POINTS[1][1999], k=1)["id"].tolist() == [1999]


def test_upload_modes(client, frame) -> None:
    client.upload("pts", frame.iloc[:100], lat="latitude", lon="longitude")
    more = frame.iloc[100:150]
    info = client.upload("pts", more, lat="latitude", lon="longitude", mode="append")
    assert (info.version, info.rows) == (2, 150)
    info = client.upload("pts", frame.iloc[:10], lat="latitude", lon="longitude", mode="replace")
    assert (info.version, info.rows) == (3, 10)
    with pytest.raises(ValueError, match="mode must be one of create, replace, append"):
        client.upload("pts", frame, mode="upsert")
    with pytest.raises(TypeError, match="pandas DataFrame, pyarrow Table"):
        client.upload("pts", [(1.0, 2.0)])


def test_datasets_info_delete_and_drop(pts) -> None:
    assert [d.name for d in pts.datasets()] == ["pts"]
    response = pts.delete("pts", [1, 2, 10_000])
    assert (response.rows_deleted, response.ids_not_found) == (2, 1)
    assert pts.info("pts").rows == 1998
    assert pts.drop("pts") == 2
    assert pts.datasets() == []


def test_delete_by_string_ids(client) -> None:
    client.upload("s", pa.table({"id": ["x", "y", "z"], "lat": [0.0, 1.0, 2.0], "lon": [0.0] * 3}))
    assert client.delete("s", ["y"]).rows_deleted == 1
    assert client.knn("s", 1.0, 0.0, k=5)["id"].tolist() == ["x", "z"]


# -- queries ---------------------------------------------------------------------------
def test_knn_with_a_scalar_query(pts) -> None:
    result = pts.knn("pts", 10.0, 20.0, k=3, columns=["label"])
    assert isinstance(result, pd.DataFrame)
    assert list(result.columns) == ["query_index", "rank", "id", "distance_m", "label"]
    want = REFERENCE.knn(np.array([10.0]), np.array([20.0]), 3)
    assert result["id"].tolist() == want.indices[0].tolist()
    np.testing.assert_allclose(result["distance_m"], want.distances_m[0], rtol=0, atol=1e-3)
    assert result["label"].tolist() == [f"p{i}" for i in want.indices[0]]
    assert result["rank"].tolist() == [0, 1, 2]


def test_knn_with_arrays_and_as_arrow(pts) -> None:
    table = pts.knn("pts", list(QUERIES[0]), pd.Series(QUERIES[1]), k=4, as_arrow=True)
    assert isinstance(table, pa.Table)
    want = REFERENCE.knn(*QUERIES, 4)
    np.testing.assert_array_equal(table.column("id").to_numpy(), want.indices.ravel())
    np.testing.assert_array_equal(table.column("query_index").to_numpy(), np.repeat(range(30), 4))
    assert table.schema.metadata[b"geonear.earth_radius_m"] == repr(EARTH_RADIUS_M).encode()


def test_knn_max_distance(pts) -> None:
    result = pts.knn("pts", QUERIES[0], QUERIES[1], k=10, max_distance_m=250_000.0)
    assert len(result) < 300
    assert (result["distance_m"] <= 250_000.0).all()


def test_query_sets_larger_than_one_request_are_split_and_joined(pts, monkeypatch) -> None:
    whole = pts.knn("pts", *QUERIES, k=3)
    whole_radius = pts.radius("pts", *QUERIES, 500_000.0)
    monkeypatch.setattr(client_module, "QUERY_CHUNK", 7)
    split = pts.knn("pts", *QUERIES, k=3)
    pd.testing.assert_frame_equal(split, whole)
    assert split["query_index"].tolist() == np.repeat(range(30), 3).tolist()
    split_radius = pts.radius("pts", *QUERIES, 500_000.0)
    pd.testing.assert_frame_equal(split_radius, whole_radius)


def test_large_query_sets_travel_as_arrow(pts) -> None:
    lat, lon = uniform_points(5000, seed=43)  # beyond the inline limit
    result = pts.knn("pts", lat, lon, k=1)
    assert len(result) == 5000
    want = REFERENCE.knn(lat, lon, 1)
    np.testing.assert_array_equal(result["id"].to_numpy(), want.indices[:, 0])


def test_radius(pts) -> None:
    result = pts.radius("pts", QUERIES[0], QUERIES[1], 600_000.0, columns=["weight"])
    want = REFERENCE.radius(*QUERIES, 600_000.0)
    assert result["id"].tolist() == want.indices.tolist()
    assert result["query_index"].tolist() == want.query_index.tolist()
    assert list(result.columns) == ["query_index", "rank", "id", "distance_m", "weight"]
    scalar = pts.radius("pts", 0.0, 0.0, 1.0)
    assert len(scalar) == 0


def test_distance_matrix_to_a_dataset_a_subset_and_a_second_set(pts) -> None:
    m = pts.distance_matrix(QUERIES[0], QUERIES[1], name="pts")
    assert m.shape == (30, 2000) and m.dtype == np.float64
    want = great_circle_m(
        QUERIES[0][:, None], QUERIES[1][:, None], POINTS[0][None, :], POINTS[1][None, :]
    )
    np.testing.assert_allclose(m, want, rtol=0, atol=1e-3)
    sub = pts.distance_matrix(QUERIES[0], QUERIES[1], name="pts", ids=[9, 4])
    np.testing.assert_allclose(sub, want[:, [9, 4]], rtol=0, atol=1e-3)
    pair = pts.distance_matrix(0.0, 0.0, lat2=[0.0, 90.0], lon2=[180.0, 0.0], dtype="float32")
    assert pair.dtype == np.float32 and pair.shape == (1, 2)
    np.testing.assert_allclose(pair, [[np.pi * EARTH_RADIUS_M, np.pi / 2 * EARTH_RADIUS_M]], atol=4)


def test_distance_matrix_argument_errors(pts) -> None:
    with pytest.raises(ValueError, match="dataset name or lat2 and lon2"):
        pts.distance_matrix(0.0, 0.0)
    with pytest.raises(ValueError, match="float64 or float32"):
        pts.distance_matrix(0.0, 0.0, name="pts", dtype="float16")
    with pytest.raises(ValueError, match="1-D of one length"):
        pts.distance_matrix([0.0, 1.0], [0.0], name="pts")


def test_kmeans(pts) -> None:
    out = pts.kmeans("pts", 5, seed=2, n_init=2, return_labels=True)
    assert isinstance(out, KMeansOutcome)
    assert list(out.centroids.columns) == ["cluster", "lat", "lon", "size"]
    assert out.centroids["size"].sum() == 2000
    assert out.earth_radius_m == EARTH_RADIUS_M and out.n_iter >= 1
    assert out.labels is not None and list(out.labels.columns) == ["id", "cluster"]
    assert out.labels["id"].tolist() == list(range(2000))
    want = REFERENCE.kmeans(5, seed=2, n_init=2)
    assert out.inertia_m2 == pytest.approx(want.inertia_m2, rel=1e-6)
    np.testing.assert_array_equal(out.labels["cluster"].to_numpy(), want.labels)
    weighted = pts.kmeans("pts", 5, seed=2, weights="weight")
    assert weighted.labels is None
    assert weighted.inertia_m2 != pytest.approx(out.inertia_m2, rel=1e-3)


def test_server_info(pts) -> None:
    info = pts.server_info()
    assert info.version == geonear.__version__
    assert info.backend == "cpu" and info.earth_radius_m == EARTH_RADIUS_M
    # Every engine it can run, the serving one first, with what each answers.
    assert info.engine == info.engines[0]
    assert [e.name for e in info.engine_descriptions] == list(info.engines)
    assert set(info.capabilities) == {"knn", "radius", "matrix", "kmeans", "spherical-kmeans"}
    assert all(e.device_kind == "cpu" for e in info.engine_descriptions)
    assert "ServerInfo(version=" in repr(info)


# -- errors ----------------------------------------------------------------------------
def _raises(cls: type[geonear.GeoNearError], code: grpc.StatusCode, call, *words: str):
    with pytest.raises(cls) as info:
        call()
    error = info.value
    assert isinstance(error, geonear.GeoNearError)
    assert error.code == code
    assert str(error).startswith(f"{code.name}: ")
    assert isinstance(error.__cause__, grpc.RpcError)
    for word in words:
        assert word in error.message, f"{word!r} not in {error.message!r}"
    return error


def test_errors_map_to_the_hierarchy(pts, frame) -> None:
    _raises(geonear.NotFound, grpc.StatusCode.NOT_FOUND, lambda: pts.info("nope"), "'nope'")
    _raises(
        geonear.NotFound,
        grpc.StatusCode.NOT_FOUND,
        lambda: pts.knn("pts", 0.0, 0.0, columns=["colour"]),
        "'colour'",
    )
    _raises(
        geonear.InvalidArgument,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: pts.knn("pts", 91.0, 0.0),
        "[-90, 90]",
    )
    _raises(
        geonear.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, lambda: pts.knn("pts", 0, 0, k=0)
    )
    _raises(
        geonear.AlreadyExists,
        grpc.StatusCode.ALREADY_EXISTS,
        lambda: pts.upload("pts", frame, lat="latitude", lon="longitude"),
        "replace or append",
    )
    _raises(
        geonear.FailedPrecondition,
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: pts.upload("pts", pd.DataFrame({"lat": [1.0], "lon": [2.0]}), mode="append"),
        "columns and types",
    )
    # the client keeps working after errors
    assert pts.info("pts").rows == 2000


def test_resource_exhausted_names_the_limit(server_factory) -> None:
    running = server_factory(limits=Limits(max_k=5, max_matrix_cells=100))
    with Client(running.target, timeout_s=30) as c:
        c.upload("pts", pa.table({"lat": POINTS[0], "lon": POINTS[1]}))
        error = _raises(
            geonear.ResourceExhausted,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            lambda: c.knn("pts", 0.0, 0.0, k=6),
            "max_k=5",
        )
        assert "GEONEAR_MAX_K" in error.message
        _raises(
            geonear.ResourceExhausted,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            lambda: c.distance_matrix([0.0], [0.0], name="pts"),
            "max_matrix_cells=100",
        )
        assert len(c.knn("pts", 0.0, 0.0, k=5)) == 5


def test_unreachable_server_raises_unavailable(server_factory) -> None:
    running = server_factory(data_dir=None)
    target = running.target
    running.stop()
    with Client(target, timeout_s=5) as c:
        _raises(geonear.Unavailable, grpc.StatusCode.UNAVAILABLE, c.datasets)


def test_deadline_exceeded(pts, server) -> None:
    # a deadline far shorter than a 2000 x 2000 matrix takes
    with Client(server.target, timeout_s=1e-4) as hurried:
        _raises(
            geonear.DeadlineExceeded,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            lambda: hurried.distance_matrix(POINTS[0], POINTS[1], name="pts"),
        )
    assert pts.info("pts").rows == 2000


def test_error_classes_carry_their_code() -> None:
    error = geonear.NotFound("no dataset named 'x'")
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.message == "no dataset named 'x'"
    assert str(error) == "NOT_FOUND: no dataset named 'x'"
    assert geonear.GeoNearError("boom").code == grpc.StatusCode.UNKNOWN


def test_neighbours_come_with_their_coordinates_when_asked(pts) -> None:
    """``lat``/``lon`` among ``columns`` give each neighbour's own coordinates, in both
    layouts and for radius; ``id`` is refused (always returned)."""
    info = pts.info("pts")
    assert "lat" in info.column_names
    near = pts.knn("pts", [10.0, -20.0], [20.0, 30.0], k=3, columns=["lat", "lon"])
    points = pts.within("pts", bbox=(-90.0, -180.0, 90.0, 180.0)).set_index("id")
    for column in ("lat", "lon"):
        np.testing.assert_array_equal(
            near[column].to_numpy(), points.loc[near["id"], column].to_numpy()
        )
    wide = pts.knn("pts", [10.0], [20.0], k=3, columns=["lat"], layout="per_query", as_arrow=True)
    assert wide.column("lat").combine_chunks().flatten().to_pylist() == list(near["lat"][:3])
    around = pts.radius("pts", 10.0, 20.0, radius_m=5e6, columns=["lon"])
    np.testing.assert_array_equal(
        around["lon"].to_numpy(), points.loc[around["id"], "lon"].to_numpy()
    )
    with pytest.raises(geonear.InvalidArgument, match="always returned"):
        pts.knn("pts", 0.0, 0.0, k=1, columns=["id"])
    with pytest.raises(geonear.InvalidArgument, match="always returned"):
        pts.within("pts", bbox=(0.0, 0.0, 1.0, 1.0), columns=["lat"])
