"""Radius queries: every dataset point within radius_m of each query point."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from geonear.service.batching import Batcher
from geonear.service.engines import RadiusNeighbours
from geonear.service.errors import InvalidInput
from geonear.service.queries.common import NeighbourRows, check_columns, check_queries
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion


def radius(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    *,
    columns: Sequence[str] = (),
    limits: Limits,
    batcher: Batcher | None = None,
    timeout_s: float | None = None,
) -> NeighbourRows:
    """Points within ``radius_m`` of each query, nearest first per query (see ``knn``)."""
    checked = _check(dataset, lat, lon, radius_m, columns, limits)
    if batcher is None:
        found = dataset.index.radius(lat, lon, radius_m)
    else:
        found = batcher.radius(dataset.index, lat, lon, radius_m, timeout_s)
    return _rows(dataset, found, checked)


async def radius_async(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    *,
    columns: Sequence[str] = (),
    limits: Limits,
    batcher: Batcher | None = None,
    timeout_s: float | None = None,
) -> NeighbourRows:
    """``radius`` for the server's event loop: the engine runs on another thread."""
    checked = _check(dataset, lat, lon, radius_m, columns, limits)
    if batcher is None:
        found = await asyncio.to_thread(dataset.index.radius, lat, lon, radius_m)
    else:
        found = await batcher.radius_async(dataset.index, lat, lon, radius_m, timeout_s)
    return _rows(dataset, found, checked)


def _check(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    columns: Sequence[str],
    limits: Limits,
) -> tuple[str, ...]:
    if not (np.isfinite(radius_m) and radius_m >= 0):
        raise InvalidInput(f"radius_m must be a finite number >= 0, got {radius_m}")
    check_queries(lat, lon, limits)
    return tuple(check_columns(dataset, columns))


def _rows(
    dataset: DatasetVersion, found: RadiusNeighbours, columns: tuple[str, ...]
) -> NeighbourRows:
    query_index = found.query_index
    rank = np.arange(query_index.shape[0], dtype=np.int64) - found.offsets[query_index]
    return NeighbourRows(
        dataset, query_index, rank.astype(np.int32), found.indices, found.distances_m, columns
    )
