"""Radius queries: every dataset point within radius_m of each query point."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from geonear.service.errors import InvalidInput
from geonear.service.queries.common import check_columns, check_queries, neighbour_table
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
    earth_radius_m: float,
) -> pa.Table:
    """Points within ``radius_m`` of each query, nearest first per query."""
    if not (np.isfinite(radius_m) and radius_m >= 0):
        raise InvalidInput(f"radius_m must be a finite number >= 0, got {radius_m}")
    check_queries(lat, lon, limits)
    columns = check_columns(dataset, columns)
    found = dataset.index.radius(lat, lon, radius_m)
    query_index = found.query_index
    rank = np.arange(query_index.shape[0], dtype=np.int64) - found.offsets[query_index]
    return neighbour_table(
        dataset, query_index, rank, found.indices, found.distances_m, columns, earth_radius_m
    )
