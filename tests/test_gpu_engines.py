"""The GPU engines (gpu, cuml, cupy-broadcast) against the float64 reference.

Runs on a GPU machine (``pytest -m gpu``); without a working GPU every test here is
skipped with the reason ``gpu_available()`` gives. Sets are larger than the foundation's
parity tests so that the GPU paths for many queries (queries sorted by key, radius
answers longer than the kernel sorts itself, k above the register top-k) run too.
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pyarrow as pa
import pytest
from test_engine_parity import TIE_M, assert_same_neighbours

from geonear.geometry import EARTH_RADIUS_M, great_circle_m, unit_vectors
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import (
    Engine,
    EngineUnavailable,
    create_engine,
    gpu_available,
    gpu_memory,
)
from geonear.service.engines.base import Neighbours

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}"),
]

REFERENCE = "numpy-brute"
HALF_CIRCUMFERENCE_M = math.pi * EARTH_RADIUS_M

UNIFORM = uniform_points(20_000, seed=31)
CLUSTERED = clustered_points(20_000, seed=32, n_clusters=40, spread_m=5_000.0)
QUERIES = uniform_points(3000, seed=33)
CLUSTER_QUERIES = (
    np.concatenate([CLUSTERED[0][:1500], np.clip(CLUSTERED[0][:1500] + 0.003, -90, 90)]),
    np.concatenate([CLUSTERED[1][:1500], CLUSTERED[1][:1500] - 0.003]),
)
SETS = {"uniform": (UNIFORM, QUERIES), "clustered": (CLUSTERED, CLUSTER_QUERIES)}


def _engine(name: str) -> Engine:
    try:
        return create_engine(name)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reference() -> Engine:
    return create_engine(REFERENCE)


@pytest.fixture(scope="module", params=["gpu", "cuml", "cupy-broadcast"])
def knn_engine(request: pytest.FixtureRequest) -> Engine:
    return _engine(request.param)


@pytest.fixture(scope="module", params=["gpu", "cupy-broadcast"])
def full_engine(request: pytest.FixtureRequest) -> Engine:
    """Engines that answer radius queries and matrices too (cuML's do not)."""
    return _engine(request.param)


@pytest.fixture(scope="module")
def gpu() -> Engine:
    return _engine("gpu")


def _queries(data: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    lat, lon = SETS[data][1]
    return lat[:n], lon[:n]


# Each point 10 times over: the k best are decided by row among equal distances.
_BASE = uniform_points(2000, seed=34)
DUPLICATES = (np.repeat(_BASE[0], 10), np.repeat(_BASE[1], 10))


def _points_and_queries(data: str, n: int) -> tuple[tuple, tuple]:
    if data == "duplicates":
        return DUPLICATES, (_BASE[0][:n], _BASE[1][:n] + 0.0001)
    return SETS[data][0], _queries(data, n)


_REFERENCE_KNN: dict[tuple, Neighbours] = {}


def _reference_knn(
    reference: Engine, data: str, n: int, k: int, max_distance_m: float | None = None
) -> Neighbours:
    """The reference's KNN answer, computed once per module (host brute force of 3000
    queries takes seconds a call)."""
    key = (data, n, k, max_distance_m)
    if key not in _REFERENCE_KNN:
        points, queries = _points_and_queries(data, n)
        index = reference.build_index(*points)
        _REFERENCE_KNN[key] = index.knn(*queries, k, max_distance_m=max_distance_m)
    return _REFERENCE_KNN[key]


# -- KNN -------------------------------------------------------------------------------
@pytest.mark.parametrize("data", SETS)
@pytest.mark.parametrize("k", [1, 10, 33, 200])
def test_knn_matches_reference(knn_engine: Engine, reference: Engine, data: str, k: int) -> None:
    points = SETS[data][0]
    # the brute-force engines get fewer queries: they are O(queries x points)
    n = 3000 if knn_engine.name == "gpu" else 400
    queries = _queries(data, n)
    got = knn_engine.build_index(*points).knn(*queries, k)
    want = _reference_knn(reference, data, n, k)
    assert got.indices.shape == (queries[0].shape[0], k)
    assert got.indices.dtype == np.int64 and got.distances_m.dtype == np.float64
    assert_same_neighbours(got, want, queries=queries, points=points)


@pytest.mark.parametrize("data", SETS)
def test_knn_max_distance_matches_reference(
    knn_engine: Engine, reference: Engine, data: str
) -> None:
    points, queries = SETS[data][0], _queries(data, 500)
    # a bound that cuts about half the queries' lists short
    bound = float(np.median(_reference_knn(reference, data, 500, 12).distances_m[:, -1]))
    got = knn_engine.build_index(*points).knn(*queries, 12, max_distance_m=bound)
    want = _reference_knn(reference, data, 500, 12, bound)
    assert (want.indices < 0).any() and (want.indices >= 0).any()  # the bound really cuts
    assert_same_neighbours(got, want, queries=queries, points=points)
    assert np.all(got.distances_m[got.indices >= 0] <= bound)


def test_knn_of_many_queries_is_the_same_in_any_order(gpu: Engine) -> None:
    # Many queries are searched in key order and written back in the order given.
    index = gpu.build_index(*CLUSTERED)
    lat, lon = CLUSTER_QUERIES
    whole = index.knn(lat, lon, 8)
    perm = np.random.default_rng(0).permutation(lat.shape[0])
    shuffled = index.knn(lat[perm], lon[perm], 8)
    np.testing.assert_array_equal(shuffled.indices, whole.indices[perm])
    np.testing.assert_array_equal(shuffled.distances_m, whole.distances_m[perm])
    few = index.knn(lat[:10], lon[:10], 8)  # searched in the order given
    np.testing.assert_array_equal(few.indices, whole.indices[:10])


def test_knn_of_many_queries_in_slices_equals_one_search(
    gpu: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Large query sets are searched in slices, each on its own stream.
    from geonear.service.engines import gpu as gpu_module

    index = gpu.build_index(*CLUSTERED)
    lat, lon = CLUSTER_QUERIES
    whole = index.knn(lat, lon, 10)
    monkeypatch.setattr(gpu_module, "KNN_CHUNK", 700)
    chunks = gpu_module._query_chunks(lat.shape[0])
    assert len(chunks) == gpu_module.KNN_CHUNKS
    assert chunks[0][0] == 0 and chunks[-1][1] == lat.shape[0]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    sliced = index.knn(lat, lon, 10)
    np.testing.assert_array_equal(sliced.indices, whole.indices)
    np.testing.assert_array_equal(sliced.distances_m, whole.distances_m)


@pytest.mark.parametrize("data", [*SETS, "duplicates", "few points", "sparse queries"])
def test_knn_from_warp_windows_equals_the_search_without(
    gpu: Engine, monkeypatch: pytest.MonkeyPatch, data: str
) -> None:
    # Many queries among not many more points: the fast pass first searches each warp's
    # window of leaves and skips them in the tree. With 100 points one window holds
    # them all and the tree is not searched at all; duplicates tie at every distance.
    # With 2,048 queries among 400k points, a warp's queries span far more than a window.
    from geonear.service.engines import gpu as gpu_module

    if data == "duplicates":
        points, queries = DUPLICATES, (DUPLICATES[0][:4000], DUPLICATES[1][:4000])
    elif data == "few points":
        points, queries = uniform_points(100, seed=35), QUERIES
    elif data == "sparse queries":
        points, queries = clustered_points(400_000, seed=36), uniform_points(2048, seed=37)
    else:
        points, queries = SETS[data]
    index = gpu.build_index(*points)
    launched: list[str] = []
    fn = gpu_module._fn
    monkeypatch.setattr(gpu_module, "_fn", lambda name: launched.append(name) or fn(name))
    for k in (1, 10, 16):
        windowed = index.knn(*queries, k, max_distance_m=None if k < 16 else 500_000.0)
        assert gpu_module._knn_name(k, exact=False, window=True) in launched
        monkeypatch.setattr(gpu_module, "WINDOW_MAX_K", 0)
        plain = index.knn(*queries, k, max_distance_m=None if k < 16 else 500_000.0)
        monkeypatch.setattr(gpu_module, "WINDOW_MAX_K", 16)
        np.testing.assert_array_equal(windowed.indices, plain.indices)
        np.testing.assert_array_equal(windowed.distances_m, plain.distances_m)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_equidistant_neighbours_are_ranked_by_row(gpu: Engine, reference: Engine, k: int) -> None:
    # Points d north and d south of an equator point lie at exactly equal float64
    # distances from it; each is there three times, under shuffled rows, among uniform
    # points. Only the exact pass of the KNN kernel (rows read on ties) ranks them by row.
    rng = np.random.default_rng(12)
    centres = np.arange(-170.0, 180.0, 7.0)
    offsets = rng.uniform(0.01, 0.1, centres.shape[0])
    tied_lat = np.concatenate([offsets, -offsets] * 3)
    tied_lon = np.concatenate([centres, centres] * 3)
    noise = uniform_points(3000, seed=13)
    lat = np.concatenate([tied_lat, noise[0]])
    lon = np.concatenate([tied_lon, noise[1]])
    perm = rng.permutation(lat.shape[0])
    lat, lon = lat[perm], lon[perm]
    queries = (np.zeros_like(centres), centres)
    got = gpu.build_index(lat, lon).knn(*queries, k)
    want = reference.build_index(lat, lon).knn(*queries, k)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_allclose(got.distances_m, want.distances_m, rtol=0, atol=1e-6)
    if k > 1:  # the answers do hold exact ties (the nearest six points of most queries)
        assert np.mean(got.distances_m[:, 0] == got.distances_m[:, 1]) > 0.9


@pytest.mark.parametrize("leaf_size", [8, 16])
@pytest.mark.parametrize("data", [*SETS, "duplicates"])
def test_index_of_any_leaf_size_gives_the_reference_answers(
    reference: Engine, data: str, leaf_size: int
) -> None:
    from geonear.service.engines.gpu import GPUEngine

    points, queries = _points_and_queries(data, 3000)
    index = GPUEngine(leaf_size=leaf_size).build_index(*points)
    for k in (1, 10, 33):
        want = _reference_knn(reference, data, 3000, k)
        assert_same_neighbours(index.knn(*queries, k), want, queries=queries, points=points)
    bound = float(np.median(_reference_knn(reference, data, 3000, 33).distances_m[:, 5]))
    got = index.knn(*queries, 10, max_distance_m=bound)
    want = _reference_knn(reference, data, 3000, 10, bound)
    assert (want.indices < 0).any()
    assert_same_neighbours(got, want, queries=queries, points=points)


# -- radius ----------------------------------------------------------------------------
@pytest.mark.parametrize("data", SETS)
@pytest.mark.parametrize("radius_m", [0.0, 3_000.0, 60_000.0, 1_500_000.0])
def test_radius_matches_reference(
    full_engine: Engine, reference: Engine, data: str, radius_m: float
) -> None:
    points, queries = SETS[data][0], _queries(data, 300)
    got = full_engine.build_index(*points).radius(*queries, radius_m)
    want = reference.build_index(*points).radius(*queries, radius_m)
    assert_same_neighbours(got, want, queries=queries, points=points)
    assert np.all(got.distances_m <= radius_m)
    if radius_m == 1_500_000.0 and data == "uniform":
        # answers longer than the kernel sorts itself went through the device sort
        assert np.diff(got.offsets).max() > 128


def test_radius_beyond_half_the_circumference_returns_every_point(
    full_engine: Engine, reference: Engine
) -> None:
    points = (UNIFORM[0][:3000], UNIFORM[1][:3000])
    queries = (QUERIES[0][:5], QUERIES[1][:5])
    got = full_engine.build_index(*points).radius(*queries, HALF_CIRCUMFERENCE_M + 1.0)
    assert np.all(np.diff(got.offsets) == 3000)
    want = reference.build_index(*points).radius(*queries, HALF_CIRCUMFERENCE_M + 1.0)
    assert_same_neighbours(got, want)


@pytest.mark.parametrize("data", ["uniform", "duplicates"])
def test_radius_long_answers_are_sorted_by_distance_then_row(
    gpu: Engine, reference: Engine, data: str
) -> None:
    # About 4,100 neighbours a query: some answers sorted a block each in shared memory
    # (at most 4096), the others by the lexsort; duplicates tie in tens, decided by row.
    points = UNIFORM if data == "uniform" else DUPLICATES
    queries = _queries("uniform", 200)
    got = gpu.build_index(*points).radius(*queries, 6_000_000.0)
    sizes = np.diff(got.offsets)
    assert (sizes > 4096).any() and ((sizes > 128) & (sizes <= 4096)).any()
    for q, (start, stop) in enumerate(itertools.pairwise(got.offsets)):
        order = np.lexsort((got.indices[start:stop], got.distances_m[start:stop]))
        np.testing.assert_array_equal(order, np.arange(stop - start), f"query {q}")
    want = reference.build_index(*points).radius(*queries, 6_000_000.0)
    assert_same_neighbours(got, want, queries=queries, points=points)


# -- edge cases ------------------------------------------------------------------------
def _both(engine: Engine, reference: Engine, points, queries, k: int, radius_m: float | None):
    points = tuple(np.asarray(p, dtype=np.float64) for p in points)
    queries = tuple(np.asarray(q, dtype=np.float64) for q in queries)
    got = engine.build_index(*points).knn(*queries, k)
    assert_same_neighbours(
        got, reference.build_index(*points).knn(*queries, k), queries=queries, points=points
    )
    if radius_m is not None and engine.name != "cuml":
        found = engine.build_index(*points).radius(*queries, radius_m)
        want = reference.build_index(*points).radius(*queries, radius_m)
        assert_same_neighbours(found, want, queries=queries, points=points)
    return got


def test_poles(knn_engine: Engine, reference: Engine) -> None:
    lon = [-180.0, -90.0, 0.0, 45.0, 180.0]
    points = ([90.0] * 5 + [-90.0] * 5 + [89.999, -89.999], lon + lon + [17.0, -163.0])
    queries = ([90.0, -90.0, 89.9999], [0.0, 77.0, 180.0])
    got = _both(knn_engine, reference, points, queries, k=6, radius_m=200.0)
    assert set(got.indices[0, :5].tolist()) == set(range(5))
    assert set(got.indices[1, :5].tolist()) == set(range(5, 10))
    assert got.indices[0, 5] == 10 and got.indices[1, 5] == 11


def test_antimeridian(knn_engine: Engine, reference: Engine) -> None:
    points = ([0.0, 0.0, 0.0, 0.0, 10.0, 0.0], [180.0, -180.0, 179.9, -179.9, 179.99, 0.0])
    queries = ([0.0, 0.0, 10.0], [180.0, -179.95, -180.0])
    got = _both(knn_engine, reference, points, queries, k=6, radius_m=50_000.0)
    assert set(got.indices[0, :2].tolist()) == {0, 1}
    assert got.indices[2, 0] == 4  # across the line
    assert got.distances_m[0, 5] == pytest.approx(HALF_CIRCUMFERENCE_M, abs=TIE_M)


def test_antipodal_pairs(knn_engine: Engine, reference: Engine) -> None:
    lat, lon = uniform_points(40, seed=5)
    anti = (-lat, np.where(lon > 0, lon - 180.0, lon + 180.0))
    got = _both(knn_engine, reference, (lat, lon), anti, k=40, radius_m=HALF_CIRCUMFERENCE_M)
    np.testing.assert_array_equal(got.indices[:, -1], np.arange(40))
    np.testing.assert_allclose(got.distances_m[:, -1], HALF_CIRCUMFERENCE_M, rtol=0, atol=TIE_M)


@pytest.mark.parametrize("k", [4, 150])
def test_duplicates_break_ties_by_row_order(knn_engine: Engine, reference: Engine, k: int) -> None:
    # k=150: the GPU engine's path for k above its register top-k
    lat, lon = uniform_points(4000, seed=9)
    dup_rows = np.sort(np.random.default_rng(3).choice(4000, 160, replace=False))
    lat[dup_rows], lon[dup_rows] = -33.75, 151.25
    got = _both(knn_engine, reference, (lat, lon), ([-33.75], [151.25]), k=k, radius_m=0.0)
    np.testing.assert_array_equal(got.indices[0], dup_rows[:k])
    np.testing.assert_array_equal(got.distances_m[0], np.zeros(k))


def test_k_larger_than_the_set_and_a_single_point(knn_engine: Engine, reference: Engine) -> None:
    lat, lon = uniform_points(30, seed=2)
    got = _both(knn_engine, reference, (lat, lon), QUERIES, k=500, radius_m=None)
    assert got.indices.shape == (QUERIES[0].shape[0], 30)
    assert all(sorted(row.tolist()) == list(range(30)) for row in got.indices)
    one = _both(knn_engine, reference, ([12.0], [-7.0]), QUERIES, k=3, radius_m=None)
    assert one.indices.shape == (QUERIES[0].shape[0], 1)
    np.testing.assert_array_equal(one.indices, 0)


def test_no_queries_and_no_points(full_engine: Engine) -> None:
    empty = np.empty(0)
    index = full_engine.build_index(*UNIFORM)
    assert index.knn(empty, empty, 3).indices.shape == (0, 3)
    np.testing.assert_array_equal(index.radius(empty, empty, 10.0).offsets, [0])
    nothing = full_engine.build_index(empty, empty)
    assert nothing.knn(QUERIES[0][:4], QUERIES[1][:4], 3).indices.shape == (4, 0)
    np.testing.assert_array_equal(
        np.diff(nothing.radius(QUERIES[0][:4], QUERIES[1][:4], 1e6).offsets), 0
    )


# -- distance matrices -----------------------------------------------------------------
ROWS = (
    np.concatenate([QUERIES[0][:300], [90.0, -90.0, 0.0]]),
    np.concatenate([QUERIES[1][:300], [0.0, 10.0, 180.0]]),
)
COLS = (
    np.concatenate([UNIFORM[0][:700], [-90.0, 0.0, 0.0]]),
    np.concatenate([UNIFORM[1][:700], [33.0, 0.0, -180.0]]),
)


def _reference_matrix() -> np.ndarray:
    return great_circle_m(ROWS[0][:, None], ROWS[1][:, None], COLS[0][None, :], COLS[1][None, :])


def test_matrix_float64_within_a_millimetre(full_engine: Engine) -> None:
    got = full_engine.distance_matrix(*ROWS, *COLS, dtype="float64")
    assert got.dtype == np.float64 and got.shape == (303, 703)
    np.testing.assert_allclose(got, _reference_matrix(), rtol=0, atol=1e-3)


def test_matrix_float32_within_a_few_metres(full_engine: Engine) -> None:
    got = full_engine.distance_matrix(*ROWS, *COLS, dtype="float32")
    assert got.dtype == np.float32
    error = np.abs(got.astype(np.float64) - _reference_matrix())
    assert error.max() < 4.0
    assert np.median(error) < 1.0


def test_matrix_kept_on_the_device_equals_the_host_one(gpu: Engine) -> None:
    import cupy

    on_device = gpu.distance_matrix_device(*ROWS, *COLS, dtype="float64")  # type: ignore[attr-defined]
    assert isinstance(on_device, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(on_device), gpu.distance_matrix(*ROWS, *COLS))


# -- k-means ---------------------------------------------------------------------------
@pytest.mark.parametrize("data", SETS)
def test_kmeans_matches_the_cpu_engine_from_the_same_seed(full_engine: Engine, data: str) -> None:
    points = SETS[data][0]
    cpu = create_engine("cpu").build_index(*points).kmeans(16, seed=7, n_init=2, max_iter=40)
    got = full_engine.build_index(*points).kmeans(16, seed=7, n_init=2, max_iter=40)
    assert got.inertia_m2 == pytest.approx(cpu.inertia_m2, rel=1e-6)
    np.testing.assert_array_equal(got.sizes, cpu.sizes)
    np.testing.assert_allclose(got.centroid_lat, cpu.centroid_lat, rtol=0, atol=1e-6)
    assert got.n_iter == cpu.n_iter


def test_gpu_kmeans_is_deterministic_and_weighted_like_the_cpu(gpu: Engine) -> None:
    weights = np.random.default_rng(1).uniform(0.0, 3.0, CLUSTERED[0].shape[0])
    weights[::5] = 0.0
    index = gpu.build_index(*CLUSTERED)
    a = index.kmeans(24, weights=weights, seed=2)
    b = index.kmeans(24, weights=weights, seed=2)
    np.testing.assert_array_equal(a.centroid_lat, b.centroid_lat)
    np.testing.assert_array_equal(a.labels, b.labels)
    cpu = create_engine("cpu").build_index(*CLUSTERED).kmeans(24, weights=weights, seed=2)
    assert a.inertia_m2 == pytest.approx(cpu.inertia_m2, rel=1e-6)
    np.testing.assert_array_equal(a.sizes, cpu.sizes)


def test_cuml_kmeans_labels_each_point_with_its_nearest_centroid() -> None:
    engine = _engine("cuml")
    lat, lon = CLUSTERED
    result = engine.build_index(lat, lon).kmeans(10, seed=3)
    assert result.sizes.sum() == lat.shape[0]
    d = great_circle_m(
        lat[:, None], lon[:, None], result.centroid_lat[None, :], result.centroid_lon[None, :]
    )
    ordered = np.sort(d, axis=1)
    clear = ordered[:, 1] - ordered[:, 0] > TIE_M
    np.testing.assert_array_equal(result.labels[clear], np.argmin(d, axis=1)[clear])


# -- what the GPU engine reports -------------------------------------------------------
def test_device_bytes_stay_within_the_budget_per_point(gpu: Engine) -> None:
    from geonear.service.engines.gpu_table import cudf_available

    index = gpu.build_index(*UNIFORM)
    n = UNIFORM[0].shape[0]
    alone = index.device_bytes
    assert 24 <= alone / n <= 56
    index.keep_columns(pa.table({"id": np.arange(n, dtype=np.int64)}))
    # 64 bytes a point with int64 ids, index included (the ids on the device with cuDF)
    assert index.device_bytes - alone == (8 * n if cudf_available() else 0)
    assert index.device_bytes / n <= 64
    used, total = gpu.memory_pool_bytes()
    assert 0 < used <= total
    assert gpu.describe_device().startswith("gpu: ")


def test_warm_up_compiles_every_kernel(gpu: Engine) -> None:
    from geonear.service.engines import gpu as gpu_module

    gpu.warm_up()
    assert gpu_module._module is not None
    for name in gpu_module._NAMES:
        assert gpu_module._kernels().get_function(name) is not None


def test_a_failed_device_allocation_is_device_out_of_memory(gpu: Engine) -> None:
    import cupy

    from geonear.service.engines.gpu_memory import DeviceOutOfMemory, translate_out_of_memory

    expect = pytest.raises(DeviceOutOfMemory, match="GPU memory exhausted")
    with expect as caught, translate_out_of_memory("a test"):
        cupy.empty(2**52, dtype=cupy.uint8)  # 4 PiB: beyond any card
    assert isinstance(caught.value, MemoryError)
    # CuPy's own pool raises OutOfMemoryError; RMM's raises MemoryError (bad_alloc)
    cause = caught.value.__cause__
    assert isinstance(cause, (cupy.cuda.memory.OutOfMemoryError, MemoryError)), repr(cause)
    # the engine goes on serving
    lat, lon = uniform_points(10, seed=1)
    assert gpu.build_index(lat, lon).knn(lat, lon, 1).indices[:, 0].tolist() == list(range(10))


def test_a_later_pool_request_keeps_the_pool_in_use_and_says_so(
    gpu: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # The process's pool was set up with the defaults (conftest's fixture, as a server).
    in_use = gpu_memory.pool_info()
    assert in_use is not None and not in_use.managed
    caplog.set_level(logging.WARNING, logger="geonear.gpu")
    assert gpu_memory.initialise_pool() is in_use  # asks for nothing else: no warning
    assert gpu_memory.initialise_pool(1 << 30) is in_use
    assert gpu_memory.initialise_pool(managed_memory=True) is in_use
    said = [r.getMessage() for r in caplog.records if r.name == "geonear.gpu"]
    assert len(said) == 2, said
    assert in_use.describe() in said[0] and "1073741824 bytes" in said[0]
    assert "managed" in said[1]
    assert gpu_memory.pool_info() is in_use


def test_unit_vectors_on_the_device_equal_the_host_ones() -> None:
    import cupy

    from geonear.service.engines.gpu import unit_vectors_device

    xyz = unit_vectors_device(*UNIFORM)
    np.testing.assert_allclose(cupy.asnumpy(xyz), unit_vectors(*UNIFORM), rtol=0, atol=1e-15)


def test_sort_words_name_every_row_once_and_keep_row_order_within_a_cell() -> None:
    import cupy

    from geonear.service.engines.gpu import _sorted_words

    lat, lon = UNIFORM
    lat = np.concatenate([lat, np.repeat(lat[:3], 5)])  # each of 3 points 6 times
    lon = np.concatenate([lon, np.repeat(lon[:3], 5)])
    words, mask, _ = _sorted_words(cupy.asarray(lat), cupy.asarray(lon))
    rows = cupy.asnumpy(words & mask).astype(np.int64)
    assert sorted(rows.tolist()) == list(range(lat.shape[0]))
    position = np.empty_like(rows)
    position[rows] = np.arange(rows.shape[0])
    n = UNIFORM[0].shape[0]
    for p in range(3):
        copies = position[[p, *range(n + 5 * p, n + 5 * p + 5)]]
        assert copies.tolist() == list(range(copies[0], copies[0] + 6))  # together, by row


@pytest.mark.parametrize("n", [2048, 5000, 70_000])
def test_query_words_come_in_the_order_of_the_leaves_they_fall_in(gpu: Engine, n: int) -> None:
    import cupy

    from geonear.service.engines.gpu import _sorted_words

    index = gpu.build_index(*CLUSTERED)
    rng = np.random.default_rng(n)
    lat, lon = rng.uniform(-90.0, 90.0, n), rng.uniform(-180.0, 180.0, n)
    lat[: n // 4], lon[: n // 4] = CLUSTERED[0][7], CLUSTERED[1][7]  # one leaf: many words
    lat_d, lon_d = cupy.asarray(lat), cupy.asarray(lon)
    exact, mask, level = _sorted_words(lat_d, lon_d, level=index.key_level)
    placed, placed_mask, placed_level = _sorted_words(
        lat_d, lon_d, level=index.key_level, leaf_keys=index.leaf_keys
    )
    assert (placed_mask, placed_level) == (mask, level)
    placed_h = cupy.asnumpy(placed)
    np.testing.assert_array_equal(np.sort(placed_h), cupy.asnumpy(exact))
    keys = placed_h >> np.uint64(int(mask).bit_length())
    firsts = cupy.asnumpy(index.leaf_keys) >> np.uint64(2 * (index.key_level - level))
    leaf = np.maximum(np.searchsorted(firsts, keys, side="right") - 1, 0)
    assert np.all(np.diff(leaf) >= 0)
    assert len(set(leaf[(placed_h & mask) < n // 4].tolist())) == 1


def test_each_rows_position_is_the_inverse_of_the_index_order(gpu: Engine) -> None:
    import cupy

    index = gpu.build_index(*UNIFORM)
    rows = cupy.asnumpy(index.rows)
    np.testing.assert_array_equal(cupy.asnumpy(index.rank)[rows], np.arange(rows.shape[0]))


# -- the device table (cuDF) -----------------------------------------------------------
def _attribute_table(n: int) -> pa.Table:
    rng = np.random.default_rng(5)
    population = pa.array(rng.integers(0, 10**6, n), mask=rng.random(n) < 0.1)
    return pa.table(
        {
            "id": np.arange(10**9, 10**9 + n, dtype=np.int64),
            "name": pa.array([f"place {i}" for i in range(n)]),
            "population": population,
            "elevation_m": rng.normal(200.0, 50.0, n),
            "coastal": rng.random(n) < 0.5,
            "small": rng.integers(-100, 100, n).astype(np.int8),
            "founded": pa.array(rng.integers(0, 2**40, n), type=pa.timestamp("ms")),
            "kind": pa.array(rng.choice(["town", "city", "port"], n)).dictionary_encode(),
        }
    )


def test_device_table_gathers_every_column_as_the_host_table_does() -> None:
    from geonear.service.engines.gpu_table import DeviceTable, cudf_available

    if not cudf_available():
        pytest.skip("cuDF is not installed: datasets keep their columns on the host")
    table = _attribute_table(5000)
    device = DeviceTable.from_arrow(table)
    assert device is not None
    assert device.columns | set(device.host_only) == set(table.column_names)
    assert {"id", "name", "population", "elevation_m", "coastal"} <= device.columns
    assert device.nbytes >= 8 * table.num_rows
    rows = np.random.default_rng(6).integers(0, table.num_rows, 20_000)
    taken = device.take(table.column_names, rows)
    assert set(taken) == device.columns
    for name, column in taken.items():
        expected = table.column(name).take(pa.array(rows))
        assert column.type == expected.type, name
        assert column.equals(expected), name


def test_results_at_least_the_device_threshold_are_gathered_on_the_device(gpu: Engine) -> None:
    from geonear.service.engines.gpu_table import DEVICE_TAKE_FROM, cudf_available

    table = _attribute_table(3000)
    index = gpu.build_index(*uniform_points(3000, seed=8))
    index.keep_columns(table)
    names = ["id", "name", "population"]
    small = np.arange(10)
    large = np.random.default_rng(9).integers(0, 3000, DEVICE_TAKE_FROM)
    assert index.take_columns(names, small) == {}  # the host table is faster there
    assert index.take_columns(["id"], large) == {}  # and for the ids alone
    taken = index.take_columns(names, large)
    assert (set(taken) == set(names)) == cudf_available()
    for name, column in taken.items():
        assert column.equals(table.column(name).take(pa.array(large))), name


def test_columns_cudf_cannot_hold_stay_on_the_host() -> None:
    import datetime
    import decimal

    from geonear.service.engines.gpu_table import DeviceTable, cudf_available

    if not cudf_available():
        pytest.skip("cuDF is not installed: datasets keep their columns on the host")
    n = 1000
    table = pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "when": pa.array(np.arange(n) * 10**9, type=pa.timestamp("ns", tz="Europe/Paris")),
            "price": pa.array([decimal.Decimal(i) / 100 for i in range(n)], pa.decimal128(10, 2)),
            "tags": pa.array([["a", "b"][: i % 3] for i in range(n)]),
            "pair": pa.array([{"x": i, "y": str(i)} for i in range(n)]),
            "nothing": pa.nulls(n),
            "day": pa.array([datetime.date(2020, 1, 1 + i % 28) for i in range(n)]),
            "blob": pa.array([bytes([i % 256]) for i in range(n)]),
            "label": pa.array([f"p{i}" for i in range(n)], type=pa.large_string()),
        }
    )
    device = DeviceTable.from_arrow(table)
    assert device is not None and "id" in device.columns
    assert device.columns | set(device.host_only) == set(table.column_names)
    rows = np.random.default_rng(3).integers(0, n, 5000)
    for name, column in device.take(table.column_names, rows).items():
        assert column.equals(table.column(name).take(pa.array(rows))), name


def _filter_table(n: int) -> pa.Table:
    rng = np.random.default_rng(11)
    nulls = rng.random(n) < 0.05
    score = rng.random(n)
    score[rng.random(n) < 0.02] = np.nan
    return pa.table(
        {
            "id": np.arange(n, dtype=np.int64),
            "lat": rng.uniform(-90, 90, n),
            "lon": rng.uniform(-180, 180, n),
            "small": pa.array(rng.integers(-100, 100, n).astype(np.int8), mask=nulls),
            "count": pa.array(rng.integers(0, 1000, n).astype(np.uint32)),
            "score": pa.array(score, mask=rng.random(n) < 0.05),
            "narrow": pa.array(rng.random(n).astype(np.float32)),
            "kind": pa.array(rng.choice(["a", "b", "ä", "B", ""], n), mask=nulls),
            "flag": pa.array(rng.random(n) < 0.3, mask=rng.random(n) < 0.05),
            "when": pa.array(rng.integers(0, 2**40, n), type=pa.timestamp("ms")),
        }
    )


#: Filters over every device-comparable kind, nulls, NaN and the int constants; the
#: last ones name columns the device does not compare (times): evaluated on the host.
_DEVICE_FILTERS = [
    [("small", "<", 2.5)],
    [("small", "!=", 3)],
    [("small", "not in", [1, 2, 3, 500])],
    [("small", ">", 1000)],
    [("small", "<=", 1e30)],
    [("count", "in", [1, 5, 999])],
    [("count", ">=", 500), ("id", "<", 3000)],
    [("score", "<", 0.25)],
    [("score", "!=", 0.5)],
    [("score", "not in", [0.0, 1.0])],
    [("narrow", "==", float(np.float32(0.5)))],
    [("narrow", ">", 0.1)],
    [("kind", "==", "a")],
    [("kind", "<", "b")],
    [("kind", "not in", ["a", ""])],
    [("flag", "==", True)],
    [("flag", "!=", True)],
    [[("kind", "in", ["B", "ä"]), ("score", ">=", 0.5)], [("flag", "==", False)]],
]
_HOST_FILTERS = [[("when", ">=", "2000-01-01")], [("id", "<", 10), ("when", "<", "1990-01-01")]]


def test_the_device_evaluates_filters_as_the_host_does(gpu: Engine) -> None:
    """Filters on columns the device table holds are evaluated there, row for row as the
    host's pyarrow mask; the others (a column left on the host, a time) are refused to
    the host (None). Integer columns, nulls included, always go to the device."""
    from geonear.service.engines.gpu_table import cudf_available
    from geonear.service.queries.filters import check_filter, parse_filter, row_mask
    from geonear.service.store import DatasetStore
    from geonear.service.validation import normalise_upload

    store = DatasetStore(gpu)
    store.upload("f", "create", normalise_upload(_filter_table(20_000)))
    dataset = store.get("f")
    table = dataset.index.table
    on_device = table.columns if cudf_available() and table is not None else frozenset()
    if cudf_available():
        assert {"id", "small", "count"} <= on_device
    evaluated = 0
    for where in _DEVICE_FILTERS + _HOST_FILTERS:
        parsed = parse_filter(where)
        assert parsed is not None
        checked = check_filter(dataset, parsed)
        expected = np.flatnonzero(row_mask(dataset, checked))
        rows = dataset.index.filter_rows(checked)
        names = {p.column for group in checked for p in group}
        if where in _HOST_FILTERS or not names <= on_device:
            assert rows is None, where
            continue
        assert rows is not None, where
        np.testing.assert_array_equal(rows, expected, err_msg=str(where))
        evaluated += 1
    assert evaluated >= (7 if cudf_available() else 0)
