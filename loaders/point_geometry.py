"""Point geometries decoded into lat and lon columns: GeoParquet and GeoArrow (WKB or
GeoArrow point encodings) and GeoPandas GeoDataFrames."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from geonear.loaders.source import Source, batch_reader

_WKB_TYPES = {
    1: "Point",
    2: "LineString",
    3: "Polygon",
    4: "MultiPoint",
    5: "MultiLineString",
    6: "MultiPolygon",
    7: "GeometryCollection",
}


def _extension_name(field: pa.Field) -> str | None:
    if isinstance(field.type, pa.ExtensionType):
        return field.type.extension_name
    meta = field.metadata or {}
    name = meta.get(b"ARROW:extension:name")
    return name.decode() if name else None


def _check_crs(crs: Any, column: str) -> None:
    """Raise unless ``crs`` is longitude/latitude on WGS84 (GeoParquet's default)."""
    if crs is None:
        return
    if isinstance(crs, str):
        if crs.upper() in ("OGC:CRS84", "EPSG:4326", "WGS84", "CRS84"):
            return
    elif isinstance(crs, dict):
        ident = crs.get("id") or {}
        if (str(ident.get("authority", "")).upper(), str(ident.get("code", ""))) in (
            ("EPSG", "4326"),
            ("OGC", "CRS84"),
        ):
            return
        if crs.get("type") == "GeographicCRS" and "WGS 84" in str(crs.get("name", "")):
            return
    name = crs.get("name") if isinstance(crs, dict) else crs
    raise ValueError(
        f"geometry column {column!r} uses CRS {name!r}; geonear needs "
        "longitude/latitude on WGS84 (EPSG:4326): reproject it first"
    )


def _geometry_column(schema: pa.Schema) -> tuple[str, str] | None:
    """(column, encoding) of the point geometry to decode, or None."""
    geo = (schema.metadata or {}).get(b"geo")
    if geo:
        try:
            meta = json.loads(geo)
            column = meta.get("primary_column") or next(iter(meta["columns"]))
            info = meta["columns"][column]
        except (ValueError, KeyError, StopIteration, TypeError) as exc:
            raise ValueError(f"invalid GeoParquet metadata: {exc}") from exc
        if column in schema.names:
            _check_crs(info.get("crs"), column)
            encoding = str(info.get("encoding", "WKB")).lower()
            if encoding not in ("wkb", "point"):
                raise ValueError(
                    f"geometry column {column!r} is encoded as {encoding}; "
                    "only point geometries (WKB or GeoArrow point) load"
                )
            return column, encoding
    for field in schema:
        ext = _extension_name(field)
        if ext in ("geoarrow.wkb", "geoarrow.point", "ogc.wkb"):
            meta = field.metadata or {}
            ext_meta = meta.get(b"ARROW:extension:metadata")
            if ext_meta:
                try:
                    _check_crs(json.loads(ext_meta).get("crs"), field.name)
                except ValueError as exc:
                    if "CRS" in str(exc):
                        raise
            return field.name, "point" if ext == "geoarrow.point" else "wkb"
    return None


def decode_wkb_points(array: pa.Array, first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(lon, lat) float64 of WKB or EWKB points; null geometries give NaN.

    Reads the byte order, type and first two coordinates of every value with NumPy;
    ISO (1001, 2001, 3001) and EWKB (Z/M/SRID flags) point types are accepted.

    Raises
    ------
    ValueError
        Some value is not a point; the message gives the first rows and their types.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if isinstance(array.type, pa.ExtensionType):
        array = array.storage
    offset_type: type[np.integer[Any]]
    if pa.types.is_large_binary(array.type):
        offset_type = np.int64
    elif pa.types.is_binary(array.type):
        offset_type = np.int32
    else:
        raise ValueError(f"WKB geometry must be binary, got {array.type}")
    n = len(array)
    lon = np.full(n, np.nan)
    lat = np.full(n, np.nan)
    if n == 0:
        return lon, lat
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[array.offset : array.offset + n + 1]
    data = (
        np.frombuffer(buffers[2], dtype=np.uint8)
        if buffers[2] is not None
        else np.empty(0, np.uint8)
    )
    valid = ~np.asarray(array.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    starts = offsets[:-1].astype(np.int64)
    lengths = np.diff(offsets).astype(np.int64)
    short = valid & (lengths < 21)
    if short.any():
        rows = np.flatnonzero(short)[:5] + first_row
        raise ValueError(
            f"{int(short.sum())} geometry value(s) too short for a WKB point "
            f"(rows {', '.join(map(str, rows))})"
        )
    rows = np.flatnonzero(valid)
    if rows.size == 0:
        return lon, lat
    s = starts[rows]
    little = data[s] == 1

    def gather(at: np.ndarray, width: int, kind: str) -> np.ndarray:
        raw = data[at[:, None] + np.arange(width)]
        le = np.ascontiguousarray(raw).view(f"<{kind}{width}").ravel()
        be = np.ascontiguousarray(raw).view(f">{kind}{width}").ravel()
        return np.where(little, le, be)

    geom_type = gather(s + 1, 4, "u").astype(np.int64)
    has_srid = (geom_type & 0x20000000) != 0
    base = (geom_type & 0x1FFFFFFF) % 1000
    not_point = base != 1
    if not_point.any():
        bad = np.flatnonzero(not_point)[:5]
        shown = ", ".join(
            f"row {int(rows[i]) + first_row}: "
            f"{_WKB_TYPES.get(int(base[i]), f'type {int(base[i])}')}"
            for i in bad
        )
        raise ValueError(
            f"{int(not_point.sum())} geometries are not points (first: {shown}); "
            "only Point geometries can be loaded"
        )
    at = s + 5 + 4 * has_srid
    too_short = lengths[rows] < (at - s) + 16
    if too_short.any():
        raise ValueError(
            f"{int(too_short.sum())} WKB points are truncated "
            f"(first row {int(rows[np.flatnonzero(too_short)[0]]) + first_row})"
        )
    lon[rows] = gather(at, 8, "f")
    lat[rows] = gather(at + 8, 8, "f")
    return lon, lat


def _decode_geoarrow_point(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if isinstance(array.type, pa.ExtensionType):
        array = array.storage
    null = np.asarray(array.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_struct(array.type):
        x = array.field("x").to_numpy(zero_copy_only=False).astype(np.float64)
        y = array.field("y").to_numpy(zero_copy_only=False).astype(np.float64)
    elif pa.types.is_fixed_size_list(array.type):
        width = array.type.list_size
        flat = array.flatten().to_numpy(zero_copy_only=False).astype(np.float64)
        full = np.full(len(array) * width, np.nan)
        full[np.repeat(~null, width)] = flat
        x, y = full[0::width], full[1::width]
    else:
        raise ValueError(
            f"GeoArrow point column must be a struct or fixed-size list, got {array.type}"
        )
    x = np.where(null, np.nan, x)
    y = np.where(null, np.nan, y)
    return x, y


def with_point_columns(
    reader: pa.RecordBatchReader,
    what: str,
    rows: int | None,
    batch_rows: int,
    total_bytes: int | None = None,
) -> Source:
    """Wrap ``reader`` so that a point geometry column becomes lat and lon columns."""
    found = _geometry_column(reader.schema)
    if found is None:
        return Source(
            batch_reader(reader.schema, reader, batch_rows),
            what,
            total_rows=rows,
            total_bytes=total_bytes,
        )
    column, encoding = found
    names = [n for n in reader.schema.names if n != column]
    lat_name = "lat" if "lat" not in names else "geometry_lat"
    lon_name = "lon" if "lon" not in names else "geometry_lon"
    fields = [reader.schema.field(n) for n in names]
    schema = pa.schema(
        [pa.field(lat_name, pa.float64()), pa.field(lon_name, pa.float64()), *fields],
        metadata=reader.schema.metadata,
    )
    index = reader.schema.get_field_index(column)

    def batches() -> Iterator[pa.RecordBatch]:
        row = 0
        for batch in reader:
            geom = batch.column(index)
            if encoding == "wkb":
                x, y = decode_wkb_points(geom, row)
            else:
                x, y = _decode_geoarrow_point(geom)
            columns = [pa.array(y), pa.array(x)] + [batch.column(n) for n in names]
            row += batch.num_rows
            yield pa.RecordBatch.from_arrays(columns, schema=schema)

    return Source(
        batch_reader(schema, batches(), batch_rows),
        what,
        total_rows=rows,
        total_bytes=total_bytes,
        geometry=(lat_name, lon_name),
    )


def from_table(table: pa.Table, batch_rows: int, what: str) -> Source:
    """An in-memory table as a source, its point geometry column (if any) decoded."""
    return with_point_columns(table.to_reader(batch_rows), what, table.num_rows, batch_rows)


def is_geodataframe(obj: Any) -> bool:
    return any(
        c.__module__.startswith("geopandas") and c.__name__ == "GeoDataFrame"
        for c in type(obj).__mro__
    )


def is_geoseries(obj: Any) -> bool:
    return any(
        c.__module__.startswith("geopandas") and c.__name__ == "GeoSeries"
        for c in type(obj).__mro__
    )


def _check_geopandas_crs(obj: Any) -> None:
    if obj.crs is not None and obj.crs.to_epsg() != 4326:
        kind = type(obj).__name__
        raise ValueError(
            f"the {kind}'s CRS is {obj.crs.to_string()}; geonear needs longitude/latitude "
            "on WGS84: convert it with .to_crs(4326) first"
        )


def geopandas_points(obj: Any, what: str = "points") -> tuple[np.ndarray, np.ndarray]:
    """(lat, lon) float64 degrees of a GeoSeries or GeoDataFrame of points.

    Raises ValueError for a CRS other than EPSG:4326 and for missing, empty or
    non-point geometries, naming the first such row.
    """
    geometry = obj.geometry if is_geodataframe(obj) else obj
    _check_geopandas_crs(geometry)
    kinds = np.asarray(geometry.geom_type, dtype=object)
    empty = np.asarray(geometry.is_empty, dtype=bool)
    bad = np.flatnonzero((kinds != "Point") | empty)
    if bad.size:
        i = int(bad[0])
        kind = "an empty geometry" if empty[i] else (kinds[i] or "a missing geometry")
        raise ValueError(
            f"{what} must be points: {bad.size:,} of {len(kinds):,} rows are not, the first "
            f"(row {i}) is {kind}; use .centroid or .representative_point() for other shapes"
        )
    return np.asarray(geometry.y, dtype=np.float64), np.asarray(geometry.x, dtype=np.float64)


def read_geopandas(frame: Any, batch_rows: int) -> Source:
    """A GeoDataFrame (or GeoSeries) of points: its active geometry decoded through WKB."""
    if is_geoseries(frame):
        frame = frame.to_frame(name=frame.name or "geometry")
    _check_geopandas_crs(frame)
    geometry = frame.geometry.name
    table = pa.Table.from_pandas(pd.DataFrame(frame.drop(columns=[geometry])), preserve_index=None)
    wkb = pa.array(frame.geometry.to_wkb(), pa.binary())
    table = table.append_column(pa.field(geometry, pa.binary()), wkb)
    meta = {
        b"geo": json.dumps(
            {"primary_column": geometry, "columns": {geometry: {"encoding": "WKB"}}}
        ).encode()
    }
    table = table.replace_schema_metadata(meta)
    source = from_table(table, batch_rows, "GeoDataFrame")
    return source
