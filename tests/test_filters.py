"""Attribute filters (``where=``): exact answers among the selected points.

Filtered Knn and Radius on every engine match the float64 reference run on exactly the
points the filter selects (DESIGN.md's exactness rule), for filters keeping none, one,
1% and all of the points, on uniform, clustered and edge data (poles, antimeridian,
duplicates). Filtered KMeans on every engine is KMeans of a dataset uploaded with only
the selected points (same seed: same centroids, inertia and labels). Values are typed
against their columns; a bad filter is INVALID_ARGUMENT naming what is wrong. Filtered
indexes are built once per (version, filter).
"""

from __future__ import annotations

import datetime as dt
import gc
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from analytics_data import (
    RADIUS_M,
    START,
    cpu_engine_params,
    engine_server,
    knn_from_rows,
    points,
    queries,
    radius_from_rows,
    reference_knn,
    reference_radius,
    table,
)
from test_engine_parity import assert_same_neighbours

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.clients.errors import InvalidArgument
from geonear.clients.filters import filter_message, parse_expression, where_from_arguments
from geonear.service.engines import create_engine
from geonear.service.queries.filters import (
    FilteredIndexes,
    NoPoints,
    check_filter,
    parse_filter,
    row_mask,
)
from geonear.service.store import DatasetStore
from geonear.service.validation import normalise_upload
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

DATA = ("uniform", "clustered", "edge")
TABLES = {kind: table(*points(kind)) for kind in DATA}


def _numpy(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False)


#: Filters by how much they keep, with the mask each must select.
FILTERS: dict[str, tuple[Any, Callable[[pa.Table], np.ndarray]]] = {
    "none": ([("bucket", "<", 0)], lambda t: np.zeros(t.num_rows, bool)),
    "one": ([("id", "==", 17)], lambda t: _numpy(t, "id") == 17),
    "one_percent": ([("bucket", "==", 42)], lambda t: _numpy(t, "bucket") == 42),
    "all": ([("bucket", ">=", 0)], lambda t: np.ones(t.num_rows, bool)),
    "or_of_ands": (
        [
            [("kind", "==", "a"), ("score", "<", 0.3)],
            [("flag", "==", True), ("when", ">=", START + dt.timedelta(minutes=1500))],
        ],
        lambda t: (
            ((_numpy(t, "kind") == "a") & (_numpy(t, "score") < 0.3))
            | (_numpy(t, "flag") & (np.arange(t.num_rows) >= 1500))
        ),
    ),
}


@pytest.fixture(scope="module", params=cpu_engine_params())
def served(request: pytest.FixtureRequest) -> Iterator[Client]:
    """A server on one engine, for the module, with the three data sets loaded."""
    with engine_server(request.param, TABLES) as client:
        yield client


# -- parity with the reference --------------------------------------------------------------
@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kept", FILTERS)
def test_filtered_knn_is_the_reference_knn_of_the_selected_points(
    served: Client, data: str, kept: str
) -> None:
    where, selects = FILTERS[kept]
    t = TABLES[data]
    lat, lon = _numpy(t, "lat"), _numpy(t, "lon")
    q_lat, q_lon = queries(data)
    mask = selects(t)
    k = 10  # more than "one" keeps
    want = reference_knn(lat, lon, mask, q_lat, q_lon, k)
    found = served.knn(data, q_lat, q_lon, k=k, where=where, as_arrow=True)
    assert isinstance(found, pa.Table)
    width = min(k, int(mask.sum()))
    got = knn_from_rows(found, q_lat.shape[0], width, "query_index")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))
    assert mask[_numpy(found, "id")].all()


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("kept", FILTERS)
def test_filtered_radius_is_the_reference_radius_of_the_selected_points(
    served: Client, data: str, kept: str
) -> None:
    where, selects = FILTERS[kept]
    t = TABLES[data]
    lat, lon = _numpy(t, "lat"), _numpy(t, "lon")
    q_lat, q_lon = queries(data)
    want = reference_radius(lat, lon, selects(t), q_lat, q_lon, RADIUS_M[data])
    found = served.radius(data, q_lat, q_lon, radius_m=RADIUS_M[data], where=where, as_arrow=True)
    assert isinstance(found, pa.Table)
    got = radius_from_rows(found, q_lat.shape[0], "query_index")
    assert_same_neighbours(got, want, queries=(q_lat, q_lon), points=(lat, lon))


def test_filtered_knn_with_max_distance_and_per_query_layout(served: Client) -> None:
    where, selects = FILTERS["one_percent"]
    t = TABLES["uniform"]
    lat, lon = _numpy(t, "lat"), _numpy(t, "lon")
    q_lat, q_lon = queries("uniform")
    want = reference_knn(lat, lon, selects(t), q_lat, q_lon, 5, max_distance_m=3_000_000)
    found = served.knn(
        "uniform",
        q_lat,
        q_lon,
        k=5,
        max_distance_m=3_000_000,
        where=where,
        layout="per_query",
        as_arrow=True,
    )
    assert isinstance(found, pa.Table)
    ids = pc.fill_null(found.column("id").combine_chunks().flatten(), -1).to_numpy()
    np.testing.assert_array_equal(ids.reshape(-1, 5), want.indices)


@pytest.mark.parametrize("kept", ["one_percent", "or_of_ands", "all"])
def test_filtered_kmeans_is_kmeans_of_a_dataset_of_the_selected_points(
    served: Client, kept: str
) -> None:
    where, selects = FILTERS[kept]
    t = TABLES["clustered"]
    mask = selects(t)
    served.upload(f"kmeans_{kept}", t.filter(pa.array(mask)), mode="replace")
    options: dict[str, Any] = {"seed": 7, "n_init": 2, "return_labels": True}
    got = served.kmeans("clustered", 3, where=where, **options)
    want = served.kmeans(f"kmeans_{kept}", 3, **options)
    pd.testing.assert_frame_equal(got.centroids, want.centroids)
    assert got.inertia_m2 == want.inertia_m2 and got.n_iter == want.n_iter
    assert got.labels is not None and want.labels is not None
    pd.testing.assert_frame_equal(got.labels, want.labels)
    np.testing.assert_array_equal(got.labels["id"], np.flatnonzero(mask))


# -- what the filter selects -----------------------------------------------------------------
def _selected(client: Client, name: str, where: Any) -> set[int]:
    """Ids of every point ``where`` selects: a KNN with k beyond the dataset."""
    found = client.knn(name, 0.0, 0.0, k=5000, where=where, as_arrow=True)
    assert isinstance(found, pa.Table)
    return set(_numpy(found, "id").tolist())


@pytest.fixture
def loaded(client: Client) -> Client:
    client.upload("pts", TABLES["uniform"])
    return client


def _rows(condition: np.ndarray) -> set[int]:
    return set(np.flatnonzero(condition).tolist())


T = TABLES["uniform"]
BUCKET = _numpy(T, "bucket")
MAYBE = T.column("maybe").to_pandas()


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ([("bucket", "<", 2.5)], _rows(BUCKET <= 2)),
        ([("bucket", "<=", 2.5)], _rows(BUCKET <= 2)),
        ([("bucket", ">", 97.5)], _rows(BUCKET >= 98)),
        ([("bucket", ">=", 97.5)], _rows(BUCKET >= 98)),
        ([("bucket", "==", 2.5)], set()),
        ([("bucket", "!=", 2.5)], _rows(BUCKET >= 0)),
        ([("bucket", "==", 3.0)], _rows(BUCKET == 3)),
        ([("bucket", "<", float("inf"))], _rows(BUCKET >= 0)),
        ([("bucket", ">", 2**70)], set()),
        ([("bucket", "in", [1, 2.5, 3.0, 2**70])], _rows((BUCKET == 1) | (BUCKET == 3))),
        ([("bucket", "in", [])], set()),
        ([("bucket", "not in", [])], _rows(BUCKET >= 0)),
    ],
    ids=lambda v: str(v) if isinstance(v, list) else "",
)
def test_integer_columns_compare_exactly_with_any_number(
    loaded: Client, where: Any, expected: set[int]
) -> None:
    assert _selected(loaded, "pts", where) == expected


def test_a_null_never_matches(loaded: Client) -> None:
    valid = MAYBE.notna().to_numpy()
    values = MAYBE.fillna(-1).to_numpy()
    assert _selected(loaded, "pts", [("maybe", "!=", 3)]) == _rows(valid & (values != 3))
    assert _selected(loaded, "pts", [("maybe", "not in", [3, 4])]) == _rows(
        valid & ~np.isin(values, [3, 4])
    )
    assert _selected(loaded, "pts", [("maybe", "<", 100)]) == _rows(valid)
    assert _selected(loaded, "pts", [("maybe", ">=", -(2**80))]) == _rows(valid)


def test_strings_bools_floats_and_or_groups(loaded: Client) -> None:
    kind = _numpy(T, "kind")
    score = _numpy(T, "score")
    flag = _numpy(T, "flag")
    assert _selected(loaded, "pts", [("kind", "in", ("a", "c"))]) == _rows(
        np.isin(kind, ["a", "c"])
    )
    assert _selected(loaded, "pts", [("kind", ">=", "c")]) == _rows(kind >= "c")
    assert _selected(loaded, "pts", [("flag", "!=", True)]) == _rows(~flag)
    assert _selected(loaded, "pts", [("score", ">", 1)]) == set()
    assert _selected(loaded, "pts", [("lat", ">", 60.0), ("lon", "<", 0)]) == _rows(
        (_numpy(T, "lat") > 60) & (_numpy(T, "lon") < 0)
    )
    either = [[("kind", "==", "b")], [("score", "<", 0.1)]]
    assert _selected(loaded, "pts", either) == _rows((kind == "b") | (score < 0.1))


def test_timestamps_compare_as_instants_from_any_spelling(loaded: Client) -> None:
    minutes = np.arange(T.num_rows)
    after_1000 = _rows(minutes >= 1000)
    at = START + dt.timedelta(minutes=1000)
    for value in (
        at,
        at.replace(tzinfo=None),  # naive: UTC
        at.astimezone(dt.timezone(dt.timedelta(hours=2))),
        np.datetime64(at.replace(tzinfo=None), "ns"),
        "2024-01-01T16:40:00Z",
        "2024-01-01T18:40:00+02:00",
    ):
        assert _selected(loaded, "pts", [("when", ">=", value)]) == after_1000, value
    assert _selected(loaded, "pts", [("when", "<", dt.date(2024, 1, 2))]) == _rows(minutes < 1440)


def test_date_dictionary_and_narrow_float_columns_filter(client: Client) -> None:
    t = TABLES["uniform"].slice(0, 200)
    days = pa.array([dt.date(2024, 1, 1) + dt.timedelta(days=i % 10) for i in range(200)])
    t = (
        t.append_column("day", days)
        .append_column("code", pa.array([f"c{i % 3}" for i in range(200)]).dictionary_encode())
        .append_column("half", pa.array((np.arange(200) % 4 / 2).astype(np.float16)))
        .append_column("single", pa.array(np.full(200, 0.1, dtype=np.float32)))
    )
    client.upload("pts", t)
    rows = np.arange(200)
    assert _selected(client, "pts", [("day", "<", "2024-01-03")]) == _rows(rows % 10 < 2)
    assert _selected(client, "pts", [("code", "==", "c1")]) == _rows(rows % 3 == 1)
    assert _selected(client, "pts", [("half", ">=", 1)]) == _rows(rows % 4 >= 2)
    assert _selected(client, "pts", [("half", "in", [0.5])]) == _rows(rows % 4 == 1)
    # float32's 0.1 is not the double 0.1: compared exactly, as doubles.
    assert _selected(client, "pts", [("single", "==", 0.1)]) == set()
    assert _selected(client, "pts", [("single", "in", [0.1])]) == set()
    assert len(_selected(client, "pts", [("single", "==", float(np.float32(0.1)))])) == 200


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ([("nope", "==", 1)], ["'nope'", "bucket"]),
        ([("bucket", "==", "7")], ["'bucket'", "int64", "a string"]),
        ([("kind", "<", 3)], ["'kind'", "an integer"]),
        ([("flag", "==", 1)], ["'flag'", "true or false"]),
        ([("flag", "<", True)], ["'flag'", "==, !=, in or not in"]),
        ([("score", ">", float("nan"))], ["'score'", "NaN"]),
        ([("when", "<", "yesterday")], ["'when'", "ISO 8601"]),
        ([("kind", "in", ["a", 1])], ["'kind'", "an integer"]),
    ],
    ids=lambda v: str(v[0]) if isinstance(v, list) and isinstance(v[0], tuple) else "",
)
def test_a_bad_filter_is_invalid_argument_naming_it(
    loaded: Client, where: Any, words: list[str]
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        loaded.knn("pts", 0.0, 0.0, k=3, where=where)
    for word in words:
        assert word in caught.value.message


def test_malformed_filters_are_refused_by_the_server(
    loaded: Client, stub: pb_grpc.GeoNearStub
) -> None:
    points = pb.Points(lat=[0.0], lon=[0.0])

    def knn(predicate: pb.Predicate) -> grpc.RpcError:
        where = pb.Filter(any_of=[pb.Conjunction(all_of=[predicate])])
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Knn(pb.KnnRequest(dataset="pts", queries=points, k=1, where=where)))
        return caught.value

    one = pb.Value(int_value=1)
    cases = [
        (pb.Predicate(column="bucket", op=pb.FILTER_OP_UNSPECIFIED, value=one), "FilterOp"),
        (pb.Predicate(column="bucket", op=pb.FILTER_OP_IN, value=one), "ValueList"),
        (pb.Predicate(column="bucket", op=pb.FILTER_OP_EQ, values=pb.ValueList()), "one Value"),
        (pb.Predicate(column="bucket", op=pb.FILTER_OP_EQ, value=pb.Value()), "no kind"),
        (pb.Predicate(column="", op=pb.FILTER_OP_EQ, value=one), "column"),
    ]
    for predicate, words in cases:
        error = knn(predicate)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, predicate
        assert words in error.details(), (predicate, error.details())
    empty = pb.Filter(any_of=[pb.Conjunction()])
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Knn(pb.KnnRequest(dataset="pts", queries=points, k=1, where=empty)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_filter_of_too_many_predicates_is_refused(loaded: Client) -> None:
    many = [[("bucket", "==", i)] for i in range(1001)]
    with pytest.raises(InvalidArgument, match="1001 predicates"):
        loaded.knn("pts", 0.0, 0.0, k=1, where=many)
    one_list = [("bucket", "in", list(range(100_000)))]
    assert _selected(loaded, "pts", one_list) == _rows(BUCKET >= 0)


def test_an_empty_filter_selects_every_point(loaded: Client, stub: pb_grpc.GeoNearStub) -> None:
    request = pb.KnnRequest(
        dataset="pts", queries=pb.Points(lat=[1.0], lon=[2.0]), k=5, where=pb.Filter()
    )
    unfiltered = pb.KnnRequest(dataset="pts", queries=pb.Points(lat=[1.0], lon=[2.0]), k=5)
    assert stub.KnnCompact(request) == stub.KnnCompact(unfiltered)


# -- every RPC that takes a filter ---------------------------------------------------------
def test_a_filter_of_no_points_answers_empty_in_every_form(loaded: Client) -> None:
    none = FILTERS["none"][0]
    assert len(loaded.knn("pts", [1.0, 2.0], [3.0, 4.0], k=3, where=none)) == 0  # compact
    rows = loaded.knn("pts", [1.0], [3.0], k=3, where=none, columns="kind", as_arrow=True)
    assert rows.num_rows == 0 and "kind" in rows.column_names
    per_query = loaded.knn(
        "pts", [1.0, 2.0], [3.0, 4.0], k=3, where=none, layout="per_query", as_arrow=True
    )
    assert per_query["id"].to_pylist() == [[None], [None]]
    assert len(loaded.radius("pts", [1.0], [3.0], radius_m=1e7, where=none)) == 0
    lists = loaded.radius(
        "pts", [1.0], [3.0], radius_m=1e7, where=none, layout="per_query", as_arrow=True
    )
    assert lists["id"].to_pylist() == [[]]
    assert loaded.distance_matrix([1.0], [3.0], name="pts", where=none).shape == (1, 0)


def test_a_filter_of_every_point_answers_as_no_filter(loaded: Client) -> None:
    q_lat, q_lon = queries("uniform")
    every = FILTERS["all"][0]
    got = loaded.knn("pts", q_lat, q_lon, k=8, where=every, columns="kind", as_arrow=True)
    want = loaded.knn("pts", q_lat, q_lon, k=8, columns="kind", as_arrow=True)
    assert got.equals(want)


def test_compact_and_streamed_answers_agree(loaded: Client, stub: pb_grpc.GeoNearStub) -> None:
    where = filter_message(FILTERS["or_of_ands"][0])
    points = pb.Points(lat=[10.0, -40.0], lon=[20.0, 100.0])
    knn = pb.KnnRequest(dataset="pts", queries=points, k=6, where=where)
    compact = stub.KnnCompact(knn)
    streamed = loaded.knn(
        "pts", [10.0, -40.0], [20.0, 100.0], k=6, columns="kind", where=FILTERS["or_of_ands"][0]
    )
    assert list(compact.int_ids) == streamed["id"].tolist()
    radius = pb.RadiusRequest(dataset="pts", queries=points, radius_m=2e6, where=where)
    compact_r = stub.RadiusCompact(radius)
    streamed_r = loaded.radius(
        "pts", [10.0, -40.0], [20.0, 100.0], radius_m=2e6, columns="kind",
        where=FILTERS["or_of_ands"][0],
    )  # fmt: skip
    assert list(compact_r.int_ids) == streamed_r["id"].tolist()
    selected = _rows(FILTERS["or_of_ands"][1](T))
    assert set(compact.int_ids) <= selected and set(compact_r.int_ids) <= selected


def test_a_streamed_query_set_is_filtered_by_its_first_message(
    loaded: Client, stub: pb_grpc.GeoNearStub
) -> None:
    where, selects = FILTERS["one_percent"]
    first = pb.KnnRequest(
        dataset="pts", queries=pb.Points(lat=[0.0], lon=[0.0]), k=3, where=filter_message(where)
    )
    later = pb.KnnRequest(queries=pb.Points(lat=[50.0, -50.0], lon=[10.0, 10.0]))
    from geonear.wire import messages_to_table

    found = messages_to_table(stub.KnnStream(iter([first, later])))
    assert _numpy(found, "query_index").tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert selects(T)[_numpy(found, "id")].all()
    again = pb.KnnRequest(
        queries=pb.Points(lat=[1.0], lon=[1.0]), where=filter_message(FILTERS["all"][0])
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.KnnStream(iter([first, again])))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "where" in caught.value.details()


def test_distance_matrix_columns_are_the_selected_points(loaded: Client) -> None:
    where, selects = FILTERS["one_percent"]
    full = loaded.distance_matrix([1.0, 50.0], [2.0, -3.0], name="pts")
    filtered = loaded.distance_matrix([1.0, 50.0], [2.0, -3.0], name="pts", where=where)
    np.testing.assert_array_equal(filtered, full[:, selects(T)])
    with pytest.raises(InvalidArgument, match="not both"):
        loaded.distance_matrix([1.0], [2.0], name="pts", ids=[1, 2], where=where)


def test_filtered_kmeans_weighs_the_selected_points_by_their_own_weights(loaded: Client) -> None:
    where, selects = FILTERS["or_of_ands"]
    loaded.upload("selected", T.filter(pa.array(selects(T))))
    options: dict[str, Any] = {"seed": 2, "n_init": 3, "weights": "score", "return_labels": True}
    got = loaded.kmeans("pts", 5, where=where, **options)
    want = loaded.kmeans("selected", 5, **options)
    pd.testing.assert_frame_equal(got.centroids, want.centroids)
    assert got.inertia_m2 == want.inertia_m2
    assert got.labels is not None and want.labels is not None
    pd.testing.assert_frame_equal(got.labels, want.labels)
    unweighted = loaded.kmeans("pts", 5, where=where, seed=2, n_init=3)
    assert unweighted.inertia_m2 != got.inertia_m2


def test_filtered_kmeans_refuses_k_beyond_the_selected_points(loaded: Client) -> None:
    with pytest.raises(InvalidArgument, match="1 points selected"):
        loaded.kmeans("pts", 2, where=FILTERS["one"][0])
    with pytest.raises(InvalidArgument, match="0 points selected"):
        loaded.kmeans("pts", 1, where=FILTERS["none"][0])
    with pytest.raises(InvalidArgument, match="where: dataset 'pts' has no column 'nope'"):
        loaded.kmeans("pts", 1, where=[("nope", "==", 1)])
    one = loaded.kmeans("pts", 1, where=FILTERS["one"][0], return_labels=True)
    assert one.labels is not None and one.labels["id"].tolist() == [17]
    np.testing.assert_allclose(
        one.centroids[["lat", "lon"]].to_numpy(), [[_numpy(T, "lat")[17], _numpy(T, "lon")[17]]]
    )


# -- the client's side ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "where",
    [
        "bucket == 1",
        [("bucket", "==")],
        [("bucket", "~", 1)],
        [("bucket", "in", 1)],
        [("bucket", "==", [1, 2])],
        [[]],
        [("", "==", 1)],
    ],
    ids=str,
)
def test_the_client_refuses_a_malformed_filter_before_sending(where: Any) -> None:
    with pytest.raises(ValueError):
        filter_message(where)


def test_the_client_refuses_values_of_no_filterable_type() -> None:
    with pytest.raises(TypeError, match="bucket"):
        filter_message([("bucket", "==", object())])


def test_the_client_sends_typed_values() -> None:
    message = filter_message(
        [("a", "=", np.int32(3)), ("b", "in", np.array([1.5])), ("c", "!=", np.bool_(True))]
    )
    assert message is not None
    a, b, c = message.any_of[0].all_of
    assert (a.op, a.value.WhichOneof("kind")) == (pb.FILTER_OP_EQ, "int_value")
    assert b.values.values[0].float_value == 1.5
    assert c.value.bool_value is True
    assert filter_message([]) is None and filter_message(None) is None


# -- the filtered indexes -----------------------------------------------------------------------
@pytest.fixture
def store() -> DatasetStore:
    s = DatasetStore(create_engine("cpu"))
    s.upload("pts", "create", normalise_upload(TABLES["uniform"]))
    return s


def _where(where: Any) -> Any:
    parsed = parse_filter(where)
    assert parsed is not None
    return parsed


def test_a_filtered_index_is_built_once_per_version_and_filter(store: DatasetStore) -> None:
    cache = FilteredIndexes(store.engine)
    dataset = store.get("pts")
    first = cache.select(dataset, _where([("bucket", "==", 7)]))
    again = cache.select(dataset, _where([("bucket", "==", 7.0)]))  # the same, spelled otherwise
    assert cache.builds == 1 and again.index is first.index
    assert first.rows is not None
    np.testing.assert_array_equal(first.rows, np.flatnonzero(BUCKET == 7))
    cache.select(dataset, _where([("bucket", "==", 8)]))
    assert cache.builds == 2 and len(cache) == 2
    store.upload("pts", "replace", normalise_upload(TABLES["clustered"]))
    cache.select(store.get("pts"), _where([("bucket", "==", 7)]))
    assert cache.builds == 3
    del dataset, first, again
    gc.collect()
    cache.select(store.get("pts"), _where([("bucket", "==", 7)]))  # a lookup drops the dead
    assert cache.builds == 3 and len(cache) == 1


def test_the_filtered_indexes_are_bounded_by_entries_and_bytes(store: DatasetStore) -> None:
    dataset = store.get("pts")
    small = FilteredIndexes(store.engine, max_entries=2)
    for bucket in (1, 2, 3):
        small.select(dataset, _where([("bucket", "==", bucket)]))
    assert len(small) == 2
    small.select(dataset, _where([("bucket", "==", 1)]))  # evicted first: built again
    assert small.builds == 4
    none_kept = FilteredIndexes(store.engine, max_bytes=0)
    for _ in range(2):
        selection = none_kept.select(dataset, _where([("bucket", "==", 5)]))
        assert selection.rows is not None and selection.rows.shape[0] == (BUCKET == 5).sum()
    assert none_kept.builds == 2 and len(none_kept) == 0 and none_kept.nbytes == 0


def test_every_point_uses_the_dataset_index_and_none_an_empty_one(store: DatasetStore) -> None:
    dataset = store.get("pts")
    cache = FilteredIndexes(store.engine)
    every = cache.select(dataset, _where([("bucket", ">=", 0)]))
    assert every.index is dataset.index and every.rows is None
    nothing = cache.select(dataset, _where([("bucket", ">", 1000)]))
    assert isinstance(nothing.index, NoPoints) and nothing.n_points == 0
    assert cache.builds == 0


def test_the_mask_is_the_pyarrow_filter_of_the_table(store: DatasetStore) -> None:
    dataset = store.get("pts")
    where = [[("kind", "in", ["a", "b"]), ("score", "<", 0.5)], [("maybe", "==", 2)]]
    mask = row_mask(dataset, check_filter(dataset, _where(where)))
    expected = pc.or_kleene(
        pc.and_kleene(pc.is_in(T["kind"], pa.array(["a", "b"])), pc.less(T["score"], 0.5)),
        pc.equal(T["maybe"], 2),
    ).fill_null(False)
    np.testing.assert_array_equal(mask, expected.to_numpy())


# -- the command line -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "predicate"),
    [
        ("country == 'FR'", ("country", "==", "FR")),
        ("country = FR", ("country", "==", "FR")),
        ("pop>=10000", ("pop", ">=", 10000)),
        ("score < -1.5e3", ("score", "<", -1500.0)),
        ("flag != true", ("flag", "!=", True)),
        ("code == '007'", ("code", "==", "007")),
        ("kind in ('a', \"b, c\")", ("kind", "in", ["a", "b, c"])),
        ("n NOT IN [1, 2]", ("n", "not in", [1, 2])),
        ("`my col` == x", ("my col", "==", "x")),
        ("when >= '2024-05-01T12:00Z'", ("when", ">=", "2024-05-01T12:00Z")),
    ],
)
def test_where_expressions_read_as_predicates(expression: str, predicate: tuple) -> None:
    assert parse_expression(expression) == predicate


@pytest.mark.parametrize(
    "expression", ["country", "pop >=", "kind in 'a'", "name == 'open", "x == a b", "y in (1,,2)"]
)
def test_unreadable_where_expressions_say_how_to_write_one(expression: str) -> None:
    with pytest.raises(ValueError, match="--where"):
        parse_expression(expression)


def test_or_where_starts_a_new_group() -> None:
    items = [("and", "a == 1"), ("and", "b == 2"), ("or", "c == 3"), ("and", "d == 4")]
    assert where_from_arguments(items) == [
        [("a", "==", 1), ("b", "==", 2)],
        [("c", "==", 3), ("d", "==", 4)],
    ]
    assert where_from_arguments(None) is None


def test_knn_and_radius_commands_take_where(
    loaded: Client, server: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "knn.csv"
    code = main(
        ["knn", "pts", "--lat", "10", "--lon", "20", "-k", "50", "--target", server.target,
         "--where", "kind in ('a', 'b')", "--where", "bucket < 50", "--or-where", "bucket == 99",
         "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    kind, bucket = _numpy(T, "kind"), BUCKET
    expected = _rows((np.isin(kind, ["a", "b"]) & (bucket < 50)) | (bucket == 99))
    ids = set(pd.read_csv(out)["id"].tolist())
    assert len(ids) == 50 and ids <= expected
    code = main(
        ["radius", "pts", "--lat", "10", "--lon", "20", "--radius-m", "3000000",
         "--target", server.target, "--where", "flag == true", "--all"]
    )  # fmt: skip
    assert code == 0
    assert "within 3000000.0 m in pts" in capsys.readouterr().out
    code = main(
        ["knn", "pts", "--lat", "10", "--lon", "20", "--target", server.target,
         "--where", "kind < 3"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("geonear: INVALID_ARGUMENT: --where: column 'kind'")
    assert len(err.strip().splitlines()) == 1
    assert main(["knn", "pts", "--lat", "1", "--lon", "2", "--where", "kind"]) == 2
    assert "COLUMN OP VALUE" in capsys.readouterr().err


def test_kmeans_command_takes_where(loaded: Client, server: Any, tmp_path: Any) -> None:
    out = tmp_path / "labels.csv"
    code = main(
        ["kmeans", "pts", "-k", "4", "--seed", "3", "--target", server.target,
         "--where", "kind == 'a'", "--or-where", "bucket == 99", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    labels = pd.read_csv(out)
    kind = _numpy(T, "kind")
    np.testing.assert_array_equal(labels["id"], np.flatnonzero((kind == "a") | (BUCKET == 99)))
    where = [[("kind", "==", "a")], [("bucket", "==", 99)]]
    expected = loaded.kmeans("pts", 4, seed=3, where=where, return_labels=True)
    assert expected.labels is not None
    np.testing.assert_array_equal(labels["cluster"], expected.labels["cluster"])


def test_matrix_command_takes_where_and_within(
    loaded: Client, server: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``geonear matrix NAME --where ... --within-bbox ...``: the columns are the selected
    points in row order, as the client's ``distance_matrix`` gives them."""
    out = tmp_path / "m.npy"
    code = main(
        ["matrix", "pts", "--lat", "10,-5", "--lon", "20,170", "--target", server.target,
         "--where", "bucket < 30", "--within-bbox=-60,-180,60,180", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    got = np.load(out)
    where, box = [("bucket", "<", 30)], (-60.0, -180.0, 60.0, 180.0)
    expected = loaded.distance_matrix([10.0, -5.0], [20.0, 170.0], "pts", where=where, within=box)
    np.testing.assert_array_equal(got, expected)
    lat = T.column("lat").to_numpy()
    assert got.shape == (2, int(((BUCKET < 30) & (np.abs(lat) <= 60)).sum())) and got.shape[1] > 0
    # Without --out, a narrow selection prints and a wide one is refused; a selection
    # needs a dataset.
    capsys.readouterr()
    assert main(
        ["matrix", "pts", "--lat", "10", "--lon", "20", "--target", server.target,
         "--where", "id < 5"]
    ) == 0  # fmt: skip
    assert "distance matrix" in capsys.readouterr().out
    assert main(
        ["matrix", "pts", "--lat", "10", "--lon", "20", "--target", server.target,
         "--where", "id < 50"]
    ) == 2  # fmt: skip
    assert "1 x 50 matrix is too wide to print" in capsys.readouterr().err
    assert main(
        ["matrix", "--lat", "10", "--lon", "20", "--lat2", "1", "--lon2", "2",
         "--target", server.target, "--where", "bucket == 99"]
    ) == 2  # fmt: skip
    assert "give NAME" in capsys.readouterr().err
