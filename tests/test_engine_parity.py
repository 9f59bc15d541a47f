"""Every engine against the float64 reference (``numpy-brute``).

The engine list is every engine geonear knows except the reference; an engine this
host cannot run (a GPU engine without a GPU) is skipped with the reason its factory
gives, so the same file runs unchanged on a GPU machine (``pytest -m gpu``).

Exactness (docs/design.md): ids and order match the reference except among neighbours whose
distances differ by less than 1 mm; distances agree to 1 mm.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import os
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from geonear.geometry import EARTH_RADIUS_M, great_circle_m, unit_vectors
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import (
    ENGINES,
    Capability,
    Engine,
    EngineUnavailable,
    Neighbours,
    RadiusNeighbours,
    create_engine,
    engine_names,
)
from geonear.service.engines.base import sort_radius

REFERENCE = "numpy-brute"
#: Distances closer than this are ties for the exactness rule, metres.
TIE_M = 1e-3
HALF_CIRCUMFERENCE_M = math.pi * EARTH_RADIUS_M
#: Largest error of a float32 distance matrix, metres (docs/design.md: "up to about 4 m").
FLOAT32_MAX_ERROR_M = 4.0

ENGINE_NAMES = [n for n in engine_names() if n != REFERENCE]
ENGINE_PARAMS = [
    pytest.param(n, id=n, marks=[pytest.mark.gpu] if ENGINES[n].device_kind == "gpu" else [])
    for n in ENGINE_NAMES
]


def test_engine_list_covers_the_host_engines() -> None:
    assert {"cpu", "sklearn"} <= set(ENGINE_NAMES)
    assert REFERENCE in engine_names()


@pytest.fixture(scope="module", params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    # One engine per module: the dask engine starts a local cluster of worker processes.
    try:
        engine = create_engine(request.param)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    yield engine
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _needs_spherical_kmeans(engine: Engine) -> None:
    if not engine.spec.can(Capability.SPHERICAL_KMEANS):
        pytest.skip(f"{engine.name}'s k-means is not the spherical definition (documented)")


@pytest.fixture(scope="module")
def reference() -> Engine:
    return create_engine(REFERENCE)


# -- the exactness rule -----------------------------------------------------------------
def _padded(result: Neighbours | RadiusNeighbours) -> tuple[np.ndarray, np.ndarray]:
    """(distances, indices) of shape (n, width); missing entries are inf and -1."""
    if isinstance(result, Neighbours):
        return np.asarray(result.distances_m), np.asarray(result.indices)
    counts = np.diff(result.offsets)
    width = int(counts.max()) if counts.size else 0
    dist = np.full((counts.shape[0], width), np.inf)
    idx = np.full((counts.shape[0], width), -1, dtype=np.int64)
    for q in range(counts.shape[0]):
        lo, hi = result.offsets[q], result.offsets[q + 1]
        dist[q, : hi - lo] = result.distances_m[lo:hi]
        idx[q, : hi - lo] = result.indices[lo:hi]
    return dist, idx


def assert_same_neighbours(
    result: Neighbours | RadiusNeighbours,
    reference: Neighbours | RadiusNeighbours,
    *,
    queries: tuple[np.ndarray, np.ndarray] | None = None,
    points: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Assert ``result`` is the reference's answer under docs/design.md's exactness rule.

    Per query: the same number of neighbours; distances within 1 mm position by
    position; the same ids in the same order, except that within a run of reference
    neighbours whose consecutive distances differ by < 1 mm the ids may come in any
    order, and a run cut off by k may hold other (distinct) ids at those distances.
    With ``queries`` and ``points`` (lat, lon degrees), every returned distance is also
    checked against the true great-circle distance of the id it is reported for.
    """
    if isinstance(reference, RadiusNeighbours):
        assert isinstance(result, RadiusNeighbours)
        np.testing.assert_array_equal(
            np.diff(result.offsets), np.diff(reference.offsets), "neighbours per query"
        )
    r_dist, r_idx = _padded(result)
    e_dist, e_idx = _padded(reference)
    assert r_dist.shape == e_dist.shape, f"shape {r_dist.shape} != reference {e_dist.shape}"
    assert r_idx.dtype.kind == "i"
    missing = e_idx < 0
    np.testing.assert_array_equal(r_idx < 0, missing, "missing neighbours differ")
    np.testing.assert_array_equal(np.isinf(r_dist), np.isinf(e_dist), "inf distances differ")
    finite = ~missing
    np.testing.assert_allclose(r_dist[finite], e_dist[finite], rtol=0, atol=TIE_M)
    for q in range(e_idx.shape[0]):
        row_r, row_e, dist_e = r_idx[q][finite[q]], e_idx[q][finite[q]], e_dist[q][finite[q]]
        assert np.unique(row_r).shape == row_r.shape, f"query {q}: repeated ids {row_r}"
        if np.array_equal(row_r, row_e):
            continue
        # Runs of ties: a new run starts where the reference distance grows by >= 1 mm.
        starts = np.flatnonzero(np.diff(dist_e) >= TIE_M) + 1
        bounds = [0, *starts.tolist(), row_e.shape[0]]
        for lo, hi in itertools.pairwise(bounds):
            got, want = set(row_r[lo:hi].tolist()), set(row_e[lo:hi].tolist())
            cut_by_k = isinstance(reference, Neighbours) and hi == e_idx.shape[1]
            assert got == want or cut_by_k, (
                f"query {q}, ranks {lo}..{hi - 1}: ids {sorted(got)} != reference "
                f"{sorted(want)} (distances {dist_e[lo:hi]})"
            )
    if queries is not None and points is not None:
        q_lat, q_lon = queries
        p_lat, p_lon = points
        qi = np.nonzero(finite)[0]
        true = great_circle_m(q_lat[qi], q_lon[qi], p_lat[r_idx[finite]], p_lon[r_idx[finite]])
        np.testing.assert_allclose(r_dist[finite], true, rtol=0, atol=TIE_M)


def test_the_exactness_rule_accepts_ties_and_rejects_swaps() -> None:
    ref = Neighbours(np.array([[1.0, 5.0, 5.0002, 9.0]]), np.array([[3, 1, 2, 0]]))
    swapped_tie = Neighbours(np.array([[1.0, 5.0, 5.0002, 9.0]]), np.array([[3, 2, 1, 0]]))
    assert_same_neighbours(swapped_tie, ref)
    cut = Neighbours(np.array([[1.0, 5.0]]), np.array([[3, 1]]))
    other_tie_at_k = Neighbours(np.array([[1.0, 5.0]]), np.array([[3, 2]]))
    assert_same_neighbours(other_tie_at_k, cut)
    wrong_order = Neighbours(np.array([[1.0, 5.0, 5.0002, 9.0]]), np.array([[1, 3, 2, 0]]))
    with pytest.raises(AssertionError):
        assert_same_neighbours(wrong_order, ref)
    wrong_distance = Neighbours(np.array([[1.0, 5.0, 5.0002, 9.01]]), np.array([[3, 1, 2, 0]]))
    with pytest.raises(AssertionError):
        assert_same_neighbours(wrong_distance, ref)
    wrong_id = Neighbours(np.array([[1.0, 5.0, 5.0002, 9.0]]), np.array([[3, 1, 7, 0]]))
    with pytest.raises(AssertionError):
        assert_same_neighbours(wrong_id, ref)
    # a different id at the cut is accepted only at its true distance
    points = (np.array([0.0, 0.0, 0.0]), np.array([0.0, 1.0, 2.0]))
    queries = (np.array([0.0]), np.array([0.0]))
    one_degree = float(great_circle_m(0.0, 0.0, 0.0, 1.0))
    nearest = Neighbours(np.array([[0.0, one_degree]]), np.array([[0, 1]]))
    assert_same_neighbours(nearest, nearest, queries=queries, points=points)
    false_tie = Neighbours(np.array([[0.0, one_degree]]), np.array([[0, 2]]))
    with pytest.raises(AssertionError):
        assert_same_neighbours(false_tie, nearest, queries=queries, points=points)


# -- data -------------------------------------------------------------------------------
UNIFORM = uniform_points(3000, seed=21)
CLUSTERED = clustered_points(3000, seed=22, n_clusters=30, spread_m=10_000.0)
QUERIES = uniform_points(300, seed=23)
#: Queries near the clustered points (on top of some of them, offset from others).
CLUSTER_QUERIES = (
    np.concatenate([CLUSTERED[0][:150], np.clip(CLUSTERED[0][150:300] + 0.01, -90, 90)]),
    np.concatenate([CLUSTERED[1][:150], CLUSTERED[1][150:300] - 0.01]),
)
SETS = {
    "uniform": (UNIFORM, QUERIES),
    "clustered": (CLUSTERED, CLUSTER_QUERIES),
}


def _knn_both(engine: Engine, reference: Engine, points, queries, k, max_distance_m=None):
    got = engine.build_index(*points).knn(*queries, k, max_distance_m)
    want = reference.build_index(*points).knn(*queries, k, max_distance_m)
    return got, want


@pytest.mark.parametrize("data", SETS)
@pytest.mark.parametrize("k", [1, 7, 50])
def test_knn_matches_reference(engine: Engine, reference: Engine, data: str, k: int) -> None:
    points, queries = SETS[data]
    got, want = _knn_both(engine, reference, points, queries, k)
    assert got.indices.shape == (queries[0].shape[0], k)
    # Unbounded, every query has k neighbours: answers are assembled without looking
    # for missing ones (``NeighbourGrid.full``).
    assert (got.indices >= 0).all()
    assert_same_neighbours(got, want, queries=queries, points=points)


def _large_batch() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """3,000 clustered points, every tenth repeated at the point before it, and 3,000
    queries: on points, beside them and anywhere. Large batches take other code paths
    (slices on the CPU, queries in key order and windows on the GPU)."""
    lat, lon = (a.copy() for a in CLUSTERED)
    lat[1::10], lon[1::10] = lat[::10], lon[::10]
    far_lat, far_lon = uniform_points(1000, seed=24)
    q_lat = np.concatenate([lat[:1000], np.clip(lat[1000:2000] + 0.02, -90, 90), far_lat])
    q_lon = np.concatenate([lon[:1000], lon[1000:2000] - 0.02, far_lon])
    return (lat, lon), (q_lat, q_lon)


@pytest.mark.parametrize(("k", "max_distance_m"), [(1, None), (10, None), (10, 20_000.0)])
def test_knn_of_a_large_batch_matches_reference(
    engine: Engine, reference: Engine, k: int, max_distance_m: float | None
) -> None:
    points, queries = _large_batch()
    got, want = _knn_both(engine, reference, points, queries, k, max_distance_m)
    assert got.indices.shape == (3000, k)
    if max_distance_m is not None:  # some find fewer than k; queries on points, those
        assert (got.indices == -1).any() and (got.indices[:1000, 0] >= 0).all()
    assert_same_neighbours(got, want, queries=queries, points=points)


def test_radius_of_a_large_batch_matches_reference(engine: Engine, reference: Engine) -> None:
    points, queries = _large_batch()
    got = engine.build_index(*points).radius(*queries, 5_000.0)
    want = reference.build_index(*points).radius(*queries, 5_000.0)
    assert got.offsets.shape == (3001,) and got.offsets[-1] > 3000
    assert_same_neighbours(got, want, queries=queries, points=points)


def test_cpu_queries_in_slices_equal_queries_on_one_thread() -> None:
    from geonear.service.engines.cpu import KDTreeIndex

    points, queries = _large_batch()
    sliced = KDTreeIndex(*points, EARTH_RADIUS_M, workers=4)  # 4 slices a call
    one_thread = KDTreeIndex(*points, EARTH_RADIUS_M, workers=1)
    for a, b in (
        (sliced.knn(*queries, 10), one_thread.knn(*queries, 10)),
        (sliced.radius(*queries, 5_000.0), one_thread.radius(*queries, 5_000.0)),
    ):
        for field in dataclasses.fields(a):
            np.testing.assert_array_equal(getattr(a, field.name), getattr(b, field.name))


def test_cpu_searches_inside_a_slice_stay_on_its_thread() -> None:
    # A slice has a core to itself: its tied queries' second search starts no threads.
    from geonear.service.engines.cpu import KDTreeIndex
    from geonear.service.engines.host import slice_threads

    index = KDTreeIndex(*CLUSTERED, EARTH_RADIUS_M, workers=4)
    assert index._workers_for(10_000) == 4
    assert slice_threads().submit(index._workers_for, 10_000).result() == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_cpu_queries_in_slices_run_in_a_forked_child() -> None:
    # The slices' threads are the parent's: a forked child must start its own.
    from geonear.service.engines.cpu import KDTreeIndex

    points, queries = _large_batch()
    index = KDTreeIndex(*points, EARTH_RADIUS_M, workers=4)
    want = index.knn(*queries, 10).indices  # the parent's threads are started
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=lambda: sender.send(index.knn(*queries, 10).indices))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # forking a threaded process
        child.start()
    try:
        assert receiver.poll(60), "the child's sliced query did not finish"
        np.testing.assert_array_equal(receiver.recv(), want)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


@pytest.mark.parametrize("data", SETS)
def test_knn_with_max_distance_matches_reference(
    engine: Engine, reference: Engine, data: str
) -> None:
    points, queries = SETS[data]
    got, want = _knn_both(engine, reference, points, queries, 20, max_distance_m=300_000.0)
    assert (want.indices < 0).any() and (want.indices >= 0).any()  # the bound really cuts
    assert_same_neighbours(got, want, queries=queries, points=points)
    assert np.all(got.distances_m[got.indices >= 0] <= 300_000.0)


@pytest.mark.parametrize("data", SETS)
@pytest.mark.parametrize("radius_m", [0.0, 50_000.0, 750_000.0])
def test_radius_matches_reference(
    engine: Engine, reference: Engine, data: str, radius_m: float
) -> None:
    points, queries = SETS[data]
    got = engine.build_index(*points).radius(*queries, radius_m)
    want = reference.build_index(*points).radius(*queries, radius_m)
    assert_same_neighbours(got, want, queries=queries, points=points)
    assert np.all(got.distances_m <= radius_m)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "mixed"])
def test_radius_answers_are_ordered_by_query_distance_and_row(grouped: bool) -> None:
    # The reference shares sort_radius, so it is checked here against the definition:
    # pairs in many blocks of whole queries, with equal distances in some of them.
    rng = np.random.default_rng(7)
    n_queries, n_pairs = 900, 60_000
    query_index = rng.integers(0, n_queries, n_pairs)
    if grouped:
        query_index.sort()
    rows = rng.permutation(n_pairs).astype(np.int64)
    distances_m = rng.uniform(0.0, 5_000.0, n_pairs)
    some = rng.random(n_pairs) < 0.05
    distances_m[some] = np.round(distances_m[some] / 500.0) * 500.0

    got = sort_radius(query_index, rows, distances_m, n_queries)

    order = np.lexsort((rows, distances_m, query_index))
    counts = np.bincount(query_index, minlength=n_queries)
    np.testing.assert_array_equal(got.offsets, np.concatenate([[0], np.cumsum(counts)]))
    np.testing.assert_array_equal(got.indices, rows[order])
    np.testing.assert_array_equal(got.distances_m, distances_m[order])


def test_radius_zero_finds_a_query_on_top_of_points(engine: Engine) -> None:
    points = CLUSTERED
    index = engine.build_index(*points)
    found = index.radius(points[0][:50], points[1][:50], 0.0)
    # every query sits on a dataset point, so it finds at least that point at 0 m
    for q in range(50):
        rows = found.indices[found.offsets[q] : found.offsets[q + 1]]
        assert q in rows.tolist()
    assert np.all(found.distances_m == 0.0)


def test_radius_beyond_half_the_circumference_returns_every_point(
    engine: Engine, reference: Engine
) -> None:
    points, queries = UNIFORM, (QUERIES[0][:20], QUERIES[1][:20])
    for radius_m in (HALF_CIRCUMFERENCE_M + 1.0, 3 * HALF_CIRCUMFERENCE_M):
        got = engine.build_index(*points).radius(*queries, radius_m)
        assert np.all(np.diff(got.offsets) == points[0].shape[0])
        want = reference.build_index(*points).radius(*queries, radius_m)
        assert_same_neighbours(got, want)


# -- edge cases ------------------------------------------------------------------------
def _edge_case(engine: Engine, reference: Engine, points, queries, k: int) -> Neighbours:
    points = tuple(np.asarray(p, dtype=np.float64) for p in points)
    queries = tuple(np.asarray(q, dtype=np.float64) for q in queries)
    got, want = _knn_both(engine, reference, points, queries, k)
    assert_same_neighbours(got, want, queries=queries, points=points)
    radius = engine.build_index(*points).radius(*queries, 1_000_000.0)
    radius_want = reference.build_index(*points).radius(*queries, 1_000_000.0)
    assert_same_neighbours(radius, radius_want, queries=queries, points=points)
    return got


def test_poles(engine: Engine, reference: Engine) -> None:
    lon = [-180.0, -135.0, -90.0, 0.0, 45.0, 90.0, 180.0]
    points = (
        [90.0] * 7 + [-90.0] * 7 + [89.999, -89.999, 89.0, 0.0],
        lon + lon + [17.0, -163.0, 100.0, 0.0],
    )
    queries = ([90.0, -90.0, 90.0, 89.9999, -89.9999], [0.0, 77.0, -180.0, 180.0, -3.0])
    got = _edge_case(engine, reference, points, queries, k=10)
    # a pole query finds the seven points of its pole first, at (almost exactly) 0 m
    assert set(got.indices[0, :7].tolist()) == set(range(7))
    assert set(got.indices[1, :7].tolist()) == set(range(7, 14))
    assert np.all(got.distances_m[:2, :7] < TIE_M)
    # the pole is 0.001 degrees (about 111 m) from the nearest off-pole point
    assert got.indices[0, 7] == 14
    assert got.distances_m[0, 7] == pytest.approx(EARTH_RADIUS_M * math.radians(0.001))


def test_antimeridian(engine: Engine, reference: Engine) -> None:
    points = (
        [0.0, 0.0, 0.0, 0.0, 10.0, -10.0, 0.0],
        [180.0, -180.0, 179.9, -179.9, 179.99, -179.99, 0.0],
    )
    queries = ([0.0, 0.0, 0.0, 10.0], [180.0, -180.0, 179.95, -180.0])
    got = _edge_case(engine, reference, points, queries, k=7)
    step_m = EARTH_RADIUS_M * math.radians(0.1)
    # lon 180 and -180 are the same place; 179.9 and -179.9 are 0.1 degrees either side
    for q in (0, 1):
        assert set(got.indices[q, :2].tolist()) == {0, 1}
        assert got.distances_m[q, :2] == pytest.approx([0.0, 0.0], abs=TIE_M)
        assert set(got.indices[q, 2:4].tolist()) == {2, 3}
        assert got.distances_m[q, 2:4] == pytest.approx([step_m, step_m], rel=1e-9)
    assert got.indices[3, 0] == 4  # (10, -180) is next to (10, 179.99) across the line
    assert got.indices[0, 6] == 6  # (0, 0) is the farthest: half a circumference away
    assert got.distances_m[0, 6] == pytest.approx(HALF_CIRCUMFERENCE_M, abs=TIE_M)


def test_antipodal_pairs(engine: Engine, reference: Engine) -> None:
    lat, lon = uniform_points(50, seed=5)
    anti_lat, anti_lon = -lat, np.where(lon > 0, lon - 180.0, lon + 180.0)
    got = _edge_case(engine, reference, (lat, lon), (anti_lat, anti_lon), k=50)
    # the farthest point of each query is the one it is antipodal to, pi R away
    np.testing.assert_array_equal(got.indices[:, -1], np.arange(50))
    np.testing.assert_allclose(got.distances_m[:, -1], HALF_CIRCUMFERENCE_M, rtol=0, atol=TIE_M)


def test_duplicate_points_break_ties_by_row_order(engine: Engine, reference: Engine) -> None:
    lat, lon = uniform_points(2000, seed=9)
    dup_rows = np.array([13, 400, 401, 999, 1500, 1999])
    lat[dup_rows], lon[dup_rows] = 12.5, -45.25
    # far from the duplicates' place
    got = _edge_case(engine, reference, (lat, lon), ([12.5, 12.6], [-45.25, -45.25]), k=4)
    for q in (0, 1):
        # exactly equal distances: ties go by row order, strictly
        np.testing.assert_array_equal(got.indices[q], dup_rows[:4])
        assert len(set(got.distances_m[q].tolist())) == 1
    index = engine.build_index(lat, lon)
    within_zero = index.radius(np.array([12.5]), np.array([-45.25]), 0.0)
    np.testing.assert_array_equal(within_zero.indices, dup_rows)
    np.testing.assert_array_equal(within_zero.distances_m, np.zeros(6))


def test_k_larger_than_the_set_returns_every_point(engine: Engine, reference: Engine) -> None:
    lat, lon = uniform_points(25, seed=2)
    got = _edge_case(engine, reference, (lat, lon), QUERIES, k=1000)
    assert got.indices.shape == (QUERIES[0].shape[0], 25)
    for row in got.indices:
        assert sorted(row.tolist()) == list(range(25))
    assert np.all(np.diff(got.distances_m, axis=1) >= 0)


def test_single_point_set(engine: Engine, reference: Engine) -> None:
    points = ([48.8566], [2.3522])
    queries = ([48.8566, 51.5074, -33.87, -48.8566], [2.3522, -0.1278, 151.21, -177.6478])
    for k in (1, 3):
        got = _edge_case(engine, reference, points, queries, k=k)
        assert got.indices.shape == (4, 1)
        np.testing.assert_array_equal(got.indices[:, 0], 0)
    assert got.distances_m[0, 0] == 0.0
    assert got.distances_m[1, 0] == pytest.approx(343_923.0, abs=500.0)  # Paris - London
    assert got.distances_m[3, 0] == pytest.approx(HALF_CIRCUMFERENCE_M, abs=TIE_M)
    index = engine.build_index(np.array([48.8566]), np.array([2.3522]))
    assert index.n_points == 1
    bounded = index.knn(np.array([51.5074]), np.array([-0.1278]), 1, max_distance_m=1000.0)
    np.testing.assert_array_equal(bounded.indices, [[-1]])
    assert np.isinf(bounded.distances_m[0, 0])


def test_no_queries(engine: Engine) -> None:
    index = engine.build_index(*UNIFORM)
    empty = np.empty(0)
    assert index.knn(empty, empty, 3).indices.shape == (0, 3)
    found = index.radius(empty, empty, 1000.0)
    np.testing.assert_array_equal(found.offsets, [0])
    assert found.indices.shape == (0,)


# -- distance matrices -----------------------------------------------------------------
MATRIX_ROWS = (
    np.concatenate([QUERIES[0][:200], [90.0, -90.0, 0.0, 0.0, 45.0]]),
    np.concatenate([QUERIES[1][:200], [0.0, 10.0, 180.0, -179.9, -135.0]]),
)
MATRIX_COLS = (
    np.concatenate([UNIFORM[0][:300], [-90.0, 90.0, 0.0, 0.0, -45.0, 45.0]]),
    np.concatenate([UNIFORM[1][:300], [33.0, 180.0, 0.0, -180.0, 45.0, -135.0]]),
)


def _reference_matrix(rows, cols) -> np.ndarray:
    return great_circle_m(rows[0][:, None], rows[1][:, None], cols[0][None, :], cols[1][None, :])


def test_distance_matrix_float64_within_a_millimetre(engine: Engine) -> None:
    got = engine.distance_matrix(*MATRIX_ROWS, *MATRIX_COLS, dtype="float64")
    assert got.dtype == np.float64
    assert got.shape == (205, 306)
    np.testing.assert_allclose(got, _reference_matrix(MATRIX_ROWS, MATRIX_COLS), rtol=0, atol=1e-3)


def test_distance_matrix_float32_within_a_few_metres(engine: Engine) -> None:
    got = engine.distance_matrix(*MATRIX_ROWS, *MATRIX_COLS, dtype="float32")
    assert got.dtype == np.float32
    error = np.abs(got.astype(np.float64) - _reference_matrix(MATRIX_ROWS, MATRIX_COLS))
    # float32 values are 2 m apart beyond 16 777 km, so rounding the result alone costs up
    # to 1 m and float32 arithmetic a few ulps more: about 3 m, never 4.
    assert error.max() < FLOAT32_MAX_ERROR_M
    assert np.percentile(error, 99) < 3.0
    assert np.median(error) < 1.0


def test_distance_matrix_larger_than_a_tile_within_a_millimetre(engine: Engine) -> None:
    # 1,500 x 3,000 pairs: more than one tile of the host engines (BLOCK_PAIRS) on any
    # number of cores, each row in its place.
    rows, cols = uniform_points(1500, seed=31), CLUSTERED
    got = engine.distance_matrix(*rows, *cols, dtype="float64")
    assert got.shape == (1500, 3000)
    np.testing.assert_allclose(got, _reference_matrix(rows, cols), rtol=0, atol=1e-3)


def test_distance_matrix_of_a_set_with_itself_has_a_zero_diagonal(engine: Engine) -> None:
    lat, lon = CLUSTERED[0][:100], CLUSTERED[1][:100]
    got = engine.distance_matrix(lat, lon, lat, lon)
    np.testing.assert_allclose(np.diag(got), 0.0, atol=TIE_M)
    np.testing.assert_allclose(got, got.T, rtol=0, atol=TIE_M)


def test_distance_matrix_with_an_empty_side(engine: Engine) -> None:
    got = engine.distance_matrix(MATRIX_ROWS[0], MATRIX_ROWS[1], np.empty(0), np.empty(0))
    assert got.shape == (205, 0)


# -- k-means ---------------------------------------------------------------------------
def _nearest_centroid(lat, lon, result) -> tuple[np.ndarray, np.ndarray]:
    """(nearest cluster, whether the choice is clear by 1 mm) of every point."""
    d = great_circle_m(
        lat[:, None], lon[:, None], result.centroid_lat[None, :], result.centroid_lon[None, :]
    )
    order = np.sort(d, axis=1)
    clear = order[:, 1] - order[:, 0] >= TIE_M if d.shape[1] > 1 else np.ones(len(lat), bool)
    return np.argmin(d, axis=1), clear


def test_kmeans_plus_plus_draws_as_if_every_point_were_measured() -> None:
    # The seeding measures only the points a new centre may be nearer to; the draws must
    # be those of measuring every point at every draw.
    from geonear.service.engines import spherical_kmeans as sk

    lat, lon = (np.concatenate(parts) for parts in zip(CLUSTERED, CLUSTERED, UNIFORM, strict=True))
    xyz = unit_vectors(lat, lon)  # every clustered point twice: ties everywhere
    for k, seed in ((1, 0), (40, 1), (200, 2)):
        rng = np.random.default_rng(seed)
        w = np.ones(xyz.shape[0])
        chosen = [sk._draw(np.cumsum(w), rng, np)]
        nearest_sq = sk.angle_between(xyz, xyz[chosen[0]][None, :]) ** 2
        for _ in range(1, k):
            mass = np.cumsum(w * nearest_sq)
            chosen.append(sk._draw(mass if mass[-1] > 0 else np.cumsum(w), rng, np))
            angle = sk.angle_between(xyz, xyz[chosen[-1]][None, :])
            nearest_sq = np.minimum(nearest_sq, angle * angle)
        got = sk.seed_kmeans_plus_plus(xyz, k, None, np.random.default_rng(seed), np)
        np.testing.assert_array_equal(got, xyz[chosen])


def test_kmeans_same_seed_same_result(engine: Engine) -> None:
    _needs_spherical_kmeans(engine)
    index = engine.build_index(*CLUSTERED)
    a = index.kmeans(12, seed=4, n_init=2)
    b = index.kmeans(12, seed=4, n_init=2)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.centroid_lat, b.centroid_lat)
    np.testing.assert_array_equal(a.centroid_lon, b.centroid_lon)
    assert a.inertia_m2 == b.inertia_m2 and a.n_iter == b.n_iter
    other = index.kmeans(12, seed=5, n_init=2)
    assert not np.array_equal(other.centroid_lat, a.centroid_lat)


@pytest.mark.parametrize("data", SETS)
def test_kmeans_matches_reference(engine: Engine, reference: Engine, data: str) -> None:
    _needs_spherical_kmeans(engine)
    points = SETS[data][0]
    got = engine.build_index(*points).kmeans(8, seed=1, n_init=2, max_iter=50)
    want = reference.build_index(*points).kmeans(8, seed=1, n_init=2, max_iter=50)
    assert got.inertia_m2 == pytest.approx(want.inertia_m2, rel=1e-6)
    np.testing.assert_allclose(got.centroid_lat, want.centroid_lat, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.centroid_lon, want.centroid_lon, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got.sizes, want.sizes)
    assert got.sizes.sum() == points[0].shape[0]
    np.testing.assert_array_equal(np.bincount(got.labels, minlength=8), got.sizes)


@pytest.mark.parametrize("data", SETS)
def test_kmeans_labels_are_the_nearest_centroid(engine: Engine, data: str) -> None:
    lat, lon = SETS[data][0]
    result = engine.build_index(lat, lon).kmeans(10, seed=3)
    assert result.labels.dtype == np.int32 and result.labels.shape == lat.shape
    nearest, clear = _nearest_centroid(lat, lon, result)
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(result.labels[clear], nearest[clear])
    d = great_circle_m(
        lat, lon, result.centroid_lat[result.labels], result.centroid_lon[result.labels]
    )
    assert result.inertia_m2 == pytest.approx(float((d * d).sum()), rel=1e-9)


def test_kmeans_with_one_cluster_is_the_weighted_mean(engine: Engine) -> None:
    lat, lon = clustered_points(400, seed=8, n_clusters=3, spread_m=500_000.0)
    weights = np.random.default_rng(0).uniform(0.0, 5.0, lat.shape[0])
    result = engine.build_index(lat, lon).kmeans(1, weights=weights, max_iter=5)
    mean = (unit_vectors(lat, lon) * weights[:, None]).sum(axis=0)
    want_lat = math.degrees(math.atan2(mean[2], math.hypot(mean[0], mean[1])))
    want_lon = math.degrees(math.atan2(mean[1], mean[0]))
    assert (
        float(great_circle_m(result.centroid_lat[0], result.centroid_lon[0], want_lat, want_lon))
        < TIE_M
    )
    d = great_circle_m(lat, lon, want_lat, want_lon)
    assert result.inertia_m2 == pytest.approx(float((weights * d * d).sum()), rel=1e-9)
    unweighted = engine.build_index(lat, lon).kmeans(1, max_iter=5)
    assert (
        float(
            great_circle_m(
                unweighted.centroid_lat[0], unweighted.centroid_lon[0], want_lat, want_lon
            )
        )
        > 1000.0
    )


def test_kmeans_weights_match_reference(engine: Engine, reference: Engine) -> None:
    weights = np.random.default_rng(1).uniform(0.0, 3.0, CLUSTERED[0].shape[0])
    weights[::7] = 0.0
    got = engine.build_index(*CLUSTERED).kmeans(6, weights=weights, seed=2)
    want = reference.build_index(*CLUSTERED).kmeans(6, weights=weights, seed=2)
    assert got.inertia_m2 == pytest.approx(want.inertia_m2, rel=1e-6)
    np.testing.assert_array_equal(got.sizes, want.sizes)


def test_kmeans_with_k_equal_to_the_points_puts_each_in_its_own_cluster(engine: Engine) -> None:
    lat, lon = uniform_points(12, seed=6)
    result = engine.build_index(lat, lon).kmeans(12, seed=0)
    np.testing.assert_array_equal(np.sort(result.labels), np.arange(12))
    np.testing.assert_array_equal(result.sizes, np.ones(12))
    assert result.inertia_m2 == pytest.approx(0.0, abs=1e-6)


def test_kmeans_refuses_k_beyond_the_points(engine: Engine) -> None:
    index = engine.build_index(*uniform_points(5, seed=1))
    with pytest.raises(ValueError, match="k must be between 1 and the number of points"):
        index.kmeans(6)
