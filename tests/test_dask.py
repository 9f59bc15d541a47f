"""The Dask engine on a local cluster of 2 CPU worker processes.

Results must be identical to the single-process CPU engine on every query kind;
partition pruning must skip partitions; a worker killed during a query must give either
the right answer or WorkerLost (UNAVAILABLE), and the dataset must be served again.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("distributed")

from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import create_engine
from geonear.service.engines.dask_cluster import DaskEngine, WorkerLost


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    eng = DaskEngine(local_workers=2, partition_dir=tmp_path_factory.mktemp("partitions"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def points() -> tuple[np.ndarray, np.ndarray]:
    lat, lon = clustered_points(20_000, seed=11)
    # Edge cases ride along: poles, the antimeridian and duplicates.
    extra_lat = np.array([90.0, -90.0, 0.0, 0.0, 10.0, 10.0])
    extra_lon = np.array([0.0, 0.0, 180.0, -180.0, 20.0, 20.0])
    return np.concatenate([lat, extra_lat]), np.concatenate([lon, extra_lon])


@pytest.fixture(scope="module")
def both(engine: DaskEngine, points):
    lat, lon = points
    return engine.build_index(lat, lon), create_engine("cpu").build_index(lat, lon)


def queries(n: int = 1500) -> tuple[np.ndarray, np.ndarray]:
    lat, lon = uniform_points(n, seed=4)
    return np.concatenate([lat, [90.0, 0.0, 10.0]]), np.concatenate([lon, [0.0, 180.0, 20.0]])


def test_partitions_cover_the_dataset_once(both) -> None:
    dask_index, _ = both
    assert len(dask_index.caps) == 4  # 2 workers x 2 partitions each
    assert sum(c.n_points for c in dask_index.caps) == dask_index.n_points
    assert (dask_index.directory / "partitions.json").exists()


def test_partitions_stay_on_their_workers(engine: DaskEngine, points, monkeypatch) -> None:
    """Building waits for the partitions without bringing them here: an index is
    pickled to travel, and a GPU index cannot be (dask-gpu could not build)."""
    from geonear.service.engines import dask_cluster

    gathered: list[object] = []
    real_gather = engine.client.gather

    def watched(futures, *args, **kwargs):
        out = real_gather(futures, *args, **kwargs)
        gathered.extend(out if isinstance(out, list) else [out])
        return out

    monkeypatch.setattr(engine.client, "gather", watched)
    lat, lon = points
    index = engine.build_index(lat[:3000], lon[:3000])
    index.knn(*queries(50), 3)
    assert gathered, "the build waits for its partitions through the client"
    assert not any(isinstance(x, dask_cluster._Partition) for x in gathered)


@pytest.mark.parametrize("k", [1, 10, 50])
def test_knn_identical_to_single_process(both, k: int) -> None:
    dask_index, cpu_index = both
    lat, lon = queries()
    got, want = dask_index.knn(lat, lon, k), cpu_index.knn(lat, lon, k)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.distances_m, want.distances_m)


def test_knn_prunes_partitions(both) -> None:
    dask_index, _ = both
    lat, lon = queries()
    dask_index.knn(lat, lon, 5)
    assert 0 < dask_index.last_partitions_searched < lat.shape[0] * len(dask_index.caps)


def test_knn_with_max_distance_identical(both) -> None:
    dask_index, cpu_index = both
    lat, lon = queries()
    got = dask_index.knn(lat, lon, 20, max_distance_m=300_000)
    want = cpu_index.knn(lat, lon, 20, max_distance_m=300_000)
    np.testing.assert_array_equal(got.indices, want.indices)


def test_radius_identical_and_pruned(both, points) -> None:
    dask_index, cpu_index = both
    lat, lon = points
    q_lat, q_lon = lat[:300] + 0.01, lon[:300]
    got, want = dask_index.radius(q_lat, q_lon, 25_000), cpu_index.radius(q_lat, q_lon, 25_000)
    np.testing.assert_array_equal(got.offsets, want.offsets)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_allclose(got.distances_m, want.distances_m, rtol=0, atol=1e-3)
    assert dask_index.last_partitions_searched < len(dask_index.caps) * 300


def test_kmeans_identical(both) -> None:
    dask_index, cpu_index = both
    got, want = dask_index.kmeans(6, seed=3, max_iter=25), cpu_index.kmeans(6, seed=3, max_iter=25)
    np.testing.assert_array_equal(got.labels, want.labels)
    assert got.n_iter == want.n_iter
    assert got.inertia_m2 == pytest.approx(want.inertia_m2, rel=1e-9)
    np.testing.assert_allclose(got.centroid_lat, want.centroid_lat, atol=1e-9)


def test_distance_matrix_identical(engine: DaskEngine, points) -> None:
    lat, lon = points
    q_lat, q_lon = queries(50)
    got = engine.distance_matrix(q_lat, q_lon, lat[:3000], lon[:3000])
    want = create_engine("cpu").distance_matrix(q_lat, q_lon, lat[:3000], lon[:3000])
    np.testing.assert_array_equal(got, want)


def test_killed_worker_then_served_again(engine: DaskEngine, points) -> None:
    lat, lon = points
    index = engine.build_index(lat, lon)
    cpu_index = create_engine("cpu").build_index(lat, lon)
    q_lat, q_lon = queries(20_000)
    want = cpu_index.knn(q_lat, q_lon, 10)
    pids = engine.client.run(os.getpid)
    victim = sorted(pids)[0]
    outcome: dict[str, object] = {}

    def query() -> None:
        try:
            outcome["result"] = index.knn(q_lat, q_lon, 10)
        except WorkerLost as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=query)
    thread.start()
    os.kill(pids[victim], signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    if "error" in outcome:
        assert outcome["error"].status == "UNAVAILABLE"
        assert "retry" in str(outcome["error"])
    else:
        np.testing.assert_array_equal(outcome["result"].indices, want.indices)
    # Partitions are reloaded from their files onto the remaining (or restarted) workers.
    again = index.knn(q_lat, q_lon, 10)
    np.testing.assert_array_equal(again.indices, want.indices)


def test_server_on_a_local_dask_cluster_answers_like_the_cpu_server(tmp_path) -> None:
    from geonear.clients.client import Client
    from geonear.service.server import build_server
    from geonear.service.settings import ServerSettings

    lat, lon = clustered_points(5_000, seed=21)
    table = pa.table({"id": np.arange(lat.shape[0]), "lat": lat, "lon": lon})
    q_lat, q_lon = queries(200)
    answers = {}
    for name, extra in (("dask", {"dask_local_workers": 2}), ("cpu", {"backend": "cpu"})):
        settings = ServerSettings(host="127.0.0.1", port=0, data_dir=tmp_path / name, **extra)
        parts = build_server(settings)
        parts.server.start()
        try:
            with Client(f"127.0.0.1:{parts.port}", timeout_s=120) as client:
                client.upload("pts", table)
                assert client.info("pts").engine == name
                answers[name] = (
                    client.knn("pts", q_lat, q_lon, k=7),
                    client.radius("pts", q_lat[:20], q_lon[:20], 200_000),
                    client.kmeans("pts", 4, seed=1).inertia_m2,
                )
        finally:
            parts.stop(None)
    assert (tmp_path / "dask" / "_partitions").is_dir()
    for got, want in zip(answers["dask"][:2], answers["cpu"][:2], strict=True):
        assert got.equals(want)
    assert answers["dask"][2] == pytest.approx(answers["cpu"][2], rel=1e-9)
