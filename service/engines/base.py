"""The one engine interface that every backend implements.

An :class:`Engine` turns a dataset's points into a :class:`PointIndex` once per dataset
version; the index answers KNN, radius and k-means queries over those points. Distance
matrices between arbitrary point sets are an engine method. Inputs are host NumPy
arrays of degrees (latitude first); outputs are host NumPy arrays, distances in
great-circle metres, row numbers into the dataset.

Exactness (docs/design.md): every engine returns the float64 reference's answer: the same
row numbers in the same order, except among neighbours whose distances differ by less
than 1 mm, and distances within 1 mm of the reference's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import pyarrow as pa

from geonear.geometry import EARTH_RADIUS_M

# DeviceLost is raised by engines and defined with the service's other errors.
from geonear.service.errors import DeviceLost as DeviceLost

if TYPE_CHECKING:
    from geonear.service.analytics.areas import Area
    from geonear.service.engines import EngineSpec

MatrixDtype = Literal["float64", "float32"]
#: (query, point) pairs a slice of ``PointIndex.radius_count``'s default may gather at once.
COUNT_SLICE_PAIRS = 1 << 22


@dataclass(frozen=True)
class Neighbours:
    """KNN answer for n queries.

    Attributes
    ----------
    distances_m : ndarray of float64, shape (n, k)
        Great-circle metres, nearest first; ``inf`` where a query has fewer than k
        neighbours (small dataset or ``max_distance_m``).
    indices : ndarray of int64, shape (n, k)
        Dataset row numbers, ties broken by row order; ``-1`` where missing.
    ids : ndarray, shape (n, k), or None
        Each neighbour's value in the ``ids`` given to ``PointIndex.knn_with_ids``, where
        the engine gathered them (meaningless where ``indices`` is -1); else None.
    """

    distances_m: np.ndarray
    indices: np.ndarray
    ids: np.ndarray | None = None


@dataclass(frozen=True)
class RadiusNeighbours:
    """Radius answer for n queries in compressed-row form.

    The neighbours of query ``q`` are ``indices[offsets[q]:offsets[q + 1]]``, nearest
    first, ties broken by row order, with their ``distances_m`` (float64 metres).
    """

    offsets: np.ndarray
    indices: np.ndarray
    distances_m: np.ndarray

    @property
    def query_index(self) -> np.ndarray:
        """Query number of every result row, int64."""
        counts = np.diff(self.offsets)
        return np.repeat(np.arange(counts.shape[0], dtype=np.int64), counts)


@dataclass(frozen=True)
class KMeansResult:
    """Spherical k-means answer.

    Attributes
    ----------
    centroid_lat, centroid_lon : ndarray of float64, shape (k,)
        Centroids in degrees.
    sizes : ndarray of int64, shape (k,)
        Members per cluster.
    labels : ndarray of int32, shape (n,)
        Cluster of every dataset row.
    inertia_m2 : float
        Sum of (weighted) squared great-circle distances to the assigned centroid, m^2.
    n_iter : int
        Lloyd iterations of the winning initialisation.
    """

    centroid_lat: np.ndarray
    centroid_lon: np.ndarray
    sizes: np.ndarray
    labels: np.ndarray
    inertia_m2: float
    n_iter: int


class PointIndex(ABC):
    """A dataset version's points, prepared by one engine for queries."""

    #: Number of points in the index.
    n_points: int

    @property
    @abstractmethod
    def host_bytes(self) -> int:
        """Host memory held by the index beyond the dataset's own columns."""

    @property
    def device_bytes(self) -> int:
        """Device memory held by the index (0 for host engines)."""
        return 0

    def keep_columns(self, table: pa.Table) -> None:  # noqa: B027 - host engines keep none
        """Hold the dataset's id and attribute columns where the queries run.

        The GPU engine copies them to the device (a cuDF table) to gather large results
        there; host engines read the dataset's own table, so they keep nothing.
        """

    def take_columns(self, names: Sequence[str], rows: np.ndarray) -> dict[str, pa.ChunkedArray]:
        """The columns among ``names`` this index gathers itself at dataset ``rows``.

        Columns missing from the answer are taken from the host table by the caller; the
        answer is the same either way.
        """
        return {}

    def filter_rows(self, where: Sequence[Sequence[Any]]) -> np.ndarray | None:
        """Row numbers of the points a checked filter selects, in row order, int64,
        evaluated where this index keeps the columns; None where it does not keep them
        all, and the caller evaluates the filter on the host table.

        ``where`` is a ``CheckedFilter`` (``geonear.service.queries.filters``):
        conjunctions of predicates with ``column``, ``kind``, ``op``, ``values`` and
        ``constant``, ORed. Host engines keep no columns; the GPU engine evaluates on its
        cuDF table. The rows are the same either way.
        """
        return None

    def query_degrees(self, lat: np.ndarray, lon: np.ndarray) -> tuple[Any, Any]:
        """This index's own points (``lat``, ``lon``: its dataset's, in row order) as
        the query points of a search by another index of the same engine (a join's or
        a count's left side): the host arrays themselves by default; a device engine
        gives the device copy it keeps, so that they are not copied again a call."""
        return lat, lon

    @abstractmethod
    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        """The k nearest points of each query; k larger than the set returns all."""

    def knn_with_ids(
        self,
        lat: np.ndarray,
        lon: np.ndarray,
        k: int,
        max_distance_m: float | None,
        ids: np.ndarray,
    ) -> Neighbours:
        """``knn``, with each neighbour's value in ``ids`` (one a row, in row order: the
        dataset's ids) in ``Neighbours.ids`` where the engine gathers it where it
        searches, for less than the caller's gather on the host would cost. The GPU
        engine does (on the device: 5M narrow ids of a 1M x 5 join come back with the
        rows instead of a 20 ms host gather); by default ``Neighbours.ids`` is None and
        the caller gathers."""
        return self.knn(lat, lon, k, max_distance_m)

    @abstractmethod
    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        """All points within ``radius_m`` metres of each query."""

    def radius_count(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> np.ndarray:
        """Number of points within ``radius_m`` metres of each query, int64 of shape (n,).

        Exactly ``np.diff(self.radius(lat, lon, radius_m).offsets)``, found without
        gathering the neighbours, so that the size of a radius answer is known (and
        refused where too large) before it is made. Engines with a counting search
        override this; the default counts from ``radius`` itself, in slices of queries
        whose answers hold at most COUNT_SLICE_PAIRS (query, point) pairs.
        """
        n_q = int(np.shape(lat)[0])
        counts = np.zeros(n_q, dtype=np.int64)
        step = max(1, COUNT_SLICE_PAIRS // max(1, self.n_points))
        for start in range(0, n_q, step):
            found = self.radius(lat[start : start + step], lon[start : start + step], radius_m)
            counts[start : start + step] = np.diff(found.offsets)
        return counts

    def area_rows(
        self, lat: np.ndarray, lon: np.ndarray, area: Area, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """Row numbers of the indexed points inside ``area`` (a box or a spherical
        polygon), among ``rows`` (None: all), in row order, int64.

        ``lat``/``lon`` are the degrees the index was built from. The default tests them
        on the host with NumPy; the GPU engine tests its own copy on the device. The
        answer is the same either way (``geonear.service.analytics.areas``).
        """
        from geonear.service.analytics.areas import area_mask

        if rows is None:
            return np.flatnonzero(area_mask(lat, lon, area)).astype(np.int64, copy=False)
        return rows[area_mask(lat[rows], lon[rows], area)]

    @abstractmethod
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
        """Spherical k-means of the indexed points (see ``spherical_kmeans``).

        Engines run the one driver, ``spherical_kmeans.spherical_kmeans``, over hooks of
        their own (a ``KMeansBackend``). Long runs stop when the caller goes away: the
        query layer sets a stop check for the thread (``spherical_kmeans.stopping_when``),
        which the driver checks between Lloyd iterations, initialisations and k-means++
        draws, raising ``KMeansStopped``. Arguments out of range raise ValueError.
        """


class Engine(ABC):
    """A backend: builds indexes and computes distance matrices."""

    #: Name used by ``--engine``/``--engines`` and reported by GetDataset; the key of
    #: the engine's spec (``geonear.service.engines.ENGINES``), which declares the rest.
    name: ClassVar[str]

    def __init__(self, earth_radius_m: float = EARTH_RADIUS_M) -> None:
        self.earth_radius_m = float(earth_radius_m)

    @property
    def spec(self) -> EngineSpec:
        """This engine's declaration: where it runs and what it can answer."""
        from geonear.service.engines import engine_spec

        return engine_spec(self.name)

    @property
    def device_kind(self) -> str:
        """ "cpu" or "gpu", from the spec."""
        return self.spec.device_kind

    @abstractmethod
    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> PointIndex:
        """Prepare a dataset's points (float64 degrees) for queries."""

    @abstractmethod
    def distance_matrix(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> np.ndarray:
        """Great-circle metres between every point of set 1 (rows) and set 2 (columns)."""

    def warm_up(self) -> None:  # noqa: B027 - optional hook, host engines need none
        """Compile and exercise kernels so the first query pays no JIT cost."""

    def memory_pool_bytes(self) -> tuple[int, int]:
        """(bytes in use, bytes reserved) of the engine's device memory pool; (0, 0) on host."""
        return (0, 0)

    def describe_device(self) -> str:
        """A human description of the device this engine runs on."""
        import os

        return f"cpu: {os.cpu_count()} cores"


def sort_neighbours(distances_m: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order candidate neighbours per row by (distance, row number); missing (-1) last.

    ``distances_m`` and ``indices`` have shape (n, c); missing entries must hold
    ``inf`` and ``-1``.
    """
    if distances_m.size == 0:
        return distances_m, indices
    row_key = np.where(indices < 0, np.iinfo(np.int64).max, indices)
    order = np.lexsort((row_key, distances_m), axis=-1)
    return (
        np.take_along_axis(distances_m, order, axis=-1),
        np.take_along_axis(indices, order, axis=-1),
    )


#: Pairs sorted at once by ``sort_radius`` where they come grouped by query: blocks of
#: whole queries this large sort in cache (3.2M pairs: 0.97 s as one block, 0.24 s).
_RADIUS_SORT_BLOCK = 1024


def sort_radius(
    query_index: np.ndarray, indices: np.ndarray, distances_m: np.ndarray, n_queries: int
) -> RadiusNeighbours:
    """Build the compressed-row radius answer, sorted by (query, distance, row)."""
    counts = np.bincount(query_index, minlength=n_queries)
    offsets = np.zeros(n_queries + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = int(offsets[-1])
    if np.all(query_index[1:] >= query_index[:-1]):  # grouped by query, as trees give them
        targets = np.arange(0, total, _RADIUS_SORT_BLOCK)
        starts = offsets[np.searchsorted(offsets, targets, side="right") - 1]
        bounds = np.unique(np.append(starts, total))
    else:
        bounds = np.array([0, total])
    order = np.empty(total, dtype=np.int64)

    def sort_block(b: int, keys: tuple[np.ndarray, ...]) -> None:
        lo, hi = bounds[b], bounds[b + 1]
        order[lo:hi] = np.lexsort(tuple(key[lo:hi] for key in keys)) + lo

    # By (query, distance) first; rows are a third key only in the blocks where a query
    # has two equal distances (1.6x faster where none does).
    for b in range(bounds.shape[0] - 1):
        sort_block(b, (distances_m, query_index))
    dist, query = distances_m[order], query_index[order]
    tied = np.flatnonzero((dist[1:] == dist[:-1]) & (query[1:] == query[:-1]))
    if tied.size:
        for b in np.unique(np.searchsorted(bounds, tied, side="right") - 1):
            sort_block(int(b), (indices, distances_m, query_index))
        dist = distances_m[order]
    return RadiusNeighbours(
        offsets=offsets,
        indices=indices[order].astype(np.int64, copy=False),
        distances_m=dist,
    )
