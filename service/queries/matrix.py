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
#: Bytes one engine call computes, cut into tiles to send: a device engine pays a fixed
#: cost a call (launch, output buffer, copy back), which a 2 MB tile pays once per 2 MB.
BLOCK_BYTES = 32 * TILE_BYTES


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
    """Tiles covering the (len(lat1) x len(lat2)) matrix once, row-major tile order,
    computed ``BLOCK_BYTES`` at a time.

    ``is_active`` is checked between blocks: when the caller is gone, work stops.
    """
    require(engine.name, Capability.MATRIX, "a distance matrix")
    check_queries(lat1, lon1, limits)
    check_coordinates(lat2, lon2, "matrix columns")
    check_matrix(lat1.shape[0], lat2.shape[0], limits)
    itemsize = np.dtype(dtype).itemsize
    n_rows, n_cols = int(lat1.shape[0]), int(lat2.shape[0])
    cols_per_tile = max(1, min(n_cols, TILE_BYTES // itemsize))
    rows_per_tile = max(1, TILE_BYTES // (itemsize * cols_per_tile))
    row_bytes = rows_per_tile * n_cols * itemsize  # one row of tiles
    if row_bytes <= BLOCK_BYTES:  # a block: as many whole rows of tiles as fit
        block_rows = rows_per_tile * (BLOCK_BYTES // max(1, row_bytes))
        block_cols = max(1, n_cols)
    else:
        block_rows, block_cols = rows_per_tile, cols_per_tile
    for r in range(0, n_rows, block_rows):
        for c in range(0, n_cols, block_cols):
            if not is_active():
                raise Cancelled("the distance matrix call was cancelled")
            block = engine.distance_matrix(
                lat1[r : r + block_rows],
                lon1[r : r + block_rows],
                lat2[c : c + block_cols],
                lon2[c : c + block_cols],
                dtype,
            )
            # Cut in row-major tile order (a block of whole rows keeps the matrix's).
            for tr in range(0, block.shape[0], rows_per_tile):
                for tc in range(0, block.shape[1], cols_per_tile):
                    values = block[tr : tr + rows_per_tile, tc : tc + cols_per_tile]
                    yield Tile(r + tr, c + tc, values)
