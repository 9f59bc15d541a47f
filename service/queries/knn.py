"""KNN queries: the k nearest dataset points of each query point."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from geonear.service.errors import InvalidInput, LimitExceeded
from geonear.service.queries.common import check_columns, check_queries, neighbour_table
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
    earth_radius_m: float,
) -> pa.Table:
    """Neighbours of every query as a table, nearest first; see ``neighbour_table``."""
    if k < 1:
        raise InvalidInput(f"k must be at least 1, got {k}")
    if k > limits.max_k:
        raise LimitExceeded(f"k={k} exceeds max_k={limits.max_k} (setting GEONEAR_MAX_K)")
    if max_distance_m is not None and not (np.isfinite(max_distance_m) and max_distance_m >= 0):
        raise InvalidInput(f"max_distance_m must be a finite number >= 0, got {max_distance_m}")
    check_queries(lat, lon, limits)
    columns = check_columns(dataset, columns)
    found = dataset.index.knn(lat, lon, k, max_distance_m)
    valid = found.indices >= 0
    query_index, rank = np.nonzero(valid)
    return neighbour_table(
        dataset,
        query_index,
        rank,
        found.indices[valid],
        found.distances_m[valid],
        columns,
        earth_radius_m,
    )
