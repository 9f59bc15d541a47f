"""The Dask engine: a dataset partitioned by space across the workers of a Dask cluster.

Points are ordered by a Morton (Z-order) key of their unit vectors and cut into
partitions of equal size, so each partition covers a compact region of the sphere. Each
partition is written to the partition directory and loaded by a worker, which builds its
own index there (the ``cpu`` engine on CPU workers; ``gpu`` on dask-cuda workers). The
front end keeps, per partition, a spherical cap (centre and angular radius) holding all
its points, which bounds from below the distance from any query to any of its points.

Queries:
- KNN asks each query's nearest partition first, then only the partitions whose lower
  bound does not exceed the k-th distance found so far (pruning), and merges the
  per-partition top-k by (distance, row) into the exact global answer.
- Radius asks the partitions whose cap comes within the radius and unions the answers.
- Distance matrices are tiled over workers by column blocks.
- Spherical k-means runs the shared driver (``spherical_kmeans``): k-means++ on the front
  end, exactly as the single-process engine, and Lloyd steps whose per-partition partial
  sums are combined here.

Faults: when a worker is lost, Dask reloads its partitions from the partition directory
onto the remaining workers (the partition futures depend only on the files); a query
that cannot complete raises :class:`WorkerLost`, which callers see as UNAVAILABLE.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geonear.geometry import (
    EARTH_RADIUS_M,
    angle_between,
    unit_vectors,
)
from geonear.service.engines.base import (
    Engine,
    KMeansResult,
    MatrixDtype,
    Neighbours,
    PointIndex,
    RadiusNeighbours,
    sort_neighbours,
    sort_radius,
)
from geonear.service.engines.spherical_kmeans import (
    ArrayKMeans,
    cluster_sums,
    spherical_kmeans,
)
from geonear.service.errors import ServiceError

#: Slack on pruning bounds, metres: partitions within this of the threshold are asked.
_PRUNE_SLACK_M = 1e-3


class WorkerLost(ServiceError):
    """A Dask worker was lost and the query could not complete; retrying is safe."""

    status = "UNAVAILABLE"


# -- on the workers ---------------------------------------------------------------------
class _Partition:
    """One partition on a worker: its global row numbers and a local index."""

    def __init__(self, path: str, engine_name: str, earth_radius_m: float) -> None:
        from geonear.service.engines import create_engine

        with np.load(path) as data:
            self.rows = data["rows"]
            self.lat = data["lat"]
            self.lon = data["lon"]
        self.index = create_engine(engine_name, earth_radius_m).build_index(self.lat, self.lon)


def _load_partition(path: str, engine_name: str, earth_radius_m: float) -> _Partition:
    return _Partition(path, engine_name, earth_radius_m)


def _partition_points(part: _Partition) -> int:
    return int(part.rows.shape[0])


def _partition_knn(
    part: _Partition, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None
) -> tuple[np.ndarray, np.ndarray]:
    found = part.index.knn(lat, lon, k, max_distance_m)
    rows = np.where(found.indices >= 0, part.rows[np.maximum(found.indices, 0)], -1)
    return found.distances_m, rows


def _partition_radius(
    part: _Partition, lat: np.ndarray, lon: np.ndarray, radius_m: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    found = part.index.radius(lat, lon, radius_m)
    return found.query_index, part.rows[found.indices], found.distances_m


def _partition_radius_count(
    part: _Partition, lat: np.ndarray, lon: np.ndarray, radius_m: float
) -> np.ndarray:
    return part.index.radius_count(lat, lon, radius_m)


def _partition_lloyd_step(
    part: _Partition, centroids: np.ndarray, weights: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """(weighted sums of member unit vectors (k, 3), members per cluster (k,))."""
    xyz = unit_vectors(part.lat, part.lon)
    labels = np.argmax(xyz @ centroids.T, axis=1)
    k = centroids.shape[0]
    w = None if weights is None else weights[part.rows]
    return cluster_sums(xyz, labels, w, k, np), np.bincount(labels, minlength=k)


def _partition_labels(
    part: _Partition, centroids: np.ndarray, weights: np.ndarray | None, earth_radius_m: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """(global rows, labels, inertia m^2) of the partition's points."""
    xyz = unit_vectors(part.lat, part.lon)
    labels = np.argmax(xyz @ centroids.T, axis=1).astype(np.int32)
    sq = (earth_radius_m * angle_between(xyz, centroids[labels])) ** 2
    if weights is not None:
        sq = sq * weights[part.rows]
    return part.rows, labels, float(sq.sum())


def _matrix_block(
    lat1: np.ndarray,
    lon1: np.ndarray,
    lat2: np.ndarray,
    lon2: np.ndarray,
    dtype: MatrixDtype,
    earth_radius_m: float,
) -> np.ndarray:
    from geonear.service.engines.cpu import CPUEngine

    return CPUEngine(earth_radius_m).distance_matrix(lat1, lon1, lat2, lon2, dtype)


# -- on the front end -------------------------------------------------------------------
def morton_keys(xyz: np.ndarray, bits: int = 21) -> np.ndarray:
    """Z-order keys (uint64) of unit vectors: ``bits`` bits per axis, interleaved."""
    cells = ((xyz + 1.0) * (0.5 * ((1 << bits) - 1))).astype(np.uint64)
    keys = np.zeros(xyz.shape[0], dtype=np.uint64)
    for bit in range(bits):
        for axis in range(3):
            keys |= ((cells[:, axis] >> np.uint64(bit)) & np.uint64(1)) << np.uint64(3 * bit + axis)
    return keys


@dataclass(frozen=True)
class PartitionCap:
    """A spherical cap holding every point of one partition."""

    centre: np.ndarray  # unit vector (3,)
    radius_rad: float
    n_points: int


def _cap(xyz: np.ndarray) -> PartitionCap:
    mean = xyz.sum(axis=0)
    norm = float(np.linalg.norm(mean))
    centre = mean / norm if norm > 1e-12 else np.array([0.0, 0.0, 1.0])
    radius = float(angle_between(xyz, centre[None, :]).max())
    return PartitionCap(centre=centre, radius_rad=radius, n_points=int(xyz.shape[0]))


class DaskIndex(PointIndex):
    """A dataset's partitions, each loaded and indexed by a Dask worker."""

    def __init__(self, engine: DaskEngine, lat: np.ndarray, lon: np.ndarray) -> None:
        self.engine = engine
        self.client = engine.client
        self.earth_radius_m = engine.earth_radius_m
        self.lat, self.lon = lat, lon
        self.n_points = int(lat.shape[0])
        self.directory = Path(tempfile.mkdtemp(prefix="part-", dir=engine.partition_dir))
        xyz = unit_vectors(lat, lon)
        order = np.argsort(morton_keys(xyz), kind="stable")
        n_parts = max(1, min(engine.n_partitions(), self.n_points))
        self.caps: list[PartitionCap] = []
        paths = []
        for i, rows in enumerate(np.array_split(order, n_parts)):
            rows = np.sort(rows)  # row order inside a partition keeps ties by row
            path = self.directory / f"part-{i:05d}.npz"
            np.savez(path, rows=rows.astype(np.int64), lat=lat[rows], lon=lon[rows])
            paths.append(str(path))
            self.caps.append(_cap(xyz[rows]))
        self._write_partition_map(paths)
        self.partitions = [
            self.client.submit(
                _load_partition, p, engine.worker_engine, self.earth_radius_m, pure=False
            )
            for p in paths
        ]
        # Built before the version is acknowledged. The partitions stay on their workers:
        # gathering them would pickle each index to this process (a GPU index cannot be).
        self._gather([self.client.submit(_partition_points, p) for p in self.partitions])
        self.last_partitions_searched = 0
        weakref.finalize(self, shutil.rmtree, str(self.directory), True)

    def _write_partition_map(self, paths: list[str]) -> None:
        body = {
            "engine": self.engine.worker_engine,
            "partitions": [
                {
                    "file": Path(p).name,
                    "rows": c.n_points,
                    "centre": c.centre.tolist(),
                    "radius_rad": c.radius_rad,
                }
                for p, c in zip(paths, self.caps, strict=True)
            ],
        }
        (self.directory / "partitions.json").write_text(json.dumps(body, indent=1))

    @property
    def host_bytes(self) -> int:
        return 0  # the points live on the workers; the front end holds only the caps

    def _gather(self, futures: Any) -> Any:
        try:
            return self.client.gather(futures)
        except Exception as exc:  # distributed raises many types for a lost worker
            raise WorkerLost(
                f"a Dask worker was lost during the query ({type(exc).__name__}: {exc}); "
                "its partitions are being reloaded onto the remaining workers; retry the call"
            ) from exc

    def _lower_bounds_m(self, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
        """(n_queries, n_partitions) lower bounds on the distance to any partition point."""
        q = unit_vectors(lat, lon)
        centres = np.stack([c.centre for c in self.caps])
        radii = np.array([c.radius_rad for c in self.caps])
        angle = angle_between(q[:, None, :], centres[None, :, :])
        return np.maximum(angle - radii[None, :], 0.0) * self.earth_radius_m

    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        n_q, kk, n_parts = lat.shape[0], min(k, self.n_points), len(self.caps)
        dist = np.full((n_q, kk * n_parts), np.inf)
        rows = np.full((n_q, kk * n_parts), -1, dtype=np.int64)
        if n_q == 0 or kk == 0:
            return Neighbours(dist[:, :kk], rows[:, :kk])
        bounds = self._lower_bounds_m(lat, lon)
        asked = np.zeros((n_q, n_parts), dtype=bool)
        asked[np.arange(n_q), np.argmin(bounds, axis=1)] = True
        self._ask_knn(lat, lon, kk, max_distance_m, asked, dist, rows)
        d, _ = sort_neighbours(dist, rows)
        threshold = d[:, kk - 1]
        if max_distance_m is not None:
            threshold = np.minimum(threshold, max_distance_m)
        more = (bounds <= threshold[:, None] + _PRUNE_SLACK_M) & ~asked
        self._ask_knn(lat, lon, kk, max_distance_m, more, dist, rows)
        self.last_partitions_searched = int(asked.sum() + more.sum())
        d, i = sort_neighbours(dist, rows)
        return Neighbours(distances_m=d[:, :kk], indices=i[:, :kk])

    def _ask_knn(
        self,
        lat: np.ndarray,
        lon: np.ndarray,
        kk: int,
        max_distance_m: float | None,
        ask: np.ndarray,
        dist: np.ndarray,
        rows: np.ndarray,
    ) -> None:
        """Query partition p for the queries where ``ask[:, p]``, into column block p."""
        jobs = []
        for p in range(ask.shape[1]):
            queries = np.flatnonzero(ask[:, p])
            if queries.size:
                future = self.client.submit(
                    _partition_knn,
                    self.partitions[p],
                    lat[queries],
                    lon[queries],
                    kk,
                    max_distance_m,
                    pure=False,
                )
                jobs.append((p, queries, future))
        for (p, queries, _), (d, r) in zip(jobs, self._gather([j[2] for j in jobs]), strict=True):
            width = d.shape[1]
            dist[queries, p * kk : p * kk + width] = d
            rows[queries, p * kk : p * kk + width] = r

    def radius_count(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> np.ndarray:
        """The partitions' own counts, summed: each point lies in one partition."""
        n_q = lat.shape[0]
        counts = np.zeros(n_q, dtype=np.int64)
        if n_q == 0:
            return counts
        ask = self._lower_bounds_m(lat, lon) <= radius_m + _PRUNE_SLACK_M
        jobs = []
        for p in range(ask.shape[1]):
            queries = np.flatnonzero(ask[:, p])
            if queries.size:
                future = self.client.submit(
                    _partition_radius_count,
                    self.partitions[p],
                    lat[queries],
                    lon[queries],
                    radius_m,
                    pure=False,
                )
                jobs.append((queries, future))
        for (queries, _), found in zip(jobs, self._gather([f for _, f in jobs]), strict=True):
            counts[queries] += found
        return counts

    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        n_q = lat.shape[0]
        if n_q == 0:
            empty = np.empty(0, dtype=np.int64)
            return sort_radius(empty, empty, np.empty(0), 0)
        ask = self._lower_bounds_m(lat, lon) <= radius_m + _PRUNE_SLACK_M
        jobs = []
        for p in range(ask.shape[1]):
            queries = np.flatnonzero(ask[:, p])
            if queries.size:
                jobs.append(
                    (
                        queries,
                        self.client.submit(
                            _partition_radius,
                            self.partitions[p],
                            lat[queries],
                            lon[queries],
                            radius_m,
                            pure=False,
                        ),
                    )
                )
        self.last_partitions_searched = len(jobs)
        parts = self._gather([f for _, f in jobs])
        q_index = [queries[qi] for (queries, _), (qi, _, _) in zip(jobs, parts, strict=True)]
        found_rows = [r for _, r, _ in parts]
        found_dist = [d for _, _, d in parts]
        if not q_index:
            empty = np.empty(0, dtype=np.int64)
            return sort_radius(empty, empty, np.empty(0), n_q)
        return sort_radius(
            np.concatenate(q_index), np.concatenate(found_rows), np.concatenate(found_dist), n_q
        )

    def kmeans(
        self,
        k: int,
        *,
        weights: np.ndarray | None = None,
        seed: int = 0,
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-6,
    ) -> KMeansResult:
        """Spherical k-means by the shared driver (``spherical_kmeans``), its Lloyd steps
        summed over the partitions."""
        backend = _DaskKMeans(self, weights)
        return spherical_kmeans(backend, k, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol)


class _DaskKMeans(ArrayKMeans):
    """k-means hooks of a partitioned dataset: k-means++ on the front end's unit vectors;
    each Lloyd step and the final labels computed by the partitions and combined here."""

    def __init__(self, index: DaskIndex, weights: np.ndarray | None) -> None:
        super().__init__(unit_vectors(index.lat, index.lon), weights, index.earth_radius_m, np)
        self.index = index
        client = index.client
        # hash=False: a key of this run's own. Scattered by content, equal weights of two
        # runs shared one key, which the first run's release could drop under the second.
        self._weights_future = (
            None
            if self.weights is None
            else client.scatter(self.weights, broadcast=True, hash=False)
        )

    def _each_partition(self, function: Any, *args: Any) -> list[Any]:
        index = self.index
        return list(
            index._gather(
                [
                    index.client.submit(function, part, *args, pure=False)
                    for part in index.partitions
                ]
            )
        )

    def cluster_sums(self, centroids: np.ndarray) -> np.ndarray:
        partial = self._each_partition(_partition_lloyd_step, centroids, self._weights_future)
        return np.sum([sums for sums, _ in partial], axis=0)

    def labels_and_inertia(self, centroids: np.ndarray) -> tuple[np.ndarray, float]:
        labelled = self._each_partition(
            _partition_labels, centroids, self._weights_future, self.earth_radius_m
        )
        labels = np.empty(self.n_points, dtype=np.int32)
        for rows, part_labels, _ in labelled:
            labels[rows] = part_labels
        return labels, float(sum(inertia for _, _, inertia in labelled))


class DaskEngine(Engine):
    """Datasets partitioned over a Dask cluster: an existing one or a local one.

    Parameters
    ----------
    scheduler : str, optional
        Address of an existing scheduler (``tcp://host:8786``). Its workers need geonear
        installed and must see ``partition_dir`` (a shared filesystem).
    local_workers : int
        Without a scheduler, start a local cluster of this many worker processes (one
        per GPU with dask-cuda when ``worker_engine`` is ``gpu``).
    partition_dir : path, optional
        Where partitions are written for the workers to load (a temporary directory by
        default).
    worker_engine : str
        Engine each worker indexes its partitions with (``cpu`` or ``gpu``).
    partitions_per_worker : int
        More partitions than workers balance load and make pruning finer.
    """

    name = "dask"

    def __init__(
        self,
        earth_radius_m: float = EARTH_RADIUS_M,
        *,
        scheduler: str | None = None,
        local_workers: int = 2,
        partition_dir: Path | str | None = None,
        worker_engine: str = "cpu",
        partitions_per_worker: int = 2,
    ) -> None:
        super().__init__(earth_radius_m)
        try:
            from distributed import Client, LocalCluster
        except ImportError as exc:
            from geonear.service.engines import EngineUnavailable

            raise EngineUnavailable(
                "the dask engine needs dask.distributed: pip install 'geonear[dask]'"
            ) from exc
        self.worker_engine = worker_engine
        self.partitions_per_worker = partitions_per_worker
        self._tmp = None
        if partition_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="geonear-partitions-")
            partition_dir = self._tmp.name
        self.partition_dir = Path(partition_dir)
        self.partition_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = None
        if scheduler is not None:
            self.client = Client(scheduler, set_as_default=False)
        else:
            if worker_engine == "gpu":
                from dask_cuda import LocalCUDACluster

                self.cluster = LocalCUDACluster(n_workers=local_workers, dashboard_address=None)
            else:
                self.cluster = LocalCluster(
                    n_workers=local_workers,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=None,
                )
            self.client = Client(self.cluster, set_as_default=False)

    def n_workers(self) -> int:
        return max(1, len(self.client.scheduler_info()["workers"]))

    def n_partitions(self) -> int:
        return self.n_workers() * self.partitions_per_worker

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> DaskIndex:
        return DaskIndex(self, lat, lon)

    def distance_matrix(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> np.ndarray:
        blocks = np.array_split(np.arange(lat2.shape[0]), self.n_workers())
        futures = [
            self.client.submit(
                _matrix_block, lat1, lon1, lat2[b], lon2[b], dtype, self.earth_radius_m, pure=False
            )
            for b in blocks
            if b.size
        ]
        if not futures:
            return np.empty((lat1.shape[0], 0), dtype=dtype)
        try:
            parts = self.client.gather(futures)
        except Exception as exc:
            raise WorkerLost(f"a Dask worker was lost during the matrix ({exc}); retry") from exc
        return np.hstack(parts)

    def describe_device(self) -> str:
        return f"dask: {self.n_workers()} workers ({self.worker_engine})"

    def close(self) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        if self._tmp is not None:
            self._tmp.cleanup()


class DaskGPUEngine(DaskEngine):
    """:class:`DaskEngine` on dask-cuda workers, one per GPU, each indexing with ``gpu``.

    Without a scheduler, a ``LocalCUDACluster`` starts one worker per visible GPU
    (``local_workers`` of them, all GPUs by default); the other options are
    :class:`DaskEngine`'s.
    """

    name = "dask-gpu"

    def __init__(
        self,
        earth_radius_m: float = EARTH_RADIUS_M,
        *,
        local_workers: int | None = None,
        **options: Any,
    ) -> None:
        if local_workers is None:
            import cupy

            local_workers = int(cupy.cuda.runtime.getDeviceCount())
        super().__init__(
            earth_radius_m, local_workers=local_workers, worker_engine="gpu", **options
        )
