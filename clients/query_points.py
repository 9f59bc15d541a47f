"""Query points as the client takes them, and what of them comes back with the results.

Queries are latitude and longitude in degrees: two scalars or array-likes, or one
pandas DataFrame (lat/lon columns detected as ``geonear load`` detects them), GeoPandas
GeoDataFrame or GeoSeries of points. A DataFrame's or Series' index comes back as the
index of the result rows (repeated for each neighbour, as ``geopandas.sjoin_nearest``
does); ``query_columns`` copies columns of the query frame next to the neighbours.
``as_geo=True`` makes the result a GeoDataFrame (the optional extra ``geo``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from geonear.loaders.columns import detect_columns
from geonear.loaders.point_geometry import geopandas_points, is_geodataframe, is_geoseries

#: Query columns whose names would read as the neighbour's get this prefix, as do
#: columns whose names the result already uses.
QUERY_PREFIX = "query_"
_NEIGHBOUR_NAMES = ("lat", "lon", "geometry")


@functools.cache
def geopandas_module() -> Any:
    """geopandas, or an ImportError naming the extra that installs it (probed once)."""
    try:
        import geopandas
    except ImportError as exc:
        raise ImportError(
            "as_geo=True needs geopandas: pip install 'geonear[geo]' (or pip install geopandas)"
        ) from exc
    return geopandas


def is_point_frame(obj: Any) -> bool:
    """Whether ``obj`` holds whole query points (a frame or a GeoSeries), not one axis."""
    return isinstance(obj, pd.DataFrame) or is_geoseries(obj)


@dataclass(frozen=True)
class Queries:
    """Query points as float64 arrays, with what the results may carry of their source.

    ``index`` is the labels of the queries (a DataFrame's or Series' index), ``frame``
    the query table whose columns ``query_columns`` may copy.
    """

    lat: np.ndarray
    lon: np.ndarray
    index: pd.Index | None = None
    frame: pd.DataFrame | None = None

    def __len__(self) -> int:
        return int(self.lat.shape[0])


def as_points(lat: Any, lon: Any) -> tuple[np.ndarray, np.ndarray]:
    """(lat, lon) as 1-D float64 arrays of one length."""
    try:
        lat_a = np.atleast_1d(np.asarray(lat, dtype=np.float64))
        lon_a = np.atleast_1d(np.asarray(lon, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"lat and lon must be numbers, degrees ({exc}): use a decimal point (40.7); "
            "give several points as lists or arrays"
        ) from exc
    if lat_a.shape != lon_a.shape or lat_a.ndim != 1:
        raise ValueError(
            f"lat and lon must be 1-D of one length, got {lat_a.shape} and {lon_a.shape}"
        )
    return lat_a, lon_a


def queries(lat: Any, lon: Any = None, what: str = "queries") -> Queries:
    """The query points of ``(lat, lon)`` or of one frame / GeoSeries given as ``lat``."""
    if lon is None:
        if is_geodataframe(lat) or is_geoseries(lat):
            lat_a, lon_a = geopandas_points(lat, what)
            frame = lat if is_geodataframe(lat) else lat.to_frame(name=lat.name or "geometry")
            return Queries(lat_a, lon_a, lat.index, pd.DataFrame(frame))
        if isinstance(lat, pd.DataFrame):
            names = [str(c) for c in lat.columns]
            mapping = detect_columns(names, id=False)
            columns = dict(zip(names, lat.columns, strict=True))
            lat_a = _numeric(lat[columns[mapping.lat]], mapping.lat, what)
            lon_a = _numeric(lat[columns[mapping.lon]], mapping.lon, what)
            return Queries(lat_a, lon_a, lat.index, lat)
        raise TypeError(
            f"{what}: give lat and lon (degrees), or one pandas DataFrame with lat/lon "
            f"columns, GeoDataFrame or GeoSeries of points; got lat={type(lat).__name__} "
            "and no lon"
        )
    if is_point_frame(lat) or is_geodataframe(lat):
        raise TypeError(
            f"{what} given as a {type(lat).__name__} take no separate lon; pass the other "
            "arguments by keyword (k=5, radius_m=1000)"
        )
    lat_a, lon_a = as_points(lat, lon)
    index = None
    for axis in (lat, lon):
        if isinstance(axis, pd.Series) and len(axis) == lat_a.shape[0]:
            index = axis.index
            break
    return Queries(lat_a, lon_a, index)


def _numeric(column: pd.Series, name: str, what: str) -> np.ndarray:
    try:
        return np.asarray(pd.to_numeric(column), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{what}: column {name!r} must hold numbers (degrees): {exc}. "
            "A value like '40,7' needs a decimal point (40.7)"
        ) from exc


def query_column_names(found: Queries, query_columns: Any) -> list[str]:
    """The query frame's columns that ``query_columns`` asks for, checked."""
    if query_columns is None or query_columns is False:
        return []
    if found.frame is None:
        raise ValueError(
            "query_columns needs the queries as a DataFrame, GeoDataFrame or GeoSeries"
        )
    names = {str(c): c for c in found.frame.columns}
    if query_columns is True:
        return list(names)
    wanted = [query_columns] if isinstance(query_columns, str) else list(query_columns)
    missing = [c for c in wanted if c not in names]
    if missing:
        raise KeyError(
            f"the queries have no column {missing[0]!r}; they have {', '.join(names) or '(none)'}"
        )
    return wanted


def _output_name(name: str, taken: Sequence[str]) -> str:
    if name in taken or name in _NEIGHBOUR_NAMES:
        return QUERY_PREFIX + name
    return name


def attach_queries(
    table: pa.Table,
    found: Queries,
    query_columns: Any = None,
    *,
    as_arrow: bool = False,
    as_geo: bool = False,
) -> pd.DataFrame | pa.Table:
    """The result table as asked: Arrow, pandas or GeoPandas, with the queries' part.

    Each result row's query is ``query_index`` (0-based position in the queries). A
    frame result takes the queries' index for its rows; query columns are appended,
    named ``query_NAME`` where NAME is taken by the result or is lat, lon or geometry.
    ``as_geo`` makes a GeoDataFrame whose geometry is each row's query point.
    """
    names = query_column_names(found, query_columns)
    if "query_index" in table.column_names:
        position = table.column("query_index").to_numpy()
    else:  # one row per query, in query order
        position = np.arange(table.num_rows)
    if as_arrow:
        if as_geo:
            raise ValueError("as_arrow and as_geo exclude each other")
        assert found.frame is not None or not names
        for name in names:
            values = found.frame[name].take(position) if found.frame is not None else None
            table = table.append_column(
                _output_name(name, table.column_names), pa.array(values, from_pandas=True)
            )
        return table
    frame = table.to_pandas()
    if found.index is not None:
        frame.index = found.index.take(position)
    for name in names:
        assert found.frame is not None
        frame[_output_name(name, list(frame.columns))] = found.frame[name].array.take(position)
    if not as_geo:
        return frame
    geopandas = geopandas_module()
    geometry = geopandas.points_from_xy(found.lon[position], found.lat[position], crs="EPSG:4326")
    return geopandas.GeoDataFrame(frame, geometry=geometry, crs="EPSG:4326")
