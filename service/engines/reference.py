"""The float64 reference: brute force over every point with NumPy.

Slow (O(queries x points)) and simple enough to trust; every other engine is tested
against it, and ``geonear bench`` reports it as ``numpy-brute``.
"""

from __future__ import annotations

import numpy as np

from geonear.geometry import great_circle_m
from geonear.service.engines.base import Neighbours, RadiusNeighbours, sort_radius
from geonear.service.engines.host import BLOCK_PAIRS, HostEngine, HostIndex


class ReferenceIndex(HostIndex):
    def _step(self) -> int:
        return max(1, BLOCK_PAIRS // max(1, self.n_points))

    def _distances(self, q_lat: np.ndarray, q_lon: np.ndarray) -> np.ndarray:
        return great_circle_m(
            q_lat[:, None],
            q_lon[:, None],
            self.lat[None, :],
            self.lon[None, :],
            self.earth_radius_m,
        )

    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        n_q, kk = lat.shape[0], min(k, self.n_points)
        distances = np.full((n_q, kk), np.inf)
        indices = np.full((n_q, kk), -1, dtype=np.int64)
        step = self._step()
        for start in range(0, n_q, step):
            stop = min(n_q, start + step)
            dist = self._distances(lat[start:stop], lon[start:stop])
            order = np.argsort(dist, axis=1, kind="stable")[:, :kk]
            d = np.take_along_axis(dist, order, axis=1)
            if max_distance_m is not None:
                far = d > max_distance_m
                d[far] = np.inf
                order[far] = -1
            distances[start:stop], indices[start:stop] = d, order
        return Neighbours(distances_m=distances, indices=indices)

    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        n_q = lat.shape[0]
        qs, rows, dists = [], [], []
        step = self._step()
        for start in range(0, n_q, step):
            dist = self._distances(lat[start : start + step], lon[start : start + step])
            q, r = np.nonzero(dist <= radius_m)
            qs.append(q + start)
            rows.append(r)
            dists.append(dist[q, r])
        if not qs:
            empty = np.empty(0, dtype=np.int64)
            return sort_radius(empty, empty, np.empty(0), n_q)
        return sort_radius(np.concatenate(qs), np.concatenate(rows), np.concatenate(dists), n_q)

    def radius_count(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> np.ndarray:
        n_q = lat.shape[0]
        counts = np.zeros(n_q, dtype=np.int64)
        step = self._step()
        for start in range(0, n_q, step):
            dist = self._distances(lat[start : start + step], lon[start : start + step])
            counts[start : start + step] = np.count_nonzero(dist <= radius_m, axis=1)
        return counts


class ReferenceEngine(HostEngine):
    """float64 brute force: the definition of the right answer."""

    name = "numpy-brute"

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> ReferenceIndex:
        return ReferenceIndex(lat, lon, self.earth_radius_m)
