"""Pieces every query kind shares: checking query points and shaping result tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from geonear.service.errors import DatasetNotFound, InvalidInput, LimitExceeded
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion
from geonear.service.validation import RESERVED, check_coordinates


def check_queries(lat: np.ndarray, lon: np.ndarray, limits: Limits) -> None:
    if lat.shape[0] > limits.max_query_points:
        raise LimitExceeded(
            f"{lat.shape[0]} query points exceed max_query_points={limits.max_query_points} "
            "(setting GEONEAR_MAX_QUERY_POINTS); send them in several requests"
        )
    check_coordinates(lat, lon, "query points")


def check_columns(dataset: DatasetVersion, columns: Sequence[str]) -> list[str]:
    """The requested attribute columns, each present in the dataset."""
    names = dataset.table.column_names
    out = []
    for name in columns:
        if name in RESERVED or name in ("query_index", "rank", "distance_m"):
            raise InvalidInput(f"column {name!r} is always returned; ask only for attributes")
        if name not in names:
            raise DatasetNotFound(
                f"dataset {dataset.name!r} has no column {name!r}; it has "
                f"{', '.join(n for n in names if n not in RESERVED) or 'no attributes'}"
            )
        out.append(name)
    return out


@dataclass(frozen=True)
class NeighbourRows:
    """Neighbour result rows in query order, nearest first per query.

    ``rows`` are dataset row numbers; ``table()`` adds ids and attribute columns.
    """

    dataset: DatasetVersion
    query_index: np.ndarray  # int64
    rank: np.ndarray  # int32
    rows: np.ndarray  # int64
    distances_m: np.ndarray  # float64
    columns: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return int(self.rows.shape[0])

    def ids(self) -> pa.Array | pa.ChunkedArray:
        return self._take(("id",))["id"]

    def table(self, earth_radius_m: float) -> pa.Table:
        """Result rows: query_index, rank, id, distance_m, then the requested attributes."""
        taken = self._take(("id", *self.columns))
        data = {
            "query_index": pa.array(self.query_index, type=pa.int64()),
            "rank": pa.array(self.rank, type=pa.int32()),
            "id": taken["id"],
            "distance_m": pa.array(self.distances_m, type=pa.float64()),
        }
        for name in self.columns:
            data[name] = taken[name]
        metadata = {
            "geonear.dataset": self.dataset.name,
            "geonear.version": str(self.dataset.version),
            "geonear.earth_radius_m": repr(earth_radius_m),
        }
        return pa.table(data).replace_schema_metadata(metadata)

    def _take(self, names: tuple[str, ...]) -> dict[str, pa.Array | pa.ChunkedArray]:
        """Columns ``names`` at the result rows: where the index holds them, else the host."""
        taken: dict[str, pa.Array | pa.ChunkedArray] = dict(
            self.dataset.index.take_columns(names, self.rows)
        )
        rest = [name for name in names if name not in taken]
        if rest:
            rows = pa.array(self.rows, type=pa.int64())
            for name in rest:
                taken[name] = self.dataset.table.column(name).take(rows)
        return taken
