"""scikit-learn's BallTree with the haversine metric, kept for comparison.

BallTree takes (lat, lon) in radians and returns haversine angles, which lose
precision near antipodes; candidates are re-measured with the exact float64 formula
and re-ranked, so answers match the reference.
"""

from __future__ import annotations

import numpy as np
from sklearn.neighbors import BallTree

from geonear.service.engines.base import Neighbours
from geonear.service.engines.host import HostEngine, HostIndex, flatten_candidates

_ANGLE_SLACK = 1e-9
#: Points this much nearer than the radius (radians) are surely within it: haversine
#: angles err by up to about 2e-8 near antipodes.
_SURE_ANGLE_MARGIN = 1e-7


class BallTreeIndex(HostIndex):
    def __init__(self, lat: np.ndarray, lon: np.ndarray, earth_radius_m: float) -> None:
        super().__init__(lat, lon, earth_radius_m)
        self.tree = BallTree(np.radians(np.column_stack([self.lat, self.lon])), metric="haversine")

    @property
    def host_bytes(self) -> int:
        data, idx, nodes, bounds = self.tree.get_arrays()
        return int(self.xyz.nbytes + data.nbytes + idx.nbytes + nodes.nbytes + bounds.nbytes)

    def _radians(self, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
        return np.radians(np.column_stack([lat, lon]))

    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        kk = min(k, self.n_points)
        if kk == 0 or lat.shape[0] == 0:
            n_q = lat.shape[0]
            return Neighbours(np.full((n_q, kk), np.inf), np.full((n_q, kk), -1, np.int64))
        # One candidate more than asked shows whether the k-th ties with points beyond it.
        _, idx = self.tree.query(self._radians(lat, lon), k=min(kk + 1, self.n_points))
        return self.nearest(lat, lon, idx.astype(np.int64), max_distance_m, kk)

    def candidates_within(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        n_q = lat.shape[0]
        if n_q == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        found = self.tree.query_radius(self._radians(lat, lon), r=self._outer_angle(radius_m))
        return flatten_candidates(found, n_q)

    def counts_within(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """The tree's counts within the angle shrunk by _SURE_ANGLE_MARGIN (surely within)
        and widened by the slack (the candidates of ``radius``)."""
        every = self.everything_within(lat.shape[0], radius_m)
        if every is not None:
            return every, every
        points = self._radians(lat, lon)
        outer = self.tree.query_radius(points, r=self._outer_angle(radius_m), count_only=True)
        inner = radius_m / self.earth_radius_m - _SURE_ANGLE_MARGIN
        if inner <= 0:
            return np.zeros(lat.shape[0], dtype=np.int64), outer.astype(np.int64)
        sure = self.tree.query_radius(points, r=inner, count_only=True)
        return sure.astype(np.int64), outer.astype(np.int64)

    def _outer_angle(self, radius_m: float | np.ndarray) -> float | np.ndarray:
        return np.asarray(radius_m) / self.earth_radius_m * (1 + _ANGLE_SLACK) + _ANGLE_SLACK


class SklearnEngine(HostEngine):
    """BallTree(haversine) for KNN and radius; NumPy for matrices and k-means."""

    name = "sklearn"

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> BallTreeIndex:
        return BallTreeIndex(lat, lon, self.earth_radius_m)
