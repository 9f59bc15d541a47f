"""CountWithin: exact counts of points within a radius, without the points.

Counts around query points, and around every point of a stored dataset, match the
float64 reference's radius answer (its number of neighbours per query) on every engine,
filtered or not, on uniform, clustered and edge data; the answer comes in slices, in
query order; bad requests are refused before any counting.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from analytics_data import (
    DATA,
    FILTERS,
    LEFT,
    RADIUS_M,
    TABLES,
    cpu_engine_params,
    engine_server,
    queries,
    reference_radius,
    selection_mask,
)

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.clients.errors import InvalidArgument, NotFound, ResourceExhausted
from geonear.service import servicer as servicer_module
from geonear.service.queries import counts as counts_module
from geonear.service.server import build_server
from geonear.service.settings import Limits, ServerSettings
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import messages_to_table


def _expected(data: str, kept: str, q_lat: np.ndarray, q_lon: np.ndarray) -> np.ndarray:
    t = TABLES[data]
    lat, lon = t.column("lat").to_numpy(), t.column("lon").to_numpy()
    found = reference_radius(lat, lon, selection_mask(t, kept), q_lat, q_lon, RADIUS_M[data])
    return np.diff(found.offsets)


@pytest.fixture(scope="module", params=cpu_engine_params())
def served(request: pytest.FixtureRequest) -> Iterator[Client]:
    with engine_server(request.param, {**TABLES, **LEFT}) as client:
        yield client


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kept", FILTERS)
def test_counts_around_query_points_are_the_reference_radius_counts(
    served: Client, data: str, kept: str
) -> None:
    q_lat, q_lon = queries(data)
    found = served.count_within(data, q_lat, q_lon, RADIUS_M[data], where=FILTERS[kept])
    assert list(found.columns) == ["query_index", "count"]
    assert found["query_index"].tolist() == list(range(q_lat.shape[0]))
    assert found["count"].dtype == np.int64
    np.testing.assert_array_equal(found["count"], _expected(data, kept, q_lat, q_lon))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kept", ["all", "one_percent"])
def test_counts_around_a_stored_dataset_are_the_reference_radius_counts(
    served: Client, data: str, kept: str
) -> None:
    found = served.count_within(
        data, left=f"{data}_q", radius_m=RADIUS_M[data], where=FILTERS[kept]
    )
    assert list(found.columns) == ["left_id", "count"]
    assert found["left_id"].tolist() == list(range(LEFT[f"{data}_q"].num_rows))
    np.testing.assert_array_equal(found["count"], _expected(data, kept, *queries(data)))


def test_a_dataset_counted_around_itself_counts_each_point_and_its_duplicates(
    served: Client,
) -> None:
    found = served.count_within("edge", left="edge", radius_m=0.0)
    t = TABLES["edge"]
    lat, lon = t.column("lat").to_numpy(), t.column("lon").to_numpy()
    want = reference_radius(lat, lon, np.ones(t.num_rows, bool), lat, lon, 0.0)
    counts = found["count"].to_numpy()
    np.testing.assert_array_equal(counts, np.diff(want.offsets))
    assert counts.min() >= 1 and counts.max() >= 6  # (10, 20) is there six times


def test_counts_are_the_rows_radius_returns(served: Client) -> None:
    q_lat, q_lon = queries("clustered")
    where = [("kind", "in", ["a", "b"])]
    counts = served.count_within("clustered", q_lat, q_lon, 25_000.0, where=where)
    rows = served.radius("clustered", q_lat, q_lon, radius_m=25_000.0, where=where)
    per_query = np.bincount(rows["query_index"], minlength=q_lat.shape[0])
    np.testing.assert_array_equal(counts["count"], per_query)


# -- the answer's form --------------------------------------------------------------------
@pytest.fixture
def loaded(client: Client) -> Client:
    client.upload("pts", TABLES["uniform"])
    return client


def test_a_large_left_set_is_counted_and_sent_in_slices_in_order(
    loaded: Client, stub: pb_grpc.GeoNearStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(counts_module, "COUNT_SEARCH", 300)
    counted: list[int] = []
    original = counts_module.count_tables

    def spied(query, *args, **kwargs):
        original_count = query.points.index.radius_count

        def radius_count(lat, lon, radius_m):
            counted.append(len(lat))
            return original_count(lat, lon, radius_m)

        monkeypatch.setattr(query.points.index, "radius_count", radius_count)
        return original(query, *args, **kwargs)

    monkeypatch.setattr(servicer_module, "count_tables", spied)
    request = pb.CountWithinRequest(dataset="pts", left_dataset="pts", radius_m=500_000.0)
    messages = list(stub.CountWithin(request))
    n = TABLES["uniform"].num_rows
    # Counted 300 queries an engine call, each call's counts a table (and here a message).
    assert counted == [300] * (n // 300) + ([n % 300] if n % 300 else [])
    assert sum(1 for m in messages if m.record_batch) == len(counted)
    found = messages_to_table(messages)
    monkeypatch.undo()
    whole = loaded.count_within("pts", left="pts", radius_m=500_000.0, as_arrow=True)
    assert found.equals(whole)
    assert found.schema.metadata[b"geonear.left_dataset"] == b"pts"


def test_string_ids_of_the_left_dataset_come_back_as_left_id(loaded: Client) -> None:
    names = pa.table({"id": ["x", "y", "z"], "lat": [0.0, 10.0, 90.0], "lon": [0.0, 20.0, 0.0]})
    loaded.upload("named", names)
    found = loaded.count_within("pts", left="named", radius_m=1.0, as_arrow=True)
    assert found.column("left_id").to_pylist() == ["x", "y", "z"]
    # (10, 20) is there three times; the north pole twice, at longitudes 0 and 123.
    assert found.column("count").to_pylist() == [0, 3, 2]


def test_query_frames_keep_their_index_and_large_sets_go_in_parts(loaded: Client) -> None:
    frame = pd.DataFrame({"lat": [10.0, 0.0], "lon": [20.0, 0.0]}, index=["here", "there"])
    found = loaded.count_within("pts", frame, radius_m=0.0)
    assert found.index.tolist() == ["here", "there"] and found["count"].tolist() == [3, 0]
    n = 70_000  # beyond one request message of query points
    lat = np.full(n, 10.0)
    lon = np.full(n, 20.0)
    many = loaded.count_within("pts", lat, lon, radius_m=1.0)
    assert many["query_index"].tolist() == list(range(n))
    assert (many["count"] == 3).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"radius_m": -1.0, "lat": [0.0], "lon": [0.0]}, InvalidArgument, "radius_m"),
        ({"radius_m": float("nan"), "left": "pts"}, InvalidArgument, "radius_m"),
        ({"radius_m": 1.0, "left": "nope"}, NotFound, "nope"),
        ({"radius_m": 1.0, "lat": [91.0], "lon": [0.0]}, InvalidArgument, "lat"),
        ({"radius_m": 1.0, "left": "pts", "where": [("x", "==", 1)]}, InvalidArgument, "'x'"),
    ],
)
def test_bad_count_requests_are_refused(
    loaded: Client, kwargs: dict[str, Any], error: type, words: str
) -> None:
    with pytest.raises(error) as caught:
        loaded.count_within("pts", **kwargs)
    assert words in caught.value.message


def test_points_and_a_left_dataset_exclude_each_other(
    loaded: Client, stub: pb_grpc.GeoNearStub
) -> None:
    both = pb.CountWithinRequest(
        dataset="pts", left_dataset="pts", queries=pb.Points(lat=[0.0], lon=[0.0]), radius_m=1.0
    )
    neither = pb.CountWithinRequest(dataset="pts", radius_m=1.0)
    for request in (both, neither):
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.CountWithin(request))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "left dataset" in caught.value.details()
    with pytest.raises(ValueError, match="not both"):
        loaded.count_within("pts", [0.0], [0.0], 1.0, left="pts")


def test_counts_beyond_max_result_rows_are_refused_before_counting() -> None:
    settings = ServerSettings(
        host="127.0.0.1", port=0, data_dir=None, backend="cpu", limits=Limits(max_result_rows=100)
    )
    parts = build_server(settings)
    parts.server.start()
    try:
        with Client(f"127.0.0.1:{parts.port}", timeout_s=60) as client:
            client.upload("pts", TABLES["uniform"])
            with pytest.raises(ResourceExhausted, match="max_result_rows=100"):
                client.count_within("pts", left="pts", radius_m=1.0)
            assert len(client.count_within("pts", np.zeros(100), np.zeros(100), 1.0)) == 100
    finally:
        parts.stop(None)


# -- the command line -------------------------------------------------------------------
def test_count_within_command(
    loaded: Client, server: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["count-within", "pts", "--lat", "10,0", "--lon", "20,0", "--radius-m", "0",
         "--target", server.target]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "count" in printed and "query_index" in printed
    out = tmp_path / "counts.csv"
    code = main(
        ["count-within", "pts", "--left", "pts", "--radius-m", "500000", "--target",
         server.target, "--where", "kind == 'a'", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    written = pd.read_csv(out)
    want = loaded.count_within("pts", left="pts", radius_m=500_000.0, where=[("kind", "==", "a")])
    assert written["left_id"].tolist() == want["left_id"].tolist()
    assert written["count"].tolist() == want["count"].tolist()
    code = main(
        ["count-within", "pts", "--left", "pts", "--lat", "1", "--lon", "2", "--radius-m", "1",
         "--target", server.target]
    )  # fmt: skip
    assert code == 2 and "not both" in capsys.readouterr().err
