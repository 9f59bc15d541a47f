"""The bulk path: layouts of a streamed answer, query sets sent as a stream, stage times.

A real server on port 0; answers compared with the rows layout and with the numpy-brute
reference engine on the same points.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pyarrow as pa
import pytest

from geonear import wire
from geonear.clients import client as client_module
from geonear.clients.client import Client
from geonear.geometry import EARTH_RADIUS_M, great_circle_m
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service import servicer as servicer_module
from geonear.service.engines import create_engine, gpu_available
from geonear.service.engines.cpu import CPUEngine, KDTreeIndex
from geonear.service.queries import common
from geonear.service.queries import matrix as matrix_module
from geonear.service.queries.joins import join_sides, knn_join, knn_join_slices
from geonear.service.settings import Limits
from geonear.service.store import DatasetStore
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import TIMING_KEY, messages_to_table, parse_timing, points_to_message


def _flat(column: pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks().flatten()


@pytest.fixture
def points_client(server_factory, monkeypatch):
    """A server holding 1,500 clustered points with int ids and a string attribute; the
    client sends 700 query points a message, so that modest query sets stream up."""
    monkeypatch.setattr(client_module, "QUERY_CHUNK", 700)
    server = server_factory()
    lat, lon = clustered_points(1500, seed=3, n_clusters=12, spread_m=50_000.0)
    table = pa.table(
        {
            "id": np.arange(1500, dtype=np.int64) * 7,
            "lat": lat,
            "lon": lon,
            "name": [f"p{i}" for i in range(1500)],
        }
    )
    with Client(server.target, timeout_s=60) as client:
        client.upload("pts", table)
        yield client, lat, lon


def test_per_query_knn_holds_the_rows_layouts_neighbours(points_client):
    client, lat, lon = points_client
    q_lat, q_lon = uniform_points(2000, seed=5)
    rows = client.knn("pts", q_lat, q_lon, 7, columns="name", as_arrow=True)
    wide = client.knn("pts", q_lat, q_lon, 7, columns="name", layout="per_query", as_arrow=True)
    assert wide.schema.field("id").type == pa.list_(pa.int64(), 7)
    assert wide.schema.metadata[b"geonear.layout"] == b"per_query"
    assert wide.num_rows == 2000
    assert _flat(wide.column("id")).equals(rows.column("id").combine_chunks())
    assert _flat(wide.column("name")).equals(rows.column("name").combine_chunks())
    np.testing.assert_array_equal(
        _flat(wide.column("distance_m")).to_numpy(), rows.column("distance_m").to_numpy()
    )
    reference = create_engine("numpy-brute").build_index(lat, lon).knn(q_lat, q_lon, 7)
    np.testing.assert_array_equal(
        _flat(wide.column("id")).to_numpy().reshape(2000, 7), reference.indices * 7
    )


def test_per_query_knn_with_a_distance_bound_has_nulls_where_a_query_has_fewer(points_client):
    client, lat, lon = points_client
    q_lat, q_lon = lat[:50] + 0.01, lon[:50]
    bound = 5_000.0
    rows = client.knn("pts", q_lat, q_lon, 20, max_distance_m=bound, columns="name", as_arrow=True)
    wide = client.knn(
        "pts",
        q_lat,
        q_lon,
        20,
        max_distance_m=bound,
        layout="per_query",
        columns=["name"],
        as_arrow=True,
    )
    counts = np.bincount(rows.column("query_index").to_numpy(), minlength=50)
    assert counts.min() < 20, "the bound should leave some query fewer than k neighbours"
    for name in ("id", "distance_m", "name"):
        values = _flat(wide.column(name))
        present = values.is_valid().to_numpy(zero_copy_only=False).reshape(50, 20)
        # A query's neighbours come first; its missing entries are null, at the end.
        np.testing.assert_array_equal(present.sum(axis=1), counts)
        np.testing.assert_array_equal(present, np.arange(20) < counts[:, None])
        assert values.drop_null().equals(rows.column(name).combine_chunks())


def test_per_query_radius_lists_each_querys_points_in_order(points_client):
    client, _, _ = points_client
    q_lat, q_lon = uniform_points(1600, seed=9)
    rows = client.radius("pts", q_lat, q_lon, 300_000.0, columns="name", as_arrow=True)
    wide = client.radius(
        "pts", q_lat, q_lon, 300_000.0, columns="name", layout="per_query", as_arrow=True
    )
    assert wide.num_rows == 1600
    assert pa.types.is_list(wide.schema.field("id").type)
    lengths = pa.compute.list_value_length(wide.column("id")).to_numpy()
    np.testing.assert_array_equal(
        lengths, np.bincount(rows.column("query_index").to_numpy(), minlength=1600)
    )
    assert _flat(wide.column("id")).equals(rows.column("id").combine_chunks())
    assert _flat(wide.column("name")).equals(rows.column("name").combine_chunks())


def test_a_query_set_of_several_messages_streams_up_and_answers_in_query_order(points_client):
    client, lat, lon = points_client
    q_lat, q_lon = uniform_points(2500, seed=13)  # four messages of at most 700 points
    found = client.knn("pts", q_lat, q_lon, 5, as_arrow=True)
    np.testing.assert_array_equal(
        found.column("query_index").to_numpy(), np.repeat(np.arange(2500), 5)
    )
    reference = create_engine("numpy-brute").build_index(lat, lon).knn(q_lat, q_lon, 5)
    np.testing.assert_array_equal(
        found.column("id").to_numpy().reshape(2500, 5), reference.indices * 7
    )
    near = client.radius("pts", q_lat, q_lon, 100_000.0, as_arrow=True)
    expected = create_engine("numpy-brute").build_index(lat, lon).radius(q_lat, q_lon, 100_000.0)
    np.testing.assert_array_equal(near.column("query_index").to_numpy(), expected.query_index)
    np.testing.assert_array_equal(near.column("id").to_numpy(), expected.indices * 7)


def _request_stream(*messages):
    return iter(messages)


def test_later_messages_of_a_stream_carry_only_points(server_factory):
    server = server_factory()
    lat, lon = uniform_points(100, seed=1)
    with Client(server.target) as client:
        client.upload("few", pa.table({"lat": lat, "lon": lon}))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        first = pb.KnnRequest(dataset="few", k=2, queries=points_to_message(lat[:3], lon[:3]))
        later = pb.KnnRequest(dataset="few", k=9, queries=points_to_message(lat[:3], lon[:3]))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.KnnStream(_request_stream(first, later)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "only query points" in refused.value.details()
        assert "dataset, k" in refused.value.details()
        with pytest.raises(grpc.RpcError) as empty:
            list(stub.RadiusStream(_request_stream()))
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_streamed_answer_says_where_its_time_went(server_factory):
    server = server_factory()
    lat, lon = uniform_points(500, seed=2)
    with Client(server.target) as client:
        client.upload("timed", pa.table({"lat": lat, "lon": lon}))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        q_lat, q_lon = uniform_points(20_000, seed=3)
        call = stub.Knn(
            pb.KnnRequest(dataset="timed", k=10, queries=points_to_message(q_lat, q_lon))
        )
        table = messages_to_table(call)
        stages = parse_timing(dict(call.trailing_metadata())[TIMING_KEY])
    assert table.num_rows == 200_000
    assert set(stages) == {"decode", "search", "assemble", "encode"}
    assert all(seconds >= 0 for seconds in stages.values())
    assert stages["search"] > 0


def test_labels_go_out_in_slices_and_say_where_their_time_went(server_factory, monkeypatch):
    """KMeans and DBSCAN labels are made a slice of rows at a time (ids in row order),
    each call with its stages in the timing trailer."""
    monkeypatch.setattr(common, "SLICE_ROWS", 1000)
    server = server_factory()
    lat, lon = clustered_points(3500, seed=4)
    ids = np.arange(3500) * 7
    with Client(server.target) as client:
        client.upload("labelled", pa.table({"id": ids, "lat": lat, "lon": lon}))
    slices: list[int] = []
    original = common.label_tables

    def counted(*args, **kwargs):
        for table in original(*args, **kwargs):
            slices.append(table.num_rows)
            yield table

    monkeypatch.setattr(servicer_module, "label_tables", counted)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        kmeans = pb.KMeansRequest(dataset="labelled", k=5, return_labels=True)
        dbscan = pb.DbscanRequest(
            dataset="labelled", eps_m=50_000, min_samples=5, return_labels=True
        )
        for call in (stub.KMeans(kmeans), stub.Dbscan(dbscan)):
            messages = list(call)
            labels = messages_to_table(m.labels for m in messages[1:])
            np.testing.assert_array_equal(labels.column("id").to_numpy(), ids)
            stages = parse_timing(dict(call.trailing_metadata())[TIMING_KEY])
            assert set(stages) == {"decode", "search", "assemble", "encode"}
    assert slices == [1000, 1000, 1000, 500] * 2


def test_a_matrix_is_computed_in_blocks_and_sent_in_tiles(server_factory, monkeypatch):
    """One engine call per block of whole tile rows (not one a tile), tiles of at most
    TILE_BYTES in row-major order, the same values, and the stages in the trailer."""
    monkeypatch.setattr(matrix_module, "TILE_BYTES", 8 * 1000)
    monkeypatch.setattr(matrix_module, "BLOCK_BYTES", 8 * 1000 * 10)
    calls: list[tuple[int, int]] = []
    original = CPUEngine.distance_matrix

    def spied(self, lat1, lon1, lat2, lon2, dtype="float64"):
        calls.append((len(lat1), len(lat2)))
        return original(self, lat1, lon1, lat2, lon2, dtype)

    monkeypatch.setattr(CPUEngine, "distance_matrix", spied)
    server = server_factory()
    rows, cols = uniform_points(95, seed=5), uniform_points(2500, seed=6)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GeoNearStub(channel)
        request = pb.DistanceMatrixRequest(
            queries=points_to_message(*rows), targets=points_to_message(*cols)
        )
        call = stub.DistanceMatrix(request)
        tiles = list(call)
        stages = parse_timing(dict(call.trailing_metadata())[TIMING_KEY])
    # A tile is 1 row x 1,000 columns; a block is 10 tiles: 4 rows of 2,500 columns.
    assert calls == [(4, 2500)] * 23 + [(3, 2500)]
    assert len(tiles) == 95 * 3 and all(len(t.values) <= 8 * 1000 for t in tiles)
    starts = [(t.row_start, t.col_start) for t in tiles]
    assert starts == sorted(starts)
    got = np.zeros((95, 2500))
    for t in tiles:
        got[t.row_start : t.row_start + t.row_count, t.col_start : t.col_start + t.col_count] = (
            np.frombuffer(t.values, dtype="<f8").reshape(t.row_count, t.col_count)
        )
    expected = great_circle_m(rows[0][:, None], rows[1][:, None], cols[0][None], cols[1][None])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-3)
    assert set(stages) == {"decode", "search", "encode"}


def test_an_unknown_layout_is_refused(points_client):
    client, _, _ = points_client
    with pytest.raises(ValueError, match="layout must be one of"):
        client.knn("pts", 0.0, 0.0, 3, layout="wide")


def test_bench_served_runs_the_engine_in_process_and_through_a_server(tmp_path):
    done = subprocess.run(
        [
            *(sys.executable, "-m", "geonear", "bench", "--served", "--engines", "cpu"),
            *("--n", "2000", "--queries", "3000", "-k", "5", "--repeat", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "in-process" in done.stdout and "served" in done.stdout
    for stage in ("search", "encode", "receive", "decode Arrow", "to_pandas"):
        assert stage in done.stdout
    assert "--served" in done.stdout
    if sys.platform == "linux":  # the server's CPU time is read from /proc
        assert "CPU ms a call" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}")
def test_the_gpu_engine_answers_streamed_per_query_calls_as_the_reference(
    server_factory, monkeypatch
):
    monkeypatch.setattr(client_module, "QUERY_CHUNK", 5000)
    server = server_factory(data_dir=None, backend="gpu")
    lat, lon = clustered_points(20_000, seed=4, n_clusters=30, spread_m=30_000.0)
    q_lat, q_lon = uniform_points(12_000, seed=6)
    reference = create_engine("numpy-brute").build_index(lat, lon)
    with Client(server.target, timeout_s=120) as client:
        client.upload("pts", pa.table({"id": np.arange(20_000) * 3, "lat": lat, "lon": lon}))
        wide = client.knn("pts", q_lat, q_lon, 8, layout="per_query", as_arrow=True)
        near = client.radius("pts", q_lat, q_lon, 50_000.0, layout="per_query", as_arrow=True)
    expected = reference.knn(q_lat, q_lon, 8)
    np.testing.assert_array_equal(
        _flat(wide.column("id")).to_numpy().reshape(12_000, 8), expected.indices * 3
    )
    np.testing.assert_allclose(
        _flat(wide.column("distance_m")).to_numpy().reshape(12_000, 8),
        expected.distances_m,
        rtol=0,
        atol=1e-3,
    )
    found = reference.radius(q_lat, q_lon, 50_000.0)
    np.testing.assert_array_equal(
        pa.compute.list_value_length(near.column("id")).to_numpy(), np.diff(found.offsets)
    )
    np.testing.assert_array_equal(_flat(near.column("id")).to_numpy(), found.indices * 3)


@pytest.mark.parametrize("rows", [0, 1, 70_000])
def test_encoded_messages_are_the_protobuf_messages_bytes(rows: int) -> None:
    """The server's ArrowData written directly in the wire format is byte for byte what
    protobuf writes for the same messages (an empty stream: the schema alone)."""
    table = pa.table(
        {
            "id": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 3)), 3),
            "distance_m": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(rows * 3)), 3),
        }
    ).replace_schema_metadata({"geonear.layout": "per_query"})
    encoded = list(wire.tables_to_encoded([table], batch_bytes=1 << 18))
    messages = list(wire.tables_to_messages([table], batch_bytes=1 << 18))
    assert [e.data for e in encoded] == [m.SerializeToString() for m in messages]
    assert [e.row_count for e in encoded] == [m.row_count for m in messages]
    assert [wire.serialized(e) for e in encoded] == [wire.serialized(m) for m in messages]
    assert len(encoded) == max(1, -(-rows * 48 // (1 << 18)))
    decoded = wire.messages_to_table(pb.ArrowData.FromString(e.data) for e in encoded)
    assert decoded.equals(table) and decoded.schema.metadata == table.schema.metadata


def test_record_batches_are_arrows_own_messages_written_from_the_columns() -> None:
    """Each message's record batch, written from views of the columns, is byte for byte
    ``RecordBatch.serialize`` of the same rows, and the first message's schema is
    ``Schema.serialize``: buffers whose lengths need padding, nulls, strings, booleans,
    slices, and a stream of several tables."""
    n = 10_007
    table = pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int32)),
            "name": pa.array([None if i % 7 == 0 else f"p{i}" for i in range(n)]),
            "flag": pa.array(np.arange(n) % 3 == 0),
            "near": pa.FixedSizeListArray.from_arrays(pa.array(np.random.rand(3 * n)), 3),
        }
    ).replace_schema_metadata({"geonear.layout": "per_query"})
    pieces = [table.slice(0, 5_001), table.slice(5_001, 3), table.slice(5_004)]
    messages = list(wire.tables_to_messages(pieces, batch_bytes=1 << 16))
    batches = [
        batch
        for piece in pieces
        for batch in piece.to_batches(
            max_chunksize=max(1, (1 << 16) // max(1, piece.nbytes // piece.num_rows))
        )
    ]
    assert len(messages) == len(batches) > 3
    assert messages[0].schema == table.schema.serialize().to_pybytes()
    assert all(not m.schema for m in messages[1:])
    assert [m.record_batch for m in messages] == [b.serialize().to_pybytes() for b in batches]
    assert wire.messages_to_table(messages).equals(table)


def test_made_ahead_makes_one_item_ahead_on_another_thread() -> None:
    """made_ahead keeps the order, makes the next item on a thread of its own (one ahead
    at most), raises an item's error at that item, and closing it early closes the
    source once the item in flight is made."""
    made: list[tuple[int, str]] = []
    closed = threading.Event()

    def items(fail_at: int | None = None):
        try:
            for i in range(5):
                if i == fail_at:
                    raise ValueError(f"item {i}")
                made.append((i, threading.current_thread().name))
                yield i
        finally:
            closed.set()

    seen = []
    for item in common.made_ahead(items()):
        assert len(made) <= len(seen) + 2  # this item and the next one
        seen.append(item)
    assert seen == [0, 1, 2, 3, 4] and closed.is_set()
    assert all(name.startswith("geonear-search") for _, name in made)

    made.clear()
    closed.clear()
    ahead = common.made_ahead(items())
    assert next(ahead) == 0
    ahead.close()
    assert closed.is_set() and [i for i, _ in made] in ([0], [0, 1])

    with pytest.raises(ValueError, match="item 2"):
        seen = []
        for item in common.made_ahead(items(fail_at=2)):
            seen.append(item)
    assert seen == [0, 1]


def test_the_next_slice_is_searched_while_this_one_is_used() -> None:
    """searched_ahead keeps the order, runs one search ahead at most (on another thread),
    waits for it when closed early, and passes a search's error on at its slice."""
    started: list[int] = []
    running = threading.Semaphore(2)  # the caller's slice and one ahead

    def search(start: int, stop: int) -> list[int]:
        assert running.acquire(blocking=False), "more than one search ahead"
        started.append(start)
        time.sleep(0.01)
        return list(range(start, stop))

    bounds = [(0, 3), (3, 5), (5, 9), (9, 10)]
    seen = []
    for start, stop, found in common.searched_ahead(bounds, search):
        assert found == list(range(start, stop))
        assert len(started) <= len(seen) + 2  # this slice's search and the next one's
        seen.append((start, stop))
        running.release()
    assert seen == bounds and started == [0, 3, 5, 9]

    started.clear()
    running = threading.Semaphore(2)
    iterator = common.searched_ahead(bounds, search)
    next(iterator)
    iterator.close()  # waits for the search in flight (if it started); no other starts
    assert started in ([0], [0, 3])

    def failing(start: int, stop: int) -> list[int]:
        if start == 5:
            raise ValueError("no index")
        return [start]

    got = []
    with pytest.raises(ValueError, match="no index"):
        for start, _, _ in common.searched_ahead(bounds, failing):
            got.append(start)
    assert got == [0, 3]
    assert [s for s, _, _ in common.searched_ahead([(0, 4)], failing)] == [0]


class _GatheringIndex(KDTreeIndex):
    """The cpu engine's index, gathering each neighbour's id where it searches, as the
    GPU engine does on the device (``knn_with_ids``): the answer tables must be the
    ones made from the rows. Where a row is -1 its gathered id is any id."""

    calls = 0

    def knn_with_ids(self, lat, lon, k, max_distance_m, ids):
        found = self.knn(lat, lon, k, max_distance_m)
        type(self).calls += 1
        return dataclasses.replace(found, ids=ids[np.maximum(found.indices, 0)])


class _GatheringEngine(CPUEngine):
    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> KDTreeIndex:
        return _GatheringIndex(lat, lon, self.earth_radius_m, self.workers)


@pytest.mark.parametrize("first_id", [0, 2**40], ids=["narrow-ids", "wide-ids"])
@pytest.mark.parametrize("max_distance_m", [None, 300_000.0], ids=["all-found", "bounded"])
def test_ids_an_engine_gathers_give_the_tables_the_rows_give(
    first_id: int, max_distance_m: float | None
) -> None:
    limits = Limits()
    answers = []
    for engine in (CPUEngine(), _GatheringEngine()):
        store = DatasetStore(engine, None, limits)
        for name, n in (("left", 700), ("right", 300)):
            lat, lon = clustered_points(n, seed=1, n_clusters=5, spread_m=200_000.0)
            ids = first_id + 7 * np.arange(n, dtype=np.int64)
            store.upload(name, "create", pa.table({"id": ids, "lat": lat, "lon": lon}))
        sides = join_sides(store.get("left"), store.get("right"), right_columns=["lat"])
        join = knn_join(sides, 4, max_distance_m=max_distance_m, limits=limits)
        (piece,) = knn_join_slices(join)
        answers.append(
            (
                piece,
                {
                    (layout, narrow): piece.table(EARTH_RADIUS_M, layout, narrow_ids=narrow)
                    for layout in common.LAYOUTS
                    for narrow in (False, True)
                },
            )
        )
    (made, want), (gathered, got) = answers
    assert made.found.gathered_ids is None and gathered.found.gathered_ids is not None
    missing = (gathered.found.indices < 0).sum()
    assert (missing > 0) == (max_distance_m is not None) and missing < gathered.found.indices.size
    for key, table in want.items():
        assert got[key].equals(table, check_metadata=True), key
