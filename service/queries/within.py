"""The points of a dataset inside an area: a latitude/longitude box or a spherical
polygon (``geonear.service.analytics.areas``), optionally only those a filter selects.

The rows are found once (the area's mask over the selected points), counted against
``max_result_rows``, then their columns are gathered and sent a slice at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from geonear.service.analytics.areas import (
    Area,
    Bbox,
    InvalidArea,
    SphericalPolygon,
)
from geonear.service.errors import Cancelled, InvalidInput
from geonear.service.queries.common import (
    SLICE_ROWS,
    check_columns,
    check_result_rows,
    take_columns,
)
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion


def bbox_area(min_lat: float, min_lon: float, max_lat: float, max_lon: float) -> Bbox:
    """A box, degrees; ``min_lon > max_lon`` crosses the antimeridian."""
    try:
        return Bbox(min_lat, min_lon, max_lat, max_lon)
    except InvalidArea as exc:
        raise InvalidInput(str(exc)) from exc


def polygon_area(*, geojson: bytes | None = None, wkb: bytes | None = None) -> SphericalPolygon:
    """A polygon from GeoJSON text (UTF-8) or WKB; INVALID_ARGUMENT with the reason."""
    try:
        if geojson is not None:
            return SphericalPolygon.from_geojson(geojson.decode("utf-8"))
        assert wkb is not None
        return SphericalPolygon.from_wkb(wkb)
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"polygon: GeoJSON must be UTF-8 text ({exc})") from exc
    except (InvalidArea, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidInput(f"polygon: {exc}") from exc


@dataclass(frozen=True)
class WithinQuery:
    """The dataset rows inside the area (and selected), in row order, and the columns."""

    dataset: DatasetVersion
    rows: np.ndarray
    columns: tuple[str, ...]


def within_query(
    dataset: DatasetVersion,
    area: Area,
    *,
    selected: np.ndarray | None = None,
    columns: Sequence[str] = (),
    limits: Limits,
) -> WithinQuery:
    """The rows of ``dataset`` in ``area`` among ``selected`` (None: every row); more
    than ``max_result_rows`` is refused before any column is gathered."""
    returned = [name for name in columns if name in ("lat", "lon")]
    if returned:
        raise InvalidInput(f"column {returned[0]!r} is always returned; ask only for attributes")
    names = tuple(check_columns(dataset, columns))
    rows = dataset.index.area_rows(dataset.lat, dataset.lon, area, selected)
    check_result_rows(
        int(rows.shape[0]),
        limits,
        f"the points of {dataset.name!r} in the area",
        "use a smaller area or select fewer points with where",
    )
    return WithinQuery(dataset, rows.astype(np.int64, copy=False), names)


def within_tables(
    query: WithinQuery, is_active: Callable[[], bool] = lambda: True
) -> Iterator[pa.Table]:
    """The answer a slice of rows at a time: id, lat, lon, then the requested columns."""
    n = int(query.rows.shape[0])
    dataset = query.dataset
    metadata = {"geonear.dataset": dataset.name, "geonear.version": str(dataset.version)}
    names = ("id", "lat", "lon", *query.columns)
    for start in range(0, max(1, n), SLICE_ROWS):
        if not is_active():
            raise Cancelled("the call was cancelled; sending the points stopped")
        rows = query.rows[start : start + SLICE_ROWS]
        taken = take_columns(query.dataset, names, rows)
        yield pa.table({name: taken[name] for name in names}).replace_schema_metadata(metadata)
