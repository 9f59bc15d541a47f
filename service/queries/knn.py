"""KNN queries: the k nearest dataset points of each query point.

A query searches a :class:`~geonear.service.queries.filters.PointSelection`: the
dataset's own index, or a filter's index of the points it selects, whose row numbers
are mapped back to the dataset's before anything else sees them.

``knn_query`` checks a request and knows its answer's size before any search; ``knn``
answers it whole, on the event loop (compact answers, small by construction, batched),
and ``knn_slices`` a slice of queries at a time, on a thread (streamed answers).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from geonear.service.batching import Batcher
from geonear.service.engines import Capability, Neighbours, require
from geonear.service.errors import InvalidInput, LimitExceeded
from geonear.service.queries.common import (
    NeighbourGrid,
    NeighbourRows,
    batchable,
    check_columns,
    check_queries,
    check_result_rows,
    fixed_slices,
    search_rows,
    searched_ahead,
)
from geonear.service.queries.filters import PointSelection, all_points
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion


@dataclass(frozen=True)
class KnnQuery:
    """A checked KNN request over one dataset version."""

    dataset: DatasetVersion
    lat: np.ndarray
    lon: np.ndarray
    k: int
    max_distance_m: float | None
    columns: tuple[str, ...]
    #: The points searched (a filter's selection, or all of the dataset's).
    points: PointSelection

    @property
    def n_queries(self) -> int:
        return int(self.lat.shape[0])

    @property
    def rows_per_query(self) -> int:
        return min(self.k, self.points.n_points)

    @property
    def result_rows(self) -> int:
        """Most rows of the answer (fewer where ``max_distance_m`` leaves some out)."""
        return self.n_queries * self.rows_per_query


def knn_query(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    k: int,
    *,
    max_distance_m: float | None = None,
    columns: Sequence[str] = (),
    points: PointSelection | None = None,
    stored_queries: bool = False,
    limits: Limits,
) -> KnnQuery:
    """The request, checked; raises on a bad k, bound, query or column, and refuses an
    answer beyond ``max_result_rows`` before any search.

    ``points`` are the points searched (default: all of the dataset's);
    ``stored_queries`` says the query points are a stored dataset's, checked when they
    were stored, so ``max_query_points`` (a bound on request messages) does not apply.
    ``columns`` are not checked then: the caller has.
    """
    require(dataset.engine, Capability.KNN, "a KNN query")
    if k < 1:
        raise InvalidInput(f"k must be at least 1, got {k}")
    if k > limits.max_k:
        raise LimitExceeded(f"k={k} exceeds max_k={limits.max_k} (setting GEONEAR_MAX_K)")
    if max_distance_m is not None and not (np.isfinite(max_distance_m) and max_distance_m >= 0):
        raise InvalidInput(f"max_distance_m must be a finite number >= 0, got {max_distance_m}")
    if not stored_queries:
        check_queries(lat, lon, limits)
        columns = check_columns(dataset, columns)
    points = points or all_points(dataset)
    query = KnnQuery(dataset, lat, lon, k, max_distance_m, tuple(columns), points)
    searched = f"{points.n_points} selected" if points.rows is not None else dataset.rows
    check_result_rows(
        query.result_rows, limits, f"{query.n_queries} queries x min(k={k}, {searched} rows)"
    )
    return query


async def knn(
    query: KnnQuery, *, batcher: Batcher | None = None, timeout_s: float | None = None
) -> NeighbourRows:
    """Neighbours of every query, nearest first, in one engine call, for a handler on the
    server's event loop: the engine runs on another thread. With a ``batcher``, the
    engine call may be shared with concurrent requests; a request still queued after
    ``timeout_s`` is refused with DEADLINE_EXCEEDED."""
    q = query
    shared = batchable(batcher, q.n_queries, q.result_rows)
    if shared is None:
        found = await asyncio.to_thread(q.points.index.knn, q.lat, q.lon, q.k, q.max_distance_m)
    else:
        found = await shared.knn(q.points.index, q.lat, q.lon, q.k, q.max_distance_m, timeout_s)
    return _grid(q, found, 0).neighbour_rows()


def knn_slices(query: KnnQuery, *, offset: int = 0) -> Iterator[NeighbourGrid]:
    """The answer a slice of queries at a time (``SLICE_ROWS`` rows each), searched
    ``search_rows`` rows of queries an engine call, the next call made ahead while this
    one's slices are assembled and sent; query_index counts from ``offset`` (the call's
    earlier queries)."""
    q = query
    per_query = q.rows_per_query
    # The answer's ids, gathered by the engine where it can (``knn_with_ids``), over a
    # dataset's own index; a filter's index numbers the points it selects, and its
    # answer's ids are gathered on the host.
    ids = q.dataset.narrow_ids if q.points.rows is None else None

    def search(start: int, stop: int) -> Neighbours:
        lat, lon = q.lat[start:stop], q.lon[start:stop]
        if ids is None:
            return q.points.index.knn(lat, lon, q.k, q.max_distance_m)
        return q.points.index.knn_with_ids(lat, lon, q.k, q.max_distance_m, ids)

    blocks = fixed_slices(q.n_queries, per_query, search_rows(q.dataset))
    for start, stop, found in searched_ahead(blocks, search):
        grid = _grid(q, found, start)
        for a, b in fixed_slices(stop - start, per_query):
            yield dataclasses.replace(
                grid,
                indices=grid.indices[a:b],
                distances_m=grid.distances_m[a:b],
                first_query=grid.first_query + a + offset,
                gathered_ids=None if grid.gathered_ids is None else grid.gathered_ids[a:b],
            )


def _grid(q: KnnQuery, found: Neighbours, first_query: int) -> NeighbourGrid:
    full = q.max_distance_m is None  # every query has min(k, points searched) neighbours
    rows = q.points.dataset_rows(found.indices, full=full)
    return NeighbourGrid(
        q.dataset, rows, found.distances_m, first_query, q.columns, found.ids, full=full
    )
