"""Areas as selections (``within=``): exact answers among the points inside an area.

Knn, Radius, the joins, CountWithin, KMeans, Dbscan and DistanceMatrix given a box or a
spherical polygon search only the points inside it (and those ``where`` selects, when
both are given), on every engine: the float64 reference run on exactly those points.
Which points are inside is decided by a reference written another way: boxes by their
bounds, polygons by the winding-number test of ``test_areas`` (stars drawn around the
north pole and across the antimeridian). An area of no points answers empty; a bad area
is INVALID_ARGUMENT with the reason; every form the client takes gives the same answer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from analytics_data import (
    DATA,
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
)
from test_areas import StarRing, star, xyz
from test_engine_parity import assert_same_neighbours

from geonear.clients.areas import within_message
from geonear.clients.cli import main
from geonear.clients.client import QUERY_CHUNK, Client
from geonear.clients.errors import InvalidArgument
from geonear.service.analytics import Bbox, SphericalPolygon, polygon_mask
from geonear.service.engines import create_engine
from geonear.service.queries.filters import FilteredIndexes, parse_filter
from geonear.service.store import DatasetStore
from geonear.service.validation import normalise_upload
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import messages_to_table

#: Stars of great-circle edges around the north pole and across 180 degrees.
AROUND_POLE = star(90.0, 0.0, 20.0, 35.0, k=9, seed=3)
ACROSS_180 = star(5.0, 180.0, 8.0, 20.0, k=8, seed=4)


def _geojson(ring: StarRing) -> dict[str, Any]:
    positions = [[float(lon), float(lat)] for lat, lon in zip(ring.lat, ring.lon, strict=True)]
    return {"type": "Polygon", "coordinates": [[*positions, positions[0]]]}


#: Areas as ``within=`` takes them: boxes (min_lat, min_lon, max_lat, max_lon) across the
#: antimeridian, one reaching the north pole; polygons; and a box holding no point.
AREAS: dict[str, Any] = {
    "box_across_180": (-50.0, 170.0, 50.0, -170.0),
    "box_to_pole": (60.0, 170.0, 90.0, -170.0),
    "polygon_around_pole": _geojson(AROUND_POLE),
    "polygon_across_180": _geojson(ACROSS_180),
    "empty": (33.0, 44.0, 33.0001, 44.0001),
}
RINGS = {"polygon_around_pole": AROUND_POLE, "polygon_across_180": ACROSS_180}
#: A filter keeping half of the points (``table`` fills ``kind`` with a, b, c, d by row).
HALF: Any = [("kind", "in", ["a", "b"])]


def _lat_lon(t: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    return t.column("lat").to_numpy(), t.column("lon").to_numpy()


def _box_mask(box: tuple[float, ...], lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """By the bounds; the boxes here cross 180 (both 180 and -180 are in them) and a
    pole has every longitude."""
    min_lat, min_lon, max_lat, max_lon = box
    in_lat = (lat >= min_lat) & (lat <= max_lat)
    if min_lon > max_lon:
        in_lon = (lon >= min_lon) | (lon <= max_lon)
    else:
        in_lon = (lon >= min_lon) & (lon <= max_lon)
    return in_lat & (in_lon | (np.abs(lat) == 90.0))


@functools.cache
def inside(area: str, data: str) -> np.ndarray:
    """The rows of TABLES[data] in AREAS[area], by the reference."""
    lat, lon = _lat_lon(TABLES[data])
    if area in RINGS:
        ring = RINGS[area]
        return np.array(
            [ring.holds(xyz(a, b)) or ring.near(xyz(a, b)) for a, b in zip(lat, lon, strict=True)]
        )
    return _box_mask(AREAS[area], lat, lon)


def _half(t: pa.Table) -> np.ndarray:
    return np.isin(t.column("kind").to_numpy(zero_copy_only=False), ["a", "b"])


def test_the_areas_keep_what_the_tests_need() -> None:
    for data in DATA:
        assert not inside("empty", data).any()
        for area in ("box_across_180", "box_to_pole", "polygon_around_pole", "polygon_across_180"):
            assert inside(area, data).any(), (area, data)
    # Some areas keep fewer points than the tests' k, some more.
    assert (
        inside("box_to_pole", "uniform").sum() < 10 < inside("polygon_around_pole", "uniform").sum()
    )
    assert inside("box_to_pole", "edge")[:3].all()  # the north pole, at longitude 0
    # The references agree with the server's masks (and so test the same thing twice).
    lat, lon = _lat_lon(TABLES["uniform"])
    for area, ring in RINGS.items():
        polygon = SphericalPolygon.parse(_geojson(ring))
        np.testing.assert_array_equal(polygon_mask(lat, lon, polygon), inside(area, "uniform"))


@pytest.fixture(scope="module", params=cpu_engine_params())
def served(request: pytest.FixtureRequest) -> Iterator[Client]:
    """A server on one engine, for the module, with the data sets and their queries."""
    with engine_server(request.param, {**TABLES, **LEFT}) as client:
        yield client


# -- parity with the reference --------------------------------------------------------------
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("area", AREAS)
def test_knn_within_is_the_reference_knn_of_the_points_inside(
    served: Client, data: str, area: str
) -> None:
    lat, lon = _lat_lon(TABLES[data])
    q_lat, q_lon = queries(data)
    mask = inside(area, data)
    k = 10
    want = reference_knn(lat, lon, mask, q_lat, q_lon, k)
    found = served.knn(data, q_lat, q_lon, k=k, within=AREAS[area], as_arrow=True)
    assert isinstance(found, pa.Table)
    got = knn_from_rows(found, q_lat.shape[0], min(k, int(mask.sum())), "query_index")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))
    assert mask[found.column("id").to_numpy()].all()


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("area", AREAS)
def test_radius_within_is_the_reference_radius_of_the_points_inside(
    served: Client, data: str, area: str
) -> None:
    lat, lon = _lat_lon(TABLES[data])
    q_lat, q_lon = queries(data)
    want = reference_radius(lat, lon, inside(area, data), q_lat, q_lon, RADIUS_M[data])
    found = served.radius(
        data, q_lat, q_lon, radius_m=RADIUS_M[data], within=AREAS[area], as_arrow=True
    )
    assert isinstance(found, pa.Table)
    got = radius_from_rows(found, q_lat.shape[0], "query_index")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))


@pytest.mark.parametrize("data", ["uniform", "edge"])
@pytest.mark.parametrize("area", ["box_across_180", "polygon_around_pole", "polygon_across_180"])
def test_within_and_where_search_the_points_both_select(
    served: Client, data: str, area: str
) -> None:
    t = TABLES[data]
    lat, lon = _lat_lon(t)
    q_lat, q_lon = queries(data)
    mask = inside(area, data) & _half(t)
    assert 0 < mask.sum() < inside(area, data).sum()
    # Streamed (columns asked for), not compact: the other path of the same selection.
    found = served.knn(
        data, q_lat, q_lon, k=7, where=HALF, within=AREAS[area], columns="kind", as_arrow=True
    )
    assert isinstance(found, pa.Table)
    want = reference_knn(lat, lon, mask, q_lat, q_lon, 7)
    got = knn_from_rows(found, q_lat.shape[0], min(7, int(mask.sum())), "query_index")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))
    assert set(found.column("kind").to_pylist()) <= {"a", "b"}
    radius = served.radius(
        data, q_lat, q_lon, radius_m=RADIUS_M[data], where=HALF, within=AREAS[area],
        columns="kind", as_arrow=True,
    )  # fmt: skip
    assert isinstance(radius, pa.Table)
    want_r = reference_radius(lat, lon, mask, q_lat, q_lon, RADIUS_M[data])
    got_r = radius_from_rows(radius, q_lat.shape[0], "query_index")
    assert_same_neighbours(got_r, want_r, queries=(q_lat, q_lon), points=(lat, lon))


@pytest.mark.parametrize("area", ["box_to_pole", "polygon_around_pole"])
def test_k_beyond_the_points_inside_returns_them_all(served: Client, area: str) -> None:
    lat, lon = _lat_lon(TABLES["uniform"])
    q_lat, q_lon = queries("uniform")
    mask = inside(area, "uniform")
    n = int(mask.sum())
    k = n + 50
    want = reference_knn(lat, lon, mask, q_lat, q_lon, k)
    found = served.knn("uniform", q_lat, q_lon, k=k, within=AREAS[area], as_arrow=True)
    assert isinstance(found, pa.Table)
    assert found.num_rows == q_lat.shape[0] * n
    got = knn_from_rows(found, q_lat.shape[0], n, "query_index")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))
    per_query = served.knn(
        "uniform", q_lat, q_lon, k=k, within=AREAS[area], layout="per_query", as_arrow=True
    )
    assert isinstance(per_query, pa.Table)
    assert per_query.schema.field("id").type.list_size == n
    ids = np.array(per_query.column("id").to_pylist())
    np.testing.assert_array_equal(
        np.sort(ids, axis=1), np.tile(np.flatnonzero(mask), (len(q_lat), 1))
    )


def test_an_area_of_no_points_answers_empty_not_an_error(served: Client) -> None:
    empty = AREAS["empty"]
    assert len(served.knn("uniform", [1.0, 2.0], [3.0, 4.0], k=3, within=empty)) == 0
    rows = served.knn("uniform", [1.0], [3.0], k=3, within=empty, columns="kind", as_arrow=True)
    assert rows.num_rows == 0 and "kind" in rows.column_names
    per_query = served.knn(
        "uniform", [1.0, 2.0], [3.0, 4.0], k=3, within=empty, layout="per_query", as_arrow=True
    )
    assert per_query["id"].to_pylist() == [[None], [None]]
    assert len(served.radius("uniform", [1.0], [3.0], radius_m=2e7, within=empty)) == 0
    counts = served.count_within("uniform", [1.0, 2.0], [3.0, 4.0], 2e7, within=empty)
    assert counts["count"].tolist() == [0, 0]
    joined = served.knn_join("uniform_q", "uniform", 3, within=empty)
    assert len(joined) == 0
    assert len(served.radius_join("uniform_q", "uniform", 2e7, within=empty)) == 0
    assert served.distance_matrix([1.0], [3.0], name="uniform", within=empty).shape == (1, 0)


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("area", ["box_across_180", "polygon_around_pole", "empty"])
def test_knn_join_within_is_the_reference_knn_of_every_left_point(
    served: Client, data: str, area: str
) -> None:
    lat, lon = _lat_lon(TABLES[data])
    q_lat, q_lon = queries(data)
    mask = inside(area, data) & _half(TABLES[data])
    k = 6
    want = reference_knn(lat, lon, mask, q_lat, q_lon, k)
    found = served.knn_join(f"{data}_q", data, k, where=HALF, within=AREAS[area], as_arrow=True)
    assert isinstance(found, pa.Table)
    got = knn_from_rows(found, q_lat.shape[0], min(k, int(mask.sum())), "left_id")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("area", ["box_across_180", "polygon_across_180"])
def test_radius_join_within_is_the_reference_radius_of_every_left_point(
    served: Client, data: str, area: str
) -> None:
    lat, lon = _lat_lon(TABLES[data])
    q_lat, q_lon = queries(data)
    want = reference_radius(lat, lon, inside(area, data), q_lat, q_lon, RADIUS_M[data])
    found = served.radius_join(f"{data}_q", data, RADIUS_M[data], within=AREAS[area], as_arrow=True)
    assert isinstance(found, pa.Table)
    got = radius_from_rows(found, q_lat.shape[0], "left_id")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("area", ["box_across_180", "polygon_around_pole", "polygon_across_180"])
def test_counts_within_are_the_reference_radius_counts_of_the_points_inside(
    served: Client, data: str, area: str
) -> None:
    lat, lon = _lat_lon(TABLES[data])
    q_lat, q_lon = queries(data)
    mask = inside(area, data)
    want = np.diff(reference_radius(lat, lon, mask, q_lat, q_lon, RADIUS_M[data]).offsets)
    found = served.count_within(data, q_lat, q_lon, RADIUS_M[data], within=AREAS[area])
    np.testing.assert_array_equal(found["count"], want)
    around_left = served.count_within(
        data, left=f"{data}_q", radius_m=RADIUS_M[data], where=HALF, within=AREAS[area]
    )
    both = mask & _half(TABLES[data])
    want_both = np.diff(reference_radius(lat, lon, both, q_lat, q_lon, RADIUS_M[data]).offsets)
    np.testing.assert_array_equal(around_left["count"], want_both)


@pytest.mark.parametrize("area", ["box_across_180", "polygon_around_pole"])
def test_kmeans_within_is_kmeans_of_a_dataset_of_the_points_inside(
    served: Client, area: str
) -> None:
    t = TABLES["uniform"]
    mask = inside(area, "uniform")
    served.upload(f"inside_{area}", t.filter(pa.array(mask)), mode="replace")
    options: dict[str, Any] = {"seed": 5, "n_init": 2, "return_labels": True}
    got = served.kmeans("uniform", 4, within=AREAS[area], **options)
    want = served.kmeans(f"inside_{area}", 4, **options)
    pd.testing.assert_frame_equal(got.centroids, want.centroids)
    assert got.inertia_m2 == want.inertia_m2 and got.n_iter == want.n_iter
    assert got.labels is not None and want.labels is not None
    pd.testing.assert_frame_equal(got.labels, want.labels)
    np.testing.assert_array_equal(got.labels["id"], np.flatnonzero(mask))


# -- every RPC and every form ------------------------------------------------------------------
@pytest.fixture
def loaded(client: Client) -> Client:
    client.upload("pts", TABLES["uniform"])
    client.upload("pts_q", LEFT["uniform_q"])
    return client


def test_dbscan_within_is_dbscan_of_a_dataset_of_the_points_inside(loaded: Client) -> None:
    area = "polygon_around_pole"
    mask = inside(area, "uniform") & _half(TABLES["uniform"])
    loaded.upload("inside", TABLES["uniform"].filter(pa.array(mask)))
    got = loaded.dbscan("pts", 1_500_000.0, 3, where=HALF, within=AREAS[area])
    want = loaded.dbscan("inside", 1_500_000.0, 3)
    assert (got.n_clusters, got.sizes, got.n_noise) == (want.n_clusters, want.sizes, want.n_noise)
    assert got.labels is not None and want.labels is not None
    pd.testing.assert_frame_equal(got.labels, want.labels)


def test_distance_matrix_columns_are_the_points_inside(loaded: Client) -> None:
    full = loaded.distance_matrix([1.0, 50.0], [2.0, -3.0], name="pts")
    for area in ("box_across_180", "polygon_around_pole"):
        found = loaded.distance_matrix(
            [1.0, 50.0], [2.0, -3.0], name="pts", where=HALF, within=AREAS[area]
        )
        mask = inside(area, "uniform") & _half(TABLES["uniform"])
        np.testing.assert_array_equal(found, full[:, mask])
    with pytest.raises(InvalidArgument, match="not both"):
        loaded.distance_matrix([1.0], [2.0], name="pts", ids=[1, 2], within=AREAS["box_to_pole"])
    with pytest.raises(ValueError, match="give the dataset name"):
        loaded.distance_matrix([1.0], [2.0], lat2=[3.0], lon2=[4.0], within=AREAS["box_to_pole"])


def test_compact_and_streamed_answers_agree_within_an_area(loaded: Client) -> None:
    area = AREAS["polygon_across_180"]
    q_lat, q_lon = [0.0, 10.0], [179.0, -175.0]
    # Without columns these go as KnnCompact and RadiusCompact; with them, streamed.
    compact = loaded.knn("pts", q_lat, q_lon, k=4, within=area, where=HALF)
    streamed = loaded.knn("pts", q_lat, q_lon, k=4, within=area, where=HALF, columns="kind")
    assert compact["id"].tolist() == streamed["id"].tolist() and len(compact) == 8
    compact_r = loaded.radius("pts", q_lat, q_lon, radius_m=1_500_000.0, within=area)
    streamed_r = loaded.radius(
        "pts", q_lat, q_lon, radius_m=1_500_000.0, within=area, columns="kind"
    )
    assert compact_r["id"].tolist() == streamed_r["id"].tolist() and len(compact_r) > 0
    inside_ids = set(np.flatnonzero(inside("polygon_across_180", "uniform")).tolist())
    assert set(compact["id"]) <= inside_ids and set(compact_r["id"]) <= inside_ids


def test_every_form_of_an_area_gives_the_same_answer(loaded: Client) -> None:
    shapely = pytest.importorskip("shapely")
    polygon = AREAS["polygon_around_pole"]
    shape = shapely.geometry.shape(polygon)

    def ids(within: Any) -> list[int]:
        return loaded.knn("pts", [70.0], [10.0], k=30, within=within)["id"].tolist()

    expected = ids(polygon)
    assert set(expected) <= set(np.flatnonzero(inside("polygon_around_pole", "uniform")))
    for form in (json.dumps(polygon), shape, shape.wkb, {"type": "Feature", "geometry": polygon}):
        assert ids(form) == expected
    box = AREAS["box_across_180"]
    by_box = ids(box)
    assert ids(list(box)) == by_box and ids(np.array(box)) == by_box


@pytest.mark.parametrize("within", [(1.0, 2.0, 3.0), [1.0, "2", 3.0, 4.0], [True, 0, 1, 1]])
def test_the_client_refuses_a_malformed_box_before_sending(within: Any) -> None:
    with pytest.raises(TypeError, match="within="):
        within_message(within)
    assert within_message(None) is None


BAD_AREAS = [
    ((10.0, 0.0, -10.0, 5.0), "min_lat"),
    ((0.0, 0.0, 1.0, 200.0), "longitudes"),
    ({"type": "Polygon", "coordinates": [[[0, 0], [1, 0], [1, 1], [0, 2]]]}, "closed"),
    ({"type": "Polygon", "coordinates": [[[0, 0], [2, 2], [2, 0], [0, 2], [0, 0]]]}, "polygon"),
    ({"type": "Point", "coordinates": [0, 0]}, "Polygon"),
    (b"\x01\x03\x00", "polygon"),
]


@pytest.mark.parametrize(("area", "reason"), BAD_AREAS)
def test_a_bad_area_is_invalid_argument_with_the_reason(
    loaded: Client, area: Any, reason: str
) -> None:
    calls = {
        "knn": lambda: loaded.knn("pts", [1.0], [2.0], k=3, within=area),
        "knn (streamed)": lambda: loaded.knn("pts", [1.0], [2.0], k=3, within=area, columns="kind"),
        "radius": lambda: loaded.radius("pts", [1.0], [2.0], radius_m=1e5, within=area),
        "knn_join": lambda: loaded.knn_join("pts_q", "pts", 2, within=area),
        "radius_join": lambda: loaded.radius_join("pts_q", "pts", 1e5, within=area),
        "count_within": lambda: loaded.count_within("pts", [1.0], [2.0], 1e5, within=area),
        "kmeans": lambda: loaded.kmeans("pts", 2, within=area),
        "dbscan": lambda: loaded.dbscan("pts", 1e5, 2, within=area),
        "distance_matrix": lambda: loaded.distance_matrix([1.0], [2.0], name="pts", within=area),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgument, match=reason) as caught:
            call()
        assert caught.value.message.startswith("within: "), name


def test_an_area_with_nothing_set_is_invalid_argument(
    loaded: Client, stub: pb_grpc.GeoNearStub
) -> None:
    request = pb.KnnRequest(
        dataset="pts", queries=pb.Points(lat=[1.0], lon=[2.0]), k=3, within=pb.Area()
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.KnnCompact(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "within: give an area: bbox, polygon_geojson or polygon_wkb"


def test_a_streamed_query_set_is_searched_in_its_first_message_s_area(
    loaded: Client, stub: pb_grpc.GeoNearStub
) -> None:
    area = within_message(AREAS["polygon_around_pole"])
    mask = inside("polygon_around_pole", "uniform")
    first = pb.KnnRequest(dataset="pts", queries=pb.Points(lat=[0.0], lon=[0.0]), k=3, within=area)
    later = pb.KnnRequest(queries=pb.Points(lat=[50.0, -50.0], lon=[10.0, 10.0]))
    found = messages_to_table(stub.KnnStream(iter([first, later])))
    assert found.column("query_index").to_pylist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert mask[found.column("id").to_numpy()].all()
    again = pb.KnnRequest(queries=pb.Points(lat=[1.0], lon=[1.0]), within=area)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.KnnStream(iter([first, again])))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "within" in caught.value.details()


def test_query_sets_beyond_one_message_are_searched_in_the_area(loaded: Client) -> None:
    lat, lon = _lat_lon(TABLES["uniform"])
    rng = np.random.default_rng(12)
    n = QUERY_CHUNK + 100  # KnnStream and RadiusStream
    q_lat, q_lon = rng.uniform(-90.0, 90.0, n), rng.uniform(-180.0, 180.0, n)
    mask = inside("box_across_180", "uniform")
    found = loaded.knn("pts", q_lat, q_lon, k=2, within=AREAS["box_across_180"], as_arrow=True)
    assert isinstance(found, pa.Table)
    want = reference_knn(lat, lon, mask, q_lat, q_lon, 2)
    assert_same_neighbours(knn_from_rows(found, n, 2, "query_index"), want)
    radius = loaded.radius(
        "pts", q_lat, q_lon, radius_m=300_000.0, within=AREAS["box_across_180"], as_arrow=True
    )
    assert isinstance(radius, pa.Table)
    want_r = reference_radius(lat, lon, mask, q_lat, q_lon, 300_000.0)
    assert_same_neighbours(radius_from_rows(radius, n, "query_index"), want_r)


# -- the command line ----------------------------------------------------------------------
def test_commands_take_within_bbox_and_within_polygon(
    loaded: Client, server: Any, tmp_path: Path
) -> None:
    target = ["--target", server.target]
    polygon = AREAS["polygon_around_pole"]
    shape = tmp_path / "cap.geojson"
    shape.write_text(json.dumps(polygon))
    box = AREAS["box_across_180"]
    box_flag = "--within-bbox=" + ",".join(str(v) for v in box)

    def run(*args: str) -> pd.DataFrame:
        out = tmp_path / "out.csv"
        assert main([*args, *target, "--out", str(out)]) == 0
        return pd.read_csv(out)

    knn = run(
        "knn", "pts", "--lat", "70", "--lon", "10", "-k", "20", "--within-polygon", str(shape)
    )
    expected = loaded.knn("pts", [70.0], [10.0], k=20, within=polygon)
    np.testing.assert_array_equal(knn["id"], expected["id"])
    inline = run(
        "knn", "pts", "--lat", "70", "--lon", "10", "-k", "20", "--within-polygon",
        json.dumps(polygon),
    )  # fmt: skip
    np.testing.assert_array_equal(inline["id"], expected["id"])
    radius = run(
        "radius", "pts", "--lat", "0", "--lon", "180", "--radius-m", "2000000", box_flag,
        "--where", "kind in ('a', 'b')",
    )  # fmt: skip
    expected = loaded.radius("pts", [0.0], [180.0], radius_m=2e6, within=box, where=HALF)
    np.testing.assert_array_equal(radius["id"], expected["id"])
    joined = run("knn-join", "pts_q", "pts", "-k", "2", box_flag)
    np.testing.assert_array_equal(
        joined["right_id"], loaded.knn_join("pts_q", "pts", 2, within=box)["right_id"]
    )
    joined = run("radius-join", "pts_q", "pts", "--radius-m", "3000000", box_flag)
    expected = loaded.radius_join("pts_q", "pts", 3e6, within=box)
    np.testing.assert_array_equal(joined["right_id"], expected["right_id"])
    counts = run("count-within", "pts", "--left", "pts_q", "--radius-m", "3000000", box_flag)
    expected = loaded.count_within("pts", left="pts_q", radius_m=3e6, within=box)
    np.testing.assert_array_equal(counts["count"], expected["count"])
    labels = run(
        "kmeans", "pts", "-k", "3", "--within-polygon", str(shape), "--where", "kind == 'a'"
    )
    kind_a = np.isin(TABLES["uniform"].column("kind").to_numpy(zero_copy_only=False), ["a"])
    np.testing.assert_array_equal(
        labels["id"], np.flatnonzero(inside("polygon_around_pole", "uniform") & kind_a)
    )


def test_a_command_given_both_areas_or_a_short_box_says_so(
    server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["knn", "pts", "--lat", "1", "--lon", "2", "--target", server.target]
    assert main([*base, "--within-bbox", "1,2,3", "--within-polygon", "x.geojson"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*base, "--within-bbox", "1,2,3"]) == 2
    assert "--within-bbox takes 4 numbers" in capsys.readouterr().err


# -- the selections' indexes ----------------------------------------------------------------
def test_an_area_s_index_is_built_once_however_it_is_encoded() -> None:
    shapely = pytest.importorskip("shapely")
    store = DatasetStore(create_engine("cpu"))
    store.upload("pts", "create", normalise_upload(TABLES["uniform"]))
    dataset = store.get("pts")
    cache = FilteredIndexes(store.engine)
    geojson = AREAS["polygon_around_pole"]
    first = cache.select(dataset, None, SphericalPolygon.parse(geojson))
    wkb = shapely.geometry.shape(geojson).wkb
    again = cache.select(dataset, None, SphericalPolygon.from_wkb(wkb))
    assert cache.builds == 1 and again.index is first.index
    assert first.rows is not None
    np.testing.assert_array_equal(
        first.rows, np.flatnonzero(inside("polygon_around_pole", "uniform"))
    )
    both = cache.select(dataset, parse_filter(HALF), SphericalPolygon.parse(geojson))
    assert cache.builds == 2 and both.n_points == int(
        (inside("polygon_around_pole", "uniform") & _half(TABLES["uniform"])).sum()
    )
    box = cache.select(dataset, None, Bbox(*AREAS["box_across_180"]))
    assert cache.select(dataset, None, Bbox(*AREAS["box_across_180"])).index is box.index
    assert cache.builds == 3 and len(cache) == 3
    world = cache.select(dataset, None, Bbox(-90.0, -180.0, 90.0, 180.0))
    assert world.index is dataset.index and world.rows is None
