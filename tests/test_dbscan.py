"""DBSCAN on the sphere against scikit-learn's DBSCAN (haversine, ball tree).

scikit-learn is the definition (DBSCAN(eps=eps_m / R, metric="haversine") on radians),
except for a border point next to two clusters, which scikit-learn gives to the cluster
that reaches it first and geonear to the cluster of its smallest-row core neighbour.
Core points and noise must be equal, clusters equal as partitions of the core points,
and every border point in a cluster of one of its core neighbours in both answers.

GPU tests (``pytest -m gpu``) run the same sets on the GPU index and expect the CPU's
labels exactly; without a working GPU they are skipped with the reason.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from scipy.sparse import coo_array
from scipy.sparse.csgraph import connected_components
from sklearn.cluster import DBSCAN

from geonear.geometry import EARTH_RADIUS_M, great_circle_m
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.analytics import (
    DbscanResult,
    DbscanStopped,
    TooManyNeighbours,
    dbscan,
    min_label_components,
)
from geonear.service.engines import create_engine, gpu_available


def sklearn_dbscan(
    lat: np.ndarray, lon: np.ndarray, eps_m: float, min_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's (labels, core mask) on radians [lat, lon]."""
    model = DBSCAN(
        eps=eps_m / EARTH_RADIUS_M,
        min_samples=min_samples,
        metric="haversine",
        algorithm="ball_tree",
    )
    fit = model.fit(np.radians(np.column_stack([lat, lon])))
    core = np.zeros(lat.shape[0], dtype=bool)
    core[fit.core_sample_indices_] = True
    return fit.labels_.astype(np.int64), core


def neighbourhoods(lat: np.ndarray, lon: np.ndarray, eps_m: float) -> np.ndarray:
    """The brute-force neighbourhood matrix (n, n), row i as the query."""
    dist = great_circle_m(lat[:, None], lon[:, None], lat[None, :], lon[None, :])
    return dist <= eps_m


def assert_matches_sklearn(
    result: DbscanResult, lat: np.ndarray, lon: np.ndarray, eps_m: float, min_samples: int
) -> None:
    theirs, their_core = sklearn_dbscan(lat, lon, eps_m, min_samples)
    ours = result.labels
    np.testing.assert_array_equal(result.core, their_core)
    np.testing.assert_array_equal(ours < 0, theirs < 0)
    assert result.n_clusters == (theirs.max() + 1 if theirs.size else 0)
    # Core points: the same partition (a one-to-one map between the labels).
    core = result.core
    pairs = np.unique(np.column_stack([ours[core], theirs[core]]), axis=0)
    assert len(np.unique(pairs[:, 0])) == len(pairs) == len(np.unique(pairs[:, 1]))
    ours_to_theirs = dict(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist(), strict=True))
    # Border points: our cluster is that of the smallest-row core neighbour, and
    # scikit-learn's is one of its core neighbours' clusters.
    near = neighbourhoods(lat, lon, eps_m)
    for b in np.flatnonzero(~core & (ours >= 0)):
        core_neighbours = np.flatnonzero(near[b] & core)
        assert core_neighbours.size
        assert ours[b] == ours[core_neighbours[0]]
        assert theirs[b] in {ours_to_theirs[int(ours[c])] for c in core_neighbours}
    assert_numbered_by_first_row(result)


def assert_numbered_by_first_row(result: DbscanResult) -> None:
    """Clusters 0, 1, ... in the order of their smallest row; sizes count members."""
    labels = result.labels
    clustered = labels[labels >= 0]
    _, first = np.unique(clustered, return_index=True)
    np.testing.assert_array_equal(clustered[np.sort(first)], np.arange(result.n_clusters))
    np.testing.assert_array_equal(result.sizes, np.bincount(clustered, minlength=result.n_clusters))
    assert result.labels.dtype == np.int64 and result.sizes.dtype == np.int64


def _around(lat0: float, lon0: float, n: int, spread_deg: float, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    lat = np.clip(lat0 + rng.normal(0, spread_deg, n), -90.0, 90.0)
    lon = (lon0 + rng.normal(0, spread_deg, n) + 180.0) % 360.0 - 180.0
    return lat, lon


def _sets() -> dict[str, tuple[np.ndarray, np.ndarray, float, int]]:
    uni = uniform_points(2000, seed=11)
    clu = clustered_points(2000, seed=12, n_clusters=20, spread_m=15_000.0)
    # Two groups on either side of 180 degrees, joined across it.
    am_lat, am_lon = _around(0.0, 180.0, 600, 0.05, seed=13)
    # Points around the north pole, at every longitude.
    rng = np.random.default_rng(14)
    pole_lat = 90.0 - np.abs(rng.normal(0, 0.05, 600))
    pole_lat[:5] = 90.0
    pole_lon = rng.uniform(-180.0, 180.0, 600)
    # Duplicates: 40 places, most repeated, some once.
    places_lat, places_lon = uniform_points(40, seed=15)
    repeat = np.random.default_rng(16).integers(1, 6, 40)
    dup_lat, dup_lon = np.repeat(places_lat, repeat), np.repeat(places_lon, repeat)
    return {
        "uniform": (*uni, 250_000.0, 4),
        "clustered": (*clu, 3_000.0, 5),
        "antimeridian": (am_lat, am_lon, 800.0, 4),
        "north-pole": (pole_lat, pole_lon, 700.0, 4),
        "duplicates": (dup_lat, dup_lon, 1.0, 3),
        "min-samples-1": (*clu, 2_000.0, 1),
    }


SETS = _sets()


@pytest.mark.parametrize("name", list(SETS))
def test_dbscan_matches_scikit_learn(name: str) -> None:
    lat, lon, eps_m, min_samples = SETS[name]
    result = dbscan(lat, lon, eps_m, min_samples)
    assert_matches_sklearn(result, lat, lon, eps_m, min_samples)
    assert result.n_clusters > 1


def test_the_sets_have_border_points_and_noise() -> None:
    # The parity tests above would be weak without both.
    lat, lon, eps_m, min_samples = SETS["clustered"]
    result = dbscan(lat, lon, eps_m, min_samples)
    assert np.count_nonzero(~result.core & (result.labels >= 0)) > 10
    assert result.n_noise > 10


def test_a_point_between_two_clusters_joins_its_smallest_row_core_neighbour() -> None:
    # Two groups of 4 points 100 m apart on the equator, 1.5 km between their nearest
    # points, and row 7 half-way: with eps 800 m and min_samples 4 it sees one core point
    # of each group (rows 3 and 8) and itself, so it borders both clusters.
    metres = np.array([-1050, -950, -850, 750, 850, 950, 1050, 0, -750], dtype=np.float64)
    lon = np.degrees(metres / EARTH_RADIUS_M)
    lat = np.zeros_like(lon)
    result = dbscan(lat, lon, 800.0, 4)
    assert result.core.tolist() == [True] * 7 + [False, True]
    # The western cluster holds row 0: cluster 0. Row 7 joins row 3's, the eastern one;
    # scikit-learn, expanding from row 0 first, reaches it through row 8 instead.
    assert result.labels.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0]
    assert sklearn_dbscan(lat, lon, 800.0, 4)[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert_matches_sklearn(result, lat, lon, 800.0, 4)


def test_eps_larger_than_the_set_gives_one_cluster() -> None:
    lat, lon = uniform_points(500, seed=21)
    result = dbscan(lat, lon, 3.0e7, 10)  # more than half the circumference
    assert result.n_clusters == 1 and result.core.all()
    np.testing.assert_array_equal(result.labels, np.zeros(500, dtype=np.int64))
    np.testing.assert_array_equal(result.sizes, [500])
    assert result.neighbour_pairs == 500 * 500
    assert_matches_sklearn(result, lat, lon, 3.0e7, 10)


def test_min_samples_one_makes_every_point_core() -> None:
    lat, lon, eps_m, _ = SETS["clustered"]
    result = dbscan(lat, lon, eps_m, 1)
    assert result.core.all() and result.n_noise == 0


def test_duplicates_count_towards_min_samples() -> None:
    lat = np.array([10.0, 10.0, 10.0, 20.0, 20.0, 30.0])
    lon = np.array([5.0, 5.0, 5.0, 5.0, 5.0, 5.0])
    result = dbscan(lat, lon, 1.0, 3)
    assert result.labels.tolist() == [0, 0, 0, -1, -1, -1]
    assert result.core.tolist() == [True, True, True, False, False, False]
    assert dbscan(lat, lon, 1.0, 2).labels.tolist() == [0, 0, 0, 1, 1, -1]


@pytest.mark.parametrize("engine", ["cpu", "numpy-brute", "sklearn"])
def test_every_host_index_gives_the_same_labels(engine: str) -> None:
    lat, lon, eps_m, min_samples = SETS["clustered"]
    expected = dbscan(lat, lon, eps_m, min_samples)
    index = create_engine(engine).build_index(lat, lon)
    result = dbscan(lat, lon, eps_m, min_samples, index=index)
    np.testing.assert_array_equal(result.labels, expected.labels)
    np.testing.assert_array_equal(result.core, expected.core)
    assert result.neighbour_pairs == expected.neighbour_pairs


def test_slices_of_the_work_give_the_same_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("geonear.service.analytics.dbscan")
    lat, lon, eps_m, min_samples = SETS["clustered"]
    index = create_engine("numpy-brute").build_index(lat, lon)
    whole = dbscan(lat, lon, eps_m, min_samples, index=index)
    monkeypatch.setattr(module, "SLICE_PAIRS", 997)
    monkeypatch.setattr(module, "COUNT_SLICE_POINTS", 101)
    sliced = dbscan(lat, lon, eps_m, min_samples, index=index)
    np.testing.assert_array_equal(sliced.labels, whole.labels)
    monkeypatch.setattr(module, "SLICE_PAIRS", 1000)  # the tree's pairs in slices too
    np.testing.assert_array_equal(dbscan(lat, lon, eps_m, min_samples).labels, whole.labels)


@pytest.mark.parametrize("engine", [None, "numpy-brute"])
def test_too_many_neighbours_is_refused_before_listing_them(engine: str | None) -> None:
    lat, lon = uniform_points(1000, seed=31)
    index = None if engine is None else create_engine(engine).build_index(lat, lon)
    with pytest.raises(TooManyNeighbours) as caught:
        dbscan(lat, lon, 2.0e7, 5, index=index, max_neighbour_pairs=100_000)
    assert caught.value.limit == 100_000 and caught.value.pairs > 100_000
    assert isinstance(caught.value, ValueError)
    assert "eps_m" in str(caught.value)
    # Within the bound, the same call runs.
    assert dbscan(lat, lon, 2.0e7, 5, index=index, max_neighbour_pairs=1_000_000).n_clusters == 1


@pytest.mark.parametrize("engine", [None, "numpy-brute"])
def test_should_stop_stops_the_run(engine: str | None) -> None:
    lat, lon, eps_m, min_samples = SETS["clustered"]
    index = None if engine is None else create_engine(engine).build_index(lat, lon)
    with pytest.raises(DbscanStopped):
        dbscan(lat, lon, eps_m, min_samples, index=index, should_stop=lambda: True)


def test_bad_parameters_are_refused() -> None:
    lat, lon = uniform_points(10, seed=41)
    for eps_m in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps_m"):
            dbscan(lat, lon, eps_m, 3)
    for min_samples in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="min_samples"):
            dbscan(lat, lon, 1000.0, min_samples)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="latitudes"):
        dbscan(np.array([91.0]), np.array([0.0]), 1000.0, 1)
    with pytest.raises(ValueError, match="finite"):
        dbscan(np.array([np.nan]), np.array([0.0]), 1000.0, 1)
    with pytest.raises(ValueError, match="1-D"):
        dbscan(lat, lon[:5], 1000.0, 1)
    other = create_engine("cpu").build_index(lat[:5], lon[:5])
    with pytest.raises(ValueError, match="index holds 5 points"):
        dbscan(lat, lon, 1000.0, 1, index=other)
    moon = create_engine("cpu", earth_radius_m=1_737_400.0).build_index(lat, lon)
    with pytest.raises(ValueError, match="sphere"):
        dbscan(lat, lon, 1000.0, 1, index=moon)


def test_no_points_give_no_clusters() -> None:
    result = dbscan(np.empty(0), np.empty(0), 1000.0, 3)
    assert result.n_clusters == 0 and result.labels.shape == (0,) and result.sizes.shape == (0,)


def test_all_noise_gives_no_clusters() -> None:
    lat, lon = uniform_points(50, seed=51)
    result = dbscan(lat, lon, 1.0, 2)
    assert result.n_clusters == 0 and result.n_noise == 50 and result.sizes.shape == (0,)


def test_other_sphere_radius_scales_eps() -> None:
    lat, lon, eps_m, min_samples = SETS["clustered"]
    earth = dbscan(lat, lon, eps_m, min_samples)
    half = dbscan(lat, lon, eps_m / 2, min_samples, earth_radius_m=EARTH_RADIUS_M / 2)
    np.testing.assert_array_equal(half.core, earth.core)


def test_min_label_components_matches_scipy() -> None:
    rng = np.random.default_rng(61)
    for n, n_links in ((1, 0), (50, 0), (200, 150), (2000, 1800), (2000, 6000)):
        source = rng.integers(0, n, n_links).astype(np.int32)
        target = rng.integers(0, n, n_links).astype(np.int32)
        parent = min_label_components(source, target, n, np)
        graph = coo_array((np.ones(n_links), (source, target)), shape=(n, n))
        _, component = connected_components(graph, directed=False)
        # Same partition, and each vertex labelled by its component's smallest vertex.
        smallest = np.full(component.max() + 1, n)
        np.minimum.at(smallest, component, np.arange(n))
        np.testing.assert_array_equal(parent, smallest[component])


def test_min_label_components_on_a_long_chain() -> None:
    # A path whose rows alternate ends (0, n-1, 1, n-2, ...): the worst order for hooking.
    n = 4001
    order = np.empty(n, dtype=np.int32)
    order[0::2] = np.arange((n + 1) // 2)
    order[1::2] = n - 1 - np.arange(n // 2)
    parent = min_label_components(order[:-1], order[1:], n, np)
    np.testing.assert_array_equal(parent, np.zeros(n, dtype=np.int32))


# -- GPU ------------------------------------------------------------------------------

no_gpu = pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}")


@pytest.mark.gpu
@no_gpu
@pytest.mark.parametrize("name", list(SETS))
def test_gpu_index_gives_the_cpu_labels(name: str) -> None:
    lat, lon, eps_m, min_samples = SETS[name]
    index = create_engine("gpu").build_index(lat, lon)
    result = dbscan(lat, lon, eps_m, min_samples, index=index)
    expected = dbscan(lat, lon, eps_m, min_samples)
    np.testing.assert_array_equal(result.labels, expected.labels)
    np.testing.assert_array_equal(result.core, expected.core)
    np.testing.assert_array_equal(result.sizes, expected.sizes)
    assert result.neighbour_pairs == expected.neighbour_pairs


@pytest.mark.gpu
@no_gpu
def test_gpu_dbscan_in_slices_stops_and_refuses_as_the_host_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dbscan_gpu = importlib.import_module("geonear.service.analytics.dbscan_gpu")
    lat, lon = clustered_points(200_000, seed=71, n_clusters=100, spread_m=30_000.0)
    index = create_engine("gpu").build_index(lat, lon)
    expected = dbscan(lat, lon, 500.0, 8)
    monkeypatch.setattr(dbscan_gpu, "DEVICE_SLICE_PAIRS", 100_000)
    result = dbscan(lat, lon, 500.0, 8, index=index)
    np.testing.assert_array_equal(result.labels, expected.labels)
    with pytest.raises(TooManyNeighbours):
        dbscan(lat, lon, 500.0, 8, index=index, max_neighbour_pairs=1000)
    with pytest.raises(DbscanStopped):
        dbscan(lat, lon, 500.0, 8, index=index, should_stop=lambda: True)


@pytest.mark.gpu
@no_gpu
def test_min_label_components_on_the_device_matches_the_host() -> None:
    import cupy as cp

    rng = np.random.default_rng(81)
    n = 5000
    source = rng.integers(0, n, 7000).astype(np.int32)
    target = rng.integers(0, n, 7000).astype(np.int32)
    host = min_label_components(source, target, n, np)
    device = min_label_components(cp.asarray(source), cp.asarray(target), n, cp)
    np.testing.assert_array_equal(cp.asnumpy(device), host)
