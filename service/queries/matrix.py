"""Distance matrices, computed and streamed in tiles of bounded size."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from geonear.service.engines import Capability, Engine, require
from geonear.service.engines.base import MatrixDtype
from geonear.service.errors import Cancelled, LimitExceeded
from geonear.service.queries.common import check_queries
from geonear.service.settings import Limits
from geonear.service.validation import check_coordinates

#: Bytes of one tile on the wire: well under the message limit.
TILE_BYTES = 2 << 20


@dataclass(frozen=True)
class Tile:
    row_start: int
    col_start: int
    values: np.ndarray  # (rows, cols), metres


def check_matrix(n_rows: int, n_cols: int, limits: Limits) -> None:
    """Refuse a matrix beyond the cell limit before any work starts."""
    cells = n_rows * n_cols
    if cells > limits.max_matrix_cells:
        raise LimitExceeded(
            f"a {n_rows} x {n_cols} matrix has {cells} cells, more than "
            f"max_matrix_cells={limits.max_matrix_cells} (setting GEONEAR_MAX_MATRIX_CELLS); "
            "ask for fewer rows or columns"
        )


def distance_tiles(
    engine: Engine,
    lat1: np.ndarray,
    lon1: np.ndarray,
    lat2: np.ndarray,
    lon2: np.ndarray,
    dtype: MatrixDtype,
    limits: Limits,
    is_active: Callable[[], bool] = lambda: True,
) -> Iterator[Tile]:
    """Tiles covering the (len(lat1) x len(lat2)) matrix once, row-major tile order.

    ``is_active`` is checked between tiles: when the caller is gone, work stops.
    """
    require(engine.name, Capability.MATRIX, "a distance matrix")
    check_queries(lat1, lon1, limits)
    check_coordinates(lat2, lon2, "matrix columns")
    check_matrix(lat1.shape[0], lat2.shape[0], limits)
    itemsize = np.dtype(dtype).itemsize
    cols_per_tile = max(1, min(lat2.shape[0], TILE_BYTES // itemsize))
    rows_per_tile = max(1, TILE_BYTES // (itemsize * cols_per_tile))
    for r in range(0, lat1.shape[0], rows_per_tile):
        for c in range(0, lat2.shape[0], cols_per_tile):
            if not is_active():
                raise Cancelled("the distance matrix call was cancelled")
            values = engine.distance_matrix(
                lat1[r : r + rows_per_tile],
                lon1[r : r + rows_per_tile],
                lat2[c : c + cols_per_tile],
                lon2[c : c + cols_per_tile],
                dtype,
            )
            yield Tile(r, c, values)
