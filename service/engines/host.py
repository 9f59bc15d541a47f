"""Pieces shared by the host (NumPy) engines: exact re-ranking and matrices in tiles."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from geonear.geometry import angle_between, great_circle_m, unit_vectors
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
from geonear.service.engines.spherical_kmeans import ArrayKMeans, spherical_kmeans

#: Bound on the number of (query, point) pairs evaluated at once by brute force.
BLOCK_PAIRS = 1 << 22
#: Neighbours this close to the k-th one may tie with it, metres: far above float64
#: rounding of a distance, far below the 1 mm of the exactness rule.
_TIE_M = 1e-6


#: Threads of ``slice_threads``, one a core: the most slices a call is worth cutting into.
SLICE_THREADS = os.cpu_count() or 1

_slice_threads: ThreadPoolExecutor | None = None
_slice_threads_lock = threading.Lock()
_this_thread = threading.local()


def _mark_slice_thread() -> None:
    _this_thread.is_slice = True


def in_slice_thread() -> bool:
    """Whether the calling thread is one of ``slice_threads``: it has a core to itself,
    so what it runs should not start threads of its own."""
    return getattr(_this_thread, "is_slice", False)


def slice_threads() -> ThreadPoolExecutor:
    """Threads for the slices of a call (queries, matrix rows): one a core, started once,
    shared by every host index and engine. NumPy's loops and scipy's trees release the
    GIL, so the slices run on every core."""
    global _slice_threads
    with _slice_threads_lock:
        if _slice_threads is None:
            _slice_threads = ThreadPoolExecutor(
                max_workers=SLICE_THREADS,
                thread_name_prefix="geonear-slice",
                initializer=_mark_slice_thread,
            )
        return _slice_threads


def _forget_threads() -> None:
    """In a forked child, which has none of its parent's threads: start anew."""
    global _slice_threads, _slice_threads_lock
    _slice_threads, _slice_threads_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_threads)


def flatten_candidates(found: Sequence[Any], n_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """(query_index, rows) of a tree's per-query candidate lists (or arrays)."""
    counts = np.fromiter(map(len, found), dtype=np.int64, count=n_queries)
    total = int(counts.sum())
    if total == 0:
        rows = np.empty(0, dtype=np.int64)
    elif isinstance(found[0], list):  # cKDTree's: one pass, no array a query (5x faster)
        rows = np.fromiter(itertools.chain.from_iterable(found), dtype=np.int64, count=total)
    else:
        rows = np.concatenate(found).astype(np.int64, copy=False)
    return np.repeat(np.arange(n_queries, dtype=np.int64), counts), rows


def _ranked(candidates: np.ndarray, dist: np.ndarray, valid: np.ndarray) -> Neighbours:
    """Candidates sorted by (exact distance, row); invalid ones last, as (inf, -1)."""
    dist = np.where(valid, dist, np.inf)
    idx = np.where(valid, candidates, -1).astype(np.int64, copy=False)
    d, i = sort_neighbours(dist, idx)
    return Neighbours(distances_m=d, indices=i)


class HostIndex(PointIndex):
    """Points kept as float64 degrees plus unit vectors in host memory."""

    def __init__(self, lat: np.ndarray, lon: np.ndarray, earth_radius_m: float) -> None:
        self.lat = np.ascontiguousarray(lat, dtype=np.float64)
        self.lon = np.ascontiguousarray(lon, dtype=np.float64)
        self.xyz = unit_vectors(self.lat, self.lon)
        self.n_points = int(self.lat.shape[0])
        self.earth_radius_m = earth_radius_m

    @property
    def host_bytes(self) -> int:
        return int(self.xyz.nbytes)

    def exact_neighbours(
        self,
        q_lat: np.ndarray,
        q_lon: np.ndarray,
        candidates: np.ndarray,
        max_distance_m: float | None,
    ) -> Neighbours:
        """Great-circle distances of candidate rows (n, c; -1 = none), re-ranked exactly."""
        dist, valid = self._candidate_distances(q_lat, q_lon, candidates, max_distance_m)
        return _ranked(candidates, dist, valid)

    def nearest(
        self,
        q_lat: np.ndarray,
        q_lon: np.ndarray,
        candidates: np.ndarray,
        max_distance_m: float | None,
        k: int,
    ) -> Neighbours:
        """The exact first k of a tree's k + 1 candidates per query (see ``cut_at_k``).

        A tree returns candidates nearest first by its own metric. When all are valid
        and their exact distances rise by more than _TIE_M from each to the next, that
        order is already the (distance, row) order with no tie at the k-th, and the
        re-ranking (most of the cost of a small query) is skipped.
        """
        dist, valid = self._candidate_distances(q_lat, q_lon, candidates, max_distance_m)
        if valid.all() and (np.diff(dist, axis=-1) > _TIE_M).all():
            return Neighbours(dist[:, :k].copy(), candidates[:, :k].astype(np.int64))
        return self.cut_at_k(q_lat, q_lon, _ranked(candidates, dist, valid), k)

    def _candidate_distances(
        self,
        q_lat: np.ndarray,
        q_lon: np.ndarray,
        candidates: np.ndarray,
        max_distance_m: float | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact distances of candidate rows (-1 = none), and which are valid."""
        valid = candidates >= 0
        rows = np.where(valid, candidates, 0)
        dist = great_circle_m(
            q_lat[:, None], q_lon[:, None], self.lat[rows], self.lon[rows], self.earth_radius_m
        )
        if max_distance_m is not None:
            valid &= dist <= max_distance_m
        return dist, valid

    def candidates_within(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(query_index, rows): a superset of the points within ``radius_m[q]`` of query q."""
        raise NotImplementedError(f"{type(self).__name__} has no radius candidate search")

    def counts_within(
        self, lat: np.ndarray, lon: np.ndarray, radius_m: float
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Per query, (points surely within ``radius_m``, points ``candidates_within``
        finds), each counted by the index without listing them; None where it cannot."""
        return None

    def everything_within(self, n_queries: int, radius_m: float) -> np.ndarray | None:
        """Each query's count where ``radius_m`` is half the circumference or more (no two
        points are farther apart: every point is within); None otherwise."""
        if radius_m >= np.pi * self.earth_radius_m:
            return np.full(n_queries, self.n_points, dtype=np.int64)
        return None

    def radius_count(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> np.ndarray:
        """Exact counts from the index's two counts: where they differ, a candidate lies
        within the slack of the boundary, and that query's candidates are measured as
        ``radius`` measures them (rare: it takes a point within about 1e-9 of the radius)."""
        n_q = int(lat.shape[0])
        bounds = self.counts_within(lat, lon, radius_m) if n_q else None
        if bounds is None:
            return super().radius_count(lat, lon, radius_m)
        sure, counts = bounds
        unsure = np.flatnonzero(counts > sure)
        if not unsure.size:
            return counts
        # In groups of at most BLOCK_PAIRS candidates (a query with more, alone).
        first = np.cumsum(counts[unsure]) - counts[unsure]
        group_of = first // BLOCK_PAIRS
        cuts = np.flatnonzero(np.diff(group_of)) + 1
        for group in np.split(unsure, cuts):
            g_lat, g_lon = lat[group], lon[group]
            query_index, rows = self.candidates_within(g_lat, g_lon, np.full(group.size, radius_m))
            dist = great_circle_m(
                g_lat[query_index],
                g_lon[query_index],
                self.lat[rows],
                self.lon[rows],
                self.earth_radius_m,
            )
            counts[group] = np.bincount(query_index[dist <= radius_m], minlength=group.size)
        return counts

    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        """Candidates from the tree, kept and sorted by their exact distance."""
        query_index, rows = self.candidates_within(lat, lon, np.full(lat.shape[0], radius_m))
        return self.exact_radius(lat, lon, query_index, rows, radius_m)

    def cut_at_k(
        self, q_lat: np.ndarray, q_lon: np.ndarray, found: Neighbours, k: int
    ) -> Neighbours:
        """The first k of ``found`` (k + 1 exact, sorted candidates per query), ties by row.

        A tree returns some k of several points equally far away, not the k lowest rows.
        Where the (k+1)-th candidate is as far as the k-th, every point within that
        distance is fetched and the first k by (distance, row) are kept.
        """
        dist, idx = found.distances_m, found.indices
        if dist.shape[1] <= k:
            return found
        with np.errstate(invalid="ignore"):  # inf - inf where both are missing
            gap = dist[:, k] - dist[:, k - 1]
        tied = np.flatnonzero(np.isfinite(dist[:, k]) & (gap <= _TIE_M))
        dist, idx = dist[:, :k].copy(), idx[:, :k].copy()
        if tied.size:
            reach = dist[tied, k - 1] + _TIE_M
            query_index, rows = self.candidates_within(q_lat[tied], q_lon[tied], reach)
            near = self.exact_radius(q_lat[tied], q_lon[tied], query_index, rows, reach)
            # Each tied query finds at least its k candidates again: take its first k.
            first_k = near.offsets[:-1, None] + np.arange(k)
            dist[tied] = near.distances_m[first_k]
            idx[tied] = near.indices[first_k]
        return Neighbours(distances_m=dist, indices=idx)

    def exact_radius(
        self,
        q_lat: np.ndarray,
        q_lon: np.ndarray,
        query_index: np.ndarray,
        rows: np.ndarray,
        radius_m: float | np.ndarray,
    ) -> RadiusNeighbours:
        """Keep the candidate (query, row) pairs within ``radius_m`` (scalar or per query)."""
        dist = great_circle_m(
            q_lat[query_index],
            q_lon[query_index],
            self.lat[rows],
            self.lon[rows],
            self.earth_radius_m,
        )
        limit = np.broadcast_to(np.asarray(radius_m, dtype=np.float64), q_lat.shape)
        keep = dist <= limit[query_index]
        return sort_radius(query_index[keep], rows[keep], dist[keep], q_lat.shape[0])

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
        backend = ArrayKMeans(self.xyz, weights, self.earth_radius_m, np)
        return spherical_kmeans(backend, k, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol)


class HostEngine(Engine):
    """Distance matrices with NumPy over unit vectors, in tiles of bounded size."""

    def distance_matrix(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> np.ndarray:
        np_dtype = np.dtype(dtype)
        a = unit_vectors(lat1, lon1, dtype=np_dtype)
        b = unit_vectors(lat2, lon2, dtype=np_dtype)
        out = np.empty((a.shape[0], b.shape[0]), dtype=np_dtype)
        # Row tiles on every core, BLOCK_PAIRS pairs at once in all (the temporaries).
        step = max(1, BLOCK_PAIRS // SLICE_THREADS // max(1, b.shape[0]))
        radius = np_dtype.type(self.earth_radius_m)

        def tile(start: int) -> None:
            block = a[start : start + step, None, :]
            out[start : start + step] = radius * angle_between(block, b[None, :, :])

        starts = range(0, a.shape[0], step)
        if len(starts) == 1:
            tile(0)
        else:
            list(slice_threads().map(tile, starts))  # raises a tile's error, if any
        return out
