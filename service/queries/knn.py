"""KNN queries: the k nearest dataset points of each query point."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from geonear.service.batching import Batcher
from geonear.service.engines import Neighbours
from geonear.service.errors import InvalidInput, LimitExceeded
from geonear.service.queries.common import NeighbourRows, check_columns, check_queries
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion


def knn(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    k: int,
    *,
    max_distance_m: float | None = None,
    columns: Sequence[str] = (),
    limits: Limits,
    batcher: Batcher | None = None,
    timeout_s: float | None = None,
) -> NeighbourRows:
    """Neighbours of every query, nearest first.

    With a ``batcher``, the engine call may be shared with concurrent requests; a
    request still queued after ``timeout_s`` is refused with DEADLINE_EXCEEDED.
    """
    checked = _check(dataset, lat, lon, k, max_distance_m, columns, limits)
    if batcher is None:
        found = dataset.index.knn(lat, lon, k, max_distance_m)
    else:
        found = batcher.knn(dataset.index, lat, lon, k, max_distance_m, timeout_s)
    return _rows(dataset, found, checked)


async def knn_async(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    k: int,
    *,
    max_distance_m: float | None = None,
    columns: Sequence[str] = (),
    limits: Limits,
    batcher: Batcher | None = None,
    timeout_s: float | None = None,
) -> NeighbourRows:
    """``knn`` for the server's event loop: the engine runs on another thread."""
    checked = _check(dataset, lat, lon, k, max_distance_m, columns, limits)
    if batcher is None:
        found = await asyncio.to_thread(dataset.index.knn, lat, lon, k, max_distance_m)
    else:
        found = await batcher.knn_async(dataset.index, lat, lon, k, max_distance_m, timeout_s)
    return _rows(dataset, found, checked)


def _check(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    k: int,
    max_distance_m: float | None,
    columns: Sequence[str],
    limits: Limits,
) -> tuple[str, ...]:
    """The checked attribute columns; raises on a bad k, bound, query or column."""
    if k < 1:
        raise InvalidInput(f"k must be at least 1, got {k}")
    if k > limits.max_k:
        raise LimitExceeded(f"k={k} exceeds max_k={limits.max_k} (setting GEONEAR_MAX_K)")
    if max_distance_m is not None and not (np.isfinite(max_distance_m) and max_distance_m >= 0):
        raise InvalidInput(f"max_distance_m must be a finite number >= 0, got {max_distance_m}")
    check_queries(lat, lon, limits)
    return tuple(check_columns(dataset, columns))


def _rows(dataset: DatasetVersion, found: Neighbours, columns: tuple[str, ...]) -> NeighbourRows:
    valid = found.indices >= 0
    query_index, rank = np.nonzero(valid)
    return NeighbourRows(
        dataset,
        query_index.astype(np.int64, copy=False),
        rank.astype(np.int32),
        found.indices[valid],
        found.distances_m[valid],
        columns,
    )
