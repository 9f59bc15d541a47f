"""KnnJoin and RadiusJoin: two stored datasets joined in the server.

Every left point's neighbours among the right points (optionally filtered) match the
float64 reference on every engine, on uniform, clustered and edge data, with filters
keeping all, 1%, one and none of the right points and k beyond what they keep; a
dataset joins with itself; columns of both sides come back named as geopandas names
them; the answer streams in slices of left points, in both layouts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from analytics_data import (
    DATA,
    FILTERS,
    LEFT,
    RADIUS_M,
    TABLES,
    cpu_engine_params,
    engine_server,
    knn_from_rows,
    queries,
    radius_from_rows,
    reference_knn,
    reference_radius,
    selection_mask,
)
from test_engine_parity import assert_same_neighbours

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.clients.errors import InvalidArgument, NotFound, ResourceExhausted
from geonear.geometry import great_circle_m
from geonear.service.queries import common
from geonear.service.server import build_server
from geonear.service.settings import Limits, ServerSettings


def _lat_lon(t: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    return t.column("lat").to_numpy(), t.column("lon").to_numpy()


@pytest.fixture(scope="module", params=cpu_engine_params())
def served(request: pytest.FixtureRequest) -> Iterator[Client]:
    with engine_server(request.param, {**TABLES, **LEFT}) as client:
        yield client


# -- parity with the reference ------------------------------------------------------------
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kept", FILTERS)
def test_knn_join_is_the_reference_knn_of_every_left_point(
    served: Client, data: str, kept: str
) -> None:
    right = TABLES[data]
    lat, lon = _lat_lon(right)
    q_lat, q_lon = queries(data)
    k = 6  # more than "one" keeps
    mask = selection_mask(right, kept)
    want = reference_knn(lat, lon, mask, q_lat, q_lon, k)
    found = served.knn_join(f"{data}_q", data, k, where=FILTERS[kept], as_arrow=True)
    assert isinstance(found, pa.Table)
    assert found.column_names == ["left_id", "rank", "right_id", "distance_m"]
    got = knn_from_rows(found, q_lat.shape[0], min(k, int(mask.sum())), "left_id")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))
    left_ids = found.column("left_id").to_numpy()
    assert np.all(np.diff(left_ids) >= 0), "rows in left order"


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kept", FILTERS)
def test_radius_join_is_the_reference_radius_of_every_left_point(
    served: Client, data: str, kept: str
) -> None:
    right = TABLES[data]
    lat, lon = _lat_lon(right)
    q_lat, q_lon = queries(data)
    want = reference_radius(lat, lon, selection_mask(right, kept), q_lat, q_lon, RADIUS_M[data])
    found = served.radius_join(
        f"{data}_q", data, RADIUS_M[data], where=FILTERS[kept], as_arrow=True
    )
    assert isinstance(found, pa.Table)
    got = radius_from_rows(found, q_lat.shape[0], "left_id")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))


@pytest.mark.parametrize("data", DATA)
def test_a_dataset_joined_with_itself_finds_each_point_at_0_m(served: Client, data: str) -> None:
    t = TABLES[data]
    lat, lon = _lat_lon(t)
    found = served.knn_join(data, data, k=3, as_arrow=True)
    assert isinstance(found, pa.Table)
    want = reference_knn(lat, lon, np.ones(t.num_rows, bool), lat, lon, 3)
    got = knn_from_rows(found, t.num_rows, 3, "left_id")
    assert_same_neighbours(got, want, queries=(lat, lon), points=(lat, lon))
    nearest = found.filter(pc.equal(found.column("rank"), 0))
    assert nearest.num_rows == t.num_rows
    assert pc.max(nearest.column("distance_m")).as_py() < 1e-3
    # Where a point has no duplicate, its nearest is itself; duplicates tie at 0 m and
    # the first of them in row order comes first.
    _, first_row = np.unique(np.stack([lat, lon]), axis=1, return_index=True)
    unique = np.zeros(t.num_rows, bool)
    unique[first_row] = True
    ids = nearest.column("right_id").to_numpy()
    assert np.array_equal(ids[unique], np.flatnonzero(unique))


def test_knn_join_with_max_distance(served: Client) -> None:
    right = TABLES["uniform"]
    lat, lon = _lat_lon(right)
    q_lat, q_lon = queries("uniform")
    want = reference_knn(lat, lon, np.ones(right.num_rows, bool), q_lat, q_lon, 8, 900_000.0)
    found = served.knn_join("uniform_q", "uniform", 8, max_distance_m=900_000.0, as_arrow=True)
    got = knn_from_rows(found, q_lat.shape[0], 8, "left_id")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))


# -- columns and layouts ------------------------------------------------------------------
@pytest.fixture
def loaded(client: Client) -> Client:
    client.upload("pts", TABLES["uniform"])
    stores = TABLES["uniform"].slice(0, 50).select(["lat", "lon", "kind", "score"])
    client.upload("stores", stores.append_column("left_id", pa.array(np.arange(50) * 10)))
    return client


def test_columns_of_both_sides_are_named_as_geopandas_names_them(loaded: Client) -> None:
    found = loaded.knn_join(
        "stores",
        "pts",
        2,
        left_columns=["kind", "score", "left_id"],
        right_columns=["kind", "bucket", "lat"],
    )
    assert list(found.columns) == [
        "left_id",
        "rank",
        "right_id",
        "distance_m",
        "kind_left",
        "score",
        "left_id_left",
        "kind_right",
        "bucket",
        "lat",
    ]
    pts = TABLES["uniform"].to_pandas()
    stores = loaded.info("stores")
    assert stores.rows == 50
    right = pts.set_index("id").loc[found["right_id"]]
    assert found["kind_right"].tolist() == right["kind"].tolist()
    assert found["bucket"].tolist() == right["bucket"].tolist()
    assert found["lat"].tolist() == right["lat"].tolist()
    assert found["left_id_left"].tolist() == (found["left_id"] * 10).tolist()
    assert found["kind_left"].tolist() == pts["kind"].iloc[found["left_id"]].tolist()


def test_the_per_query_layout_holds_the_rows_layout_by_left_point(loaded: Client) -> None:
    kwargs: dict[str, Any] = {"left_columns": ["kind"], "right_columns": ["kind", "score"]}
    for call, arg in ((loaded.knn_join, 4), (loaded.radius_join, 1_500_000.0)):
        rows = call("stores", "pts", arg, **kwargs)
        per_query = call("stores", "pts", arg, layout="per_query", **kwargs)
        assert isinstance(rows, pd.DataFrame) and isinstance(per_query, pd.DataFrame)
        assert list(per_query.columns) == [
            "left_id",
            "right_id",
            "distance_m",
            "kind_left",
            "kind_right",
            "score",
        ]
        assert per_query["left_id"].tolist() == list(range(50))
        exploded = per_query.explode(["right_id", "distance_m", "kind_right", "score"])
        exploded = exploded.dropna(subset=["right_id"])
        assert exploded["right_id"].astype(int).tolist() == rows["right_id"].tolist()
        assert exploded["kind_right"].tolist() == rows["kind_right"].tolist()
        assert exploded["kind_left"].tolist() == rows["kind_left"].tolist()
        np.testing.assert_array_equal(
            exploded["distance_m"].astype(float), rows["distance_m"].to_numpy()
        )


def test_a_join_streams_in_slices_of_left_points(
    loaded: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole_knn = loaded.knn_join("pts", "pts", 3, right_columns="kind", as_arrow=True)
    whole_radius = loaded.radius_join("pts", "pts", 800_000.0, right_columns="kind", as_arrow=True)
    monkeypatch.setattr(common, "SLICE_ROWS", 64)  # about 20 left points a slice
    assert loaded.knn_join("pts", "pts", 3, right_columns="kind", as_arrow=True).equals(whole_knn)
    sliced = loaded.radius_join("pts", "pts", 800_000.0, right_columns="kind", as_arrow=True)
    assert sliced.equals(whole_radius)
    per_query = loaded.radius_join("pts", "pts", 800_000.0, layout="per_query", as_arrow=True)
    assert per_query.column("left_id").to_pylist() == list(range(TABLES["uniform"].num_rows))
    assert pc.sum(pc.list_value_length(per_query.column("right_id"))).as_py() == len(whole_radius)


def test_string_ids_on_either_side(loaded: Client) -> None:
    named = pa.table({"id": ["x", "y"], "lat": [10.0, 90.0], "lon": [20.0, 0.0], "k": ["a", "b"]})
    loaded.upload("named", named)
    found = loaded.knn_join("named", "pts", 1, right_columns="kind")
    assert found["left_id"].tolist() == ["x", "y"]
    assert found["distance_m"].max() < 1e-3  # both points are in pts
    back = loaded.knn_join("pts", "named", 1, left_columns="kind", as_arrow=True)
    lat, lon = _lat_lon(TABLES["uniform"])
    to_y_nearer = great_circle_m(lat, lon, 90.0, 0.0) < great_circle_m(lat, lon, 10.0, 20.0)
    assert back.column("right_id").to_pylist() == np.where(to_y_nearer, "y", "x").tolist()


@pytest.mark.parametrize(
    ("call", "kwargs", "error", "words"),
    [
        ("knn_join", {"left": "nope", "right": "pts"}, NotFound, "nope"),
        ("knn_join", {"left": "pts", "right": "nope"}, NotFound, "nope"),
        ("knn_join", {"left": "pts", "right": "pts", "k": 0}, InvalidArgument, "k"),
        ("knn_join", {"left": "pts", "right": "pts", "right_columns": "id"}, InvalidArgument, "id"),
        ("knn_join", {"left": "pts", "right": "pts", "left_columns": "x"}, NotFound, "'x'"),
        ("knn_join", {"left": "pts", "right": "pts", "left_columns": ["kind", "kind"]},
         InvalidArgument, "twice"),
        ("knn_join", {"left": "pts", "right": "pts", "where": [("kind", ">", 1)]},
         InvalidArgument, "'kind'"),
        ("radius_join", {"left": "pts", "right": "pts", "radius_m": -1.0}, InvalidArgument,
         "radius_m"),
    ],
)  # fmt: skip
def test_bad_joins_are_refused(
    loaded: Client, call: str, kwargs: dict[str, Any], error: type, words: str
) -> None:
    if call == "radius_join":
        kwargs.setdefault("radius_m", 1.0)
    with pytest.raises(error) as caught:
        getattr(loaded, call)(**kwargs)
    assert words in caught.value.message


def test_joins_beyond_max_result_rows_are_refused_before_the_search() -> None:
    settings = ServerSettings(
        host="127.0.0.1", port=0, data_dir=None, backend="cpu", limits=Limits(max_result_rows=1000)
    )
    parts = build_server(settings)
    parts.server.start()
    try:
        with Client(f"127.0.0.1:{parts.port}", timeout_s=60) as client:
            client.upload("pts", TABLES["uniform"])
            with pytest.raises(ResourceExhausted, match="max_result_rows=1000"):
                client.knn_join("pts", "pts", 1)
            with pytest.raises(ResourceExhausted, match="max_result_rows=1000"):
                client.radius_join("pts", "pts", 1.0)
            # No right point selected: an answer of no rows, within the cap.
            assert len(client.knn_join("pts", "pts", 1, where=[("bucket", "<", 0)])) == 0
    finally:
        parts.stop(None)


# -- the command line -------------------------------------------------------------------
def test_join_commands(
    loaded: Client, server: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "join.csv"
    code = main(
        ["knn-join", "stores", "pts", "-k", "2", "--target", server.target,
         "--left-columns", "kind", "--right-columns", "kind,bucket",
         "--where", "bucket >= 50", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    written = pd.read_csv(out)
    want = loaded.knn_join(
        "stores", "pts", 2, left_columns="kind", right_columns=["kind", "bucket"],
        where=[("bucket", ">=", 50)],
    )  # fmt: skip
    assert written["right_id"].tolist() == want["right_id"].tolist()
    assert list(written.columns) == list(want.columns)
    assert (written["bucket"] >= 50).all()
    capsys.readouterr()
    code = main(
        ["radius-join", "stores", "pts", "--radius-m", "500000", "--target", server.target,
         "--limit", "3"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "within 500000.0 m of each of" in " ".join(printed.split())
    assert "more rows" in printed
    assert (
        main(["radius-join", "stores", "nope", "--radius-m", "1", "--target", server.target]) == 1
    )
    assert "NOT_FOUND" in capsys.readouterr().err
