"""Comparison engines on the GPU: cuML's nearest neighbours and k-means, and naive CuPy.

Neither is the product's GPU engine (``gpu``); ``geonear bench`` runs them beside it to
show what a library call or the obvious CuPy code gives on the same card.

| name           | KNN                                | radius | matrix       | k-means            |
|----------------|------------------------------------|--------|--------------|--------------------|
| cuml           | NearestNeighbors(brute, haversine) | no     | no           | cuml.KMeans, unit  |
|                | + exact float64 re-rank on host    |        |              | vectors, Euclidean |
| cupy-broadcast | broadcast float64 distances +      | yes    | broadcasting | shared driver:     |
|                | argpartition, blocks of queries    |        | (unfused)    | GEMM, argmax,      |
|                |                                    |        |              | one-hot GEMM       |

What an engine cannot do raises NotImplementedError with the reason.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from geonear.geometry import (
    EARTH_RADIUS_M,
    angle_between,
    unit_vectors,
)
from geonear.service.engines import EngineUnavailable, gpu_memory
from geonear.service.engines.base import (
    KMeansResult,
    MatrixDtype,
    Neighbours,
    RadiusNeighbours,
    sort_neighbours,
    sort_radius,
)
from geonear.service.engines.host import HostEngine, HostIndex
from geonear.service.engines.spherical_kmeans import ArrayKMeans, spherical_kmeans

#: Bound on one block of (query, point) distances held on the device, elements.
_BLOCK_ELEMENTS = 1 << 26


def _cuml() -> Any:
    try:
        import cuml
    except ImportError as exc:
        raise EngineUnavailable(
            f"engine 'cuml' needs cuML: {exc} (pip install 'geonear[gpu]')"
        ) from exc
    return cuml


# -- cuML ------------------------------------------------------------------------------
class CumlIndex(HostIndex):
    """cuML NearestNeighbors(algorithm="brute", metric="haversine") over a dataset.

    Limits of cuML's haversine search, and what this index does about them:

    - input is (latitude, longitude) in radians, in that order; output distances are
      central angles in radians by the haversine formula, which loses precision near
      antipodes;
    - brute force: every query is compared with every point (O(queries x points));
    - ties come back in no defined order and some k of equally distant points;
    - no radius query for the haversine metric.

    KNN therefore asks cuML for more candidates than k, measures them again in float64
    on the host and re-ranks by (distance, row); rows whose candidates might miss a true
    neighbour (the last candidate not clearly beyond the k-th, by ``_MARGIN_M``) are
    asked again with twice as many, up to the whole set, so answers equal the reference.
    """

    #: Error allowed to cuML's distances, metres, plus a relative part.
    _MARGIN_M = 5.0
    _MARGIN_REL = 1e-6

    def __init__(self, lat: np.ndarray, lon: np.ndarray, earth_radius_m: float) -> None:
        super().__init__(lat, lon, earth_radius_m)
        cuml = _cuml()
        self._model = cuml.neighbors.NearestNeighbors(
            algorithm="brute", metric="haversine", output_type="cupy"
        )
        if self.n_points:
            self._model.fit(self._radians(self.lat, self.lon))

    @staticmethod
    def _radians(lat: np.ndarray, lon: np.ndarray) -> cp.ndarray:
        return cp.radians(cp.asarray(np.column_stack([lat, lon]), dtype=cp.float64))

    @gpu_memory.out_of_memory_guard("a cuML KNN query")
    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        n_q, kk = lat.shape[0], min(k, self.n_points)
        dist = np.full((n_q, kk), np.inf)
        idx = np.full((n_q, kk), -1, dtype=np.int64)
        if kk == 0 or n_q == 0:
            return Neighbours(dist, idx)
        todo = np.arange(n_q)
        n_candidates = min(self.n_points, 2 * kk + 8)
        while todo.size:
            angle, rows = self._model.kneighbors(
                self._radians(lat[todo], lon[todo]), n_neighbors=n_candidates
            )
            rows = cp.asnumpy(rows).astype(np.int64)
            approx_m = cp.asnumpy(angle)[:, -1] * self.earth_radius_m
            found = self.exact_neighbours(lat[todo], lon[todo], rows, max_distance_m)
            need = found.distances_m[:, kk - 1]
            if max_distance_m is not None:
                need = np.minimum(need, max_distance_m)
            margin = self._MARGIN_M + self._MARGIN_REL * approx_m
            complete = (n_candidates >= self.n_points) | (approx_m - margin > need)
            done = todo[complete]
            dist[done] = found.distances_m[complete, :kk]
            idx[done] = found.indices[complete, :kk]
            todo = todo[~complete]
            n_candidates = min(self.n_points, 2 * n_candidates)
        return Neighbours(dist, idx)

    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        raise NotImplementedError(
            "cuML's NearestNeighbors has no radius query for the haversine metric; "
            "use the 'gpu' engine"
        )

    @gpu_memory.out_of_memory_guard("cuML k-means")
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
        """cuML KMeans on the 3-D unit vectors, run by the shared driver (see _CumlKMeans).

        Limits: cuML's k-means is Euclidean, so its centres are plain means inside the
        sphere and its stopping rule (``tol``) is its own; the centres are normalised
        onto the sphere afterwards and every point is assigned to the nearest one by
        great-circle distance, which gives the labels, sizes and inertia reported. The
        result is close to, not the same as, spherical k-means. A cancelled call stops
        between initialisations, not within one (see _CumlKMeans.iterate).
        """
        backend = _CumlKMeans(cp.asarray(self.xyz), weights, self.earth_radius_m, _cuml())
        return spherical_kmeans(backend, k, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol)


class _CumlKMeans(ArrayKMeans):
    """The shared k-means++ seeding, best-of and labels, with cuML's KMeans as the
    Lloyd run of each initialisation."""

    def __init__(self, xyz: cp.ndarray, weights: Any, earth_radius_m: float, cuml: Any) -> None:
        super().__init__(xyz, weights, earth_radius_m, cp)
        self._cuml = cuml

    def iterate(
        self, centroids: cp.ndarray, *, max_iter: int, tol: float, should_stop: Any = None
    ) -> tuple[cp.ndarray, int]:
        """One ``cuml.KMeans.fit`` from ``centroids``: (normalised centres, its n_iter_).

        cuML runs all its iterations inside ``fit``, in compiled code that takes no
        callback, so a stop cannot reach it there: the driver checks for one before each
        initialisation (and every 16 k-means++ draws), and a cancelled call ends when
        the ``fit`` under way returns.
        """
        model = self._cuml.KMeans(
            n_clusters=int(centroids.shape[0]),
            init=centroids,
            n_init=1,
            max_iter=max_iter,
            # cuML refuses tol <= 0; the smallest positive tol stops only at max_iter too.
            tol=tol if tol > 0 else float(np.finfo(np.float64).tiny),
            output_type="cupy",
        )
        model.fit(self.xyz, sample_weight=self.weights)
        centres = cp.asarray(model.cluster_centers_, dtype=cp.float64)
        norms = cp.linalg.norm(centres, axis=1)
        centres = cp.where(
            norms[:, None] > 0, centres / cp.where(norms > 0, norms, 1)[:, None], centroids
        )
        return centres, int(getattr(model, "n_iter_", max_iter))


class CumlEngine(HostEngine):
    """cuML NearestNeighbors(brute, haversine) and KMeans, for comparison (see CumlIndex)."""

    name = "cuml"

    def __init__(self, earth_radius_m: float = EARTH_RADIUS_M) -> None:
        super().__init__(earth_radius_m)
        _cuml()
        self.pool = gpu_memory.initialise_pool()

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> CumlIndex:
        return CumlIndex(lat, lon, self.earth_radius_m)

    def distance_matrix(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> np.ndarray:
        raise NotImplementedError(
            "cuML gives haversine angles only through NearestNeighbors, not as a "
            "great-circle matrix in metres exact to 1 mm; use the 'gpu' engine"
        )

    def memory_pool_bytes(self) -> tuple[int, int]:
        return gpu_memory.pool_bytes()

    def describe_device(self) -> str:
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return f"gpu: {name} (cuML); {self.pool.describe()}"


# -- naive CuPy ------------------------------------------------------------------------
class BroadcastIndex(HostIndex):
    """Brute force with CuPy broadcasting: the GPU baseline without an index.

    Distances of a block of queries to every point are float64 great-circle metres by
    plain broadcasting (several kernels, a full matrix in memory), then
    ``cupy.argpartition`` picks k + 1 candidates per query, sorted exactly on the host;
    a query whose k-th and (k + 1)-th distances are equal is redone with a stable full
    sort so ties go by row. O(queries x points) time.
    """

    def __init__(self, lat: np.ndarray, lon: np.ndarray, earth_radius_m: float) -> None:
        super().__init__(lat, lon, earth_radius_m)
        self.xyz_device = cp.asarray(self.xyz)

    @property
    def device_bytes(self) -> int:
        return int(self.xyz_device.nbytes)

    def _block_distances(self, q_xyz: cp.ndarray) -> cp.ndarray:
        angle = angle_between(q_xyz[:, None, :], self.xyz_device[None, :, :], xp=cp)
        return self.earth_radius_m * angle

    def _steps(self, n_q: int) -> range:
        return range(0, n_q, max(1, _BLOCK_ELEMENTS // max(1, 4 * self.n_points)))

    @gpu_memory.out_of_memory_guard("a brute-force KNN query")
    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        n_q, kk = lat.shape[0], min(k, self.n_points)
        dist = np.full((n_q, kk), np.inf)
        idx = np.full((n_q, kk), -1, dtype=np.int64)
        if kk == 0 or n_q == 0:
            return Neighbours(dist, idx)
        q_xyz = cp.asarray(_unit(lat, lon))
        width = min(kk + 1, self.n_points)
        steps = self._steps(n_q)
        for start in steps:
            stop = min(n_q, start + steps.step)
            d = self._block_distances(q_xyz[start:stop])
            if width < self.n_points:
                part = cp.argpartition(d, width - 1, axis=1)[:, :width]
            else:
                part = cp.broadcast_to(cp.arange(width), (stop - start, width))
            cand_d = cp.asnumpy(cp.take_along_axis(d, part, axis=1))
            cand_i = cp.asnumpy(part).astype(np.int64)
            cand_d, cand_i = sort_neighbours(cand_d, cand_i)
            if width > kk:
                # equal k-th and (k+1)-th: argpartition chose among ties arbitrarily
                tied = np.flatnonzero(cand_d[:, kk] == cand_d[:, kk - 1])
                if tied.size:
                    order = cp.argsort(d[cp.asarray(tied)], axis=1)[:, :kk]  # stable
                    rows = cp.asnumpy(order).astype(np.int64)
                    cand_i[tied, :kk] = rows
                    cand_d[tied, :kk] = np.take_along_axis(
                        cp.asnumpy(d[cp.asarray(tied)]), rows, axis=1
                    )
            block_d, block_i = cand_d[:, :kk], cand_i[:, :kk]
            if max_distance_m is not None:
                far = block_d > max_distance_m
                block_d[far], block_i[far] = np.inf, -1
            dist[start:stop], idx[start:stop] = block_d, block_i
        return Neighbours(dist, idx)

    @gpu_memory.out_of_memory_guard("a brute-force radius query")
    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        n_q = lat.shape[0]
        q_xyz = cp.asarray(_unit(lat, lon))
        qs, rows, dists = [np.empty(0, np.int64)], [np.empty(0, np.int64)], [np.empty(0)]
        steps = self._steps(n_q)
        for start in steps:
            d = self._block_distances(q_xyz[start : start + steps.step])
            q, r = cp.nonzero(d <= radius_m)
            qs.append(cp.asnumpy(q) + start)
            rows.append(cp.asnumpy(r))
            dists.append(cp.asnumpy(d[q, r]))
        return sort_radius(np.concatenate(qs), np.concatenate(rows), np.concatenate(dists), n_q)

    @gpu_memory.out_of_memory_guard("k-means")
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
        """Spherical k-means the obvious CuPy way: GEMM, argmax, one-hot GEMM.

        The shared driver (``spherical_kmeans``) over CuPy arrays; the cluster sums are a
        GEMM of one-hot labels (deterministic, unlike ``bincount``'s atomics, so the same
        seed gives the same result).
        """
        backend = _OneHotKMeans(self.xyz_device, weights, self.earth_radius_m, cp)
        return spherical_kmeans(backend, k, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol)


class _OneHotKMeans(ArrayKMeans):
    """CuPy array hooks whose cluster sums are one-hot GEMMs, in blocks of points."""

    def __init__(self, xyz: cp.ndarray, weights: Any, earth_radius_m: float, xp: Any) -> None:
        super().__init__(xyz, weights, earth_radius_m, xp)
        self._wxyz = xyz if self.weights is None else xyz * self.weights[:, None]

    def accumulate(self, labels: cp.ndarray, k: int) -> cp.ndarray:
        wxyz = self._wxyz
        sums = cp.zeros((k, 3), dtype=cp.float64)
        step = max(1, _BLOCK_ELEMENTS // max(1, 4 * k))
        clusters = cp.arange(k, dtype=cp.int32)
        for start in range(0, wxyz.shape[0], step):
            one_hot = (labels[start : start + step, None] == clusters[None, :]).astype(cp.float64)
            sums += one_hot.T @ wxyz[start : start + step]
        return sums


def _unit(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    return unit_vectors(lat, lon)


class CupyBroadcastEngine(HostEngine):
    """Naive CuPy: broadcasting and argpartition, no index, no fused kernels."""

    name = "cupy-broadcast"

    def __init__(self, earth_radius_m: float = EARTH_RADIUS_M) -> None:
        super().__init__(earth_radius_m)
        self.pool = gpu_memory.initialise_pool()

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> BroadcastIndex:
        return BroadcastIndex(lat, lon, self.earth_radius_m)

    @gpu_memory.out_of_memory_guard("a distance matrix")
    def distance_matrix(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> np.ndarray:
        np_dtype = np.dtype(dtype)
        a = cp.asarray(_unit(lat1, lon1), dtype=np_dtype)
        b = cp.asarray(_unit(lat2, lon2), dtype=np_dtype)
        out = np.empty((a.shape[0], b.shape[0]), dtype=np_dtype)
        step = max(1, _BLOCK_ELEMENTS // max(1, 4 * b.shape[0]))
        radius = np_dtype.type(self.earth_radius_m)
        for start in range(0, a.shape[0], step):
            block = angle_between(a[start : start + step, None, :], b[None, :, :], xp=cp)
            out[start : start + step] = cp.asnumpy(radius * block)
        return out

    def memory_pool_bytes(self) -> tuple[int, int]:
        return gpu_memory.pool_bytes()

    def describe_device(self) -> str:
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return f"gpu: {name} (naive CuPy); {self.pool.describe()}"
