"""Radius queries: every dataset point within radius_m of each query point.

``radius_query`` checks a request and counts each query's neighbours (the engine's
``radius_count``, which gathers none), so that the answer's size is known before the
search; ``radius`` answers it whole, on the event loop, and ``radius_slices`` a slice of
queries at a time, cut by those counts, on a thread. As for KNN, the points searched are a
:class:`~geonear.service.queries.filters.PointSelection`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from geonear.service.batching import Batcher
from geonear.service.engines import Capability, RadiusNeighbours, require
from geonear.service.errors import InvalidInput
from geonear.service.queries.common import (
    NeighbourRows,
    batchable,
    check_columns,
    check_queries,
    check_result_rows,
    counted_slices,
    searched_ahead,
)
from geonear.service.queries.filters import PointSelection, all_points
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion

#: A compact radius request of at most this many queries is checked and counted on the
#: event loop itself: a count of a few queries costs less than handing it to a thread.
INLINE_COUNT_QUERIES = 64


@dataclass(frozen=True)
class RadiusQuery:
    """A checked radius request over one dataset version, with its neighbours counted."""

    dataset: DatasetVersion
    lat: np.ndarray
    lon: np.ndarray
    radius_m: float
    columns: tuple[str, ...]
    counts: np.ndarray  # int64, neighbours of each query
    #: The points searched (a filter's selection, or all of the dataset's).
    points: PointSelection

    @property
    def n_queries(self) -> int:
        return int(self.lat.shape[0])

    @property
    def result_rows(self) -> int:
        return int(self.counts.sum())


def radius_query(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    *,
    columns: Sequence[str] = (),
    points: PointSelection | None = None,
    stored_queries: bool = False,
    limits: Limits,
) -> RadiusQuery:
    """The request, checked and counted; an answer beyond ``max_result_rows`` is refused
    before any neighbour is gathered. ``points`` and ``stored_queries`` as for
    ``knn.knn_query``."""
    checked = _check(dataset, lat, lon, radius_m, columns, limits, stored_queries)
    points = points or all_points(dataset)
    return _counted(dataset, lat, lon, radius_m, checked, limits, points)


async def radius(
    query: RadiusQuery, *, batcher: Batcher | None = None, timeout_s: float | None = None
) -> NeighbourRows:
    """Points within ``radius_m`` of each query, nearest first per query, in one engine
    call, for a handler on the server's event loop (see ``knn.knn`` for the batcher)."""
    q = query
    shared = batchable(batcher, q.n_queries, q.result_rows)
    if shared is None:
        found = await asyncio.to_thread(q.points.index.radius, q.lat, q.lon, q.radius_m)
    else:
        found = await shared.radius(q.points.index, q.lat, q.lon, q.radius_m, timeout_s)
    return _rows(q, found, 0)


def radius_slices(query: RadiusQuery, *, offset: int = 0) -> Iterator[NeighbourRows]:
    """The answer a slice of queries at a time (about ``SLICE_ROWS`` rows each, by the
    counts), the next slice searched ahead while this one is assembled and sent;
    query_index counts from ``offset`` (the call's earlier queries)."""
    q = query

    def search(start: int, stop: int) -> RadiusNeighbours:
        return q.points.index.radius(q.lat[start:stop], q.lon[start:stop], q.radius_m)

    for start, _, neighbours in searched_ahead(counted_slices(q.counts), search):
        found = _rows(q, neighbours, start)
        if offset:
            found = dataclasses.replace(found, query_index=found.query_index + offset)
        yield found


def _check(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    columns: Sequence[str],
    limits: Limits,
    stored_queries: bool,
) -> tuple[str, ...]:
    require(dataset.engine, Capability.RADIUS, "a radius query")
    if not (np.isfinite(radius_m) and radius_m >= 0):
        raise InvalidInput(f"radius_m must be a finite number >= 0, got {radius_m}")
    if stored_queries:
        return tuple(columns)
    check_queries(lat, lon, limits)
    return tuple(check_columns(dataset, columns))


def _counted(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    columns: tuple[str, ...],
    limits: Limits,
    points: PointSelection,
) -> RadiusQuery:
    counts = points.index.radius_count(lat, lon, radius_m)
    query = RadiusQuery(dataset, lat, lon, radius_m, columns, counts, points)
    check_result_rows(
        query.result_rows, limits, f"a radius of {radius_m} m around {query.n_queries} queries"
    )
    return query


def _rows(q: RadiusQuery, found: RadiusNeighbours, first_query: int) -> NeighbourRows:
    query_index = found.query_index
    rank = np.arange(query_index.shape[0], dtype=np.int64) - found.offsets[query_index]
    if first_query:
        query_index += first_query
    return NeighbourRows(
        q.dataset,
        query_index,
        rank.astype(np.int32),
        q.points.dataset_rows(found.indices, full=True),
        found.distances_m,
        q.columns,
        offsets=found.offsets,
    )
