"""Radius queries: every dataset point within radius_m of each query point."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from geonear.service.batching import Batcher
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
    if not (np.isfinite(radius_m) and radius_m >= 0):
        raise InvalidInput(f"radius_m must be a finite number >= 0, got {radius_m}")
    check_queries(lat, lon, limits)
    checked = tuple(check_columns(dataset, columns))
    if batcher is None:
        found = dataset.index.radius(lat, lon, radius_m)
    else:
        found = batcher.radius(dataset.index, lat, lon, radius_m, timeout_s)
    query_index = found.query_index
    rank = np.arange(query_index.shape[0], dtype=np.int64) - found.offsets[query_index]
    return NeighbourRows(
        dataset, query_index, rank.astype(np.int32), found.indices, found.distances_m, checked
    )
