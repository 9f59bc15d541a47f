"""The CPU engine: scipy's cKDTree over 3-D unit vectors, on all cores.

The tree searches by chord length (same order as great-circle distance); candidates
are then measured exactly in float64 great-circle metres and re-ranked, so results
match the reference. Bounds in metres become chord bounds with a small slack, so no
point at the boundary is lost before the exact filter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from scipy.spatial import cKDTree

from geonear.geometry import EARTH_RADIUS_M, chord_for_distance, unit_vectors
from geonear.service.engines.base import Neighbours, RadiusNeighbours
from geonear.service.engines.host import (
    SLICE_THREADS,
    HostEngine,
    HostIndex,
    flatten_candidates,
    in_slice_thread,
    slice_threads,
)

#: Relative slack on chord bounds: far above float64 rounding, far below 1 mm.
_CHORD_SLACK = 1e-9
#: Points per leaf: larger leaves mean fewer nodes (less memory) for similar speed.
_LEAF_SIZE = 32
#: Fewer queries than this run on the calling thread: scipy starts new threads for
#: every call with workers != 1, which costs more than it saves on a small batch
#: (16 queries on 1M points: 160 µs on one thread, 610 µs on two; break-even near 512).
_THREADED_MIN_QUERIES = 512
#: Fewest queries in a slice of a KNN or radius call (see ``KDTreeIndex._in_slices``).
_SLICE_MIN_QUERIES = 256

_T = TypeVar("_T")


def _chord_bound(distance_m: float | np.ndarray, earth_radius_m: float) -> Any:
    """``chord_for_distance`` (of one distance or of each of an array), widened by the slack."""
    return chord_for_distance(distance_m, earth_radius_m) * (1 + _CHORD_SLACK) + _CHORD_SLACK


class KDTreeIndex(HostIndex):
    def __init__(
        self, lat: np.ndarray, lon: np.ndarray, earth_radius_m: float, workers: int = -1
    ) -> None:
        super().__init__(lat, lon, earth_radius_m)
        self.workers = workers
        # balanced_tree=False (sliding midpoint) builds several times faster and
        # queries as fast on geographic data; the tree shares self.xyz, no copy.
        self.tree = cKDTree(
            self.xyz, leafsize=_LEAF_SIZE, balanced_tree=False, compact_nodes=False, copy_data=False
        )

    @property
    def host_bytes(self) -> int:
        # Unit vectors (shared with the tree) + the tree's permutation + its nodes.
        node_bytes = 64 * int(self.tree.size)
        return int(self.xyz.nbytes + self.tree.indices.nbytes + node_bytes)

    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        kk = min(k, self.n_points)
        n_q = lat.shape[0]
        if kk == 0 or n_q == 0:
            return Neighbours(np.full((n_q, kk), np.inf), np.full((n_q, kk), -1, np.int64))
        parts = self._in_slices(
            lat, lon, lambda la, lo: self._knn_slice(la, lo, kk, max_distance_m)
        )
        return Neighbours(
            np.concatenate([p.distances_m for p in parts]),
            np.concatenate([p.indices for p in parts]),
        )

    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        def one_slice(la: np.ndarray, lo: np.ndarray) -> RadiusNeighbours:
            limit = np.full(la.shape[0], radius_m)
            query_index, rows = self._candidates(la, lo, limit, workers=1)
            return self.exact_radius(la, lo, query_index, rows, radius_m)

        parts = self._in_slices(lat, lon, one_slice)
        if len(parts) == 1:
            return parts[0]
        counts = np.concatenate([np.diff(p.offsets) for p in parts])
        offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return RadiusNeighbours(
            offsets,
            np.concatenate([p.indices for p in parts]),
            np.concatenate([p.distances_m for p in parts]),
        )

    def _in_slices(
        self, lat: np.ndarray, lon: np.ndarray, search: Callable[[np.ndarray, np.ndarray], _T]
    ) -> list[_T]:
        """``search`` of the queries, in slices when the call is large: one a core, each
        on a thread of its own (the tree and NumPy's loops release the GIL), so that the
        exact distances and their order are worked out on every core, as the tree's
        search is."""
        n_q = lat.shape[0]
        workers = self._workers_for(n_q)
        cores = SLICE_THREADS if workers < 0 else workers
        n_slices = max(1, min(cores, n_q // _SLICE_MIN_QUERIES))
        if n_slices == 1:
            return [search(lat, lon)]
        ends = [n_q * s // n_slices for s in range(n_slices + 1)]
        return list(
            slice_threads().map(lambda a, b: search(lat[a:b], lon[a:b]), ends[:-1], ends[1:])
        )

    def _knn_slice(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None
    ) -> Neighbours:
        """KNN of some queries on the calling thread: the tree's candidates, re-ranked."""
        bound = (
            np.inf if max_distance_m is None else _chord_bound(max_distance_m, self.earth_radius_m)
        )
        # One candidate more than asked shows whether the k-th ties with points beyond it.
        n_candidates = min(k + 1, self.n_points)
        _, idx = self.tree.query(
            unit_vectors(lat, lon), k=n_candidates, distance_upper_bound=bound, workers=1
        )
        idx = np.asarray(idx, dtype=np.int64).reshape(lat.shape[0], n_candidates)
        idx[idx >= self.n_points] = -1
        return self.nearest(lat, lon, idx, max_distance_m, k)

    def candidates_within(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        return self._candidates(lat, lon, radius_m, self._workers_for(lat.shape[0]))

    def counts_within(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """The tree's counts within the chord bound shrunk by the slack (surely within)
        and widened by it (the candidates of ``radius``)."""
        every = self.everything_within(lat.shape[0], radius_m)
        if every is not None:
            return every, every
        xyz = unit_vectors(lat, lon)
        workers = self._workers_for(lat.shape[0])
        chord = chord_for_distance(radius_m, self.earth_radius_m)
        # The same expression as _chord_bound, so the same candidates as ``radius``.
        outer = chord * (1 + _CHORD_SLACK) + _CHORD_SLACK
        inner = chord * (1 - _CHORD_SLACK) - _CHORD_SLACK
        maybe = self.tree.query_ball_point(xyz, outer, workers=workers, return_length=True)
        if inner <= 0:
            return np.zeros(lat.shape[0], dtype=np.int64), maybe.astype(np.int64)
        sure = self.tree.query_ball_point(xyz, inner, workers=workers, return_length=True)
        return sure.astype(np.int64), maybe.astype(np.int64)

    def _candidates(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: np.ndarray, workers: int
    ) -> tuple[np.ndarray, np.ndarray]:
        n_q = lat.shape[0]
        if n_q == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        bounds: float | np.ndarray
        if (radius_m == radius_m[0]).all():  # one radius for all (a radius query)
            bounds = _chord_bound(float(radius_m[0]), self.earth_radius_m)
        else:
            bounds = _chord_bound(radius_m, self.earth_radius_m)
        found = self.tree.query_ball_point(
            unit_vectors(lat, lon), bounds, workers=workers, return_sorted=False
        )
        return flatten_candidates(found, n_q)

    def _workers_for(self, n_queries: int) -> int:
        # A slice's own searches (its tied queries' second search) stay on its thread.
        if n_queries < _THREADED_MIN_QUERIES or in_slice_thread():
            return 1
        return self.workers


class CPUEngine(HostEngine):
    """cKDTree on unit vectors for KNN and radius; NumPy for matrices and k-means."""

    name = "cpu"

    def __init__(self, earth_radius_m: float = EARTH_RADIUS_M, workers: int = -1) -> None:
        super().__init__(earth_radius_m)
        self.workers = workers

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> KDTreeIndex:
        return KDTreeIndex(lat, lon, self.earth_radius_m, self.workers)
