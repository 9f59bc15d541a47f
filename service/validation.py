"""Validation of untrusted input before anything is stored or computed.

Uploaded tables are checked whole (columns, types, coordinates, ids) and rejected with
a message that counts the bad rows and shows the first few with their row numbers.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from geonear.service.errors import InvalidInput

#: A dataset's name is also its folder in the data directory: a letter or digit first,
#: so that no name is ``.``, ``..`` or a hidden file, or starts like the data
#: directory's own entries (``_partitions``).
DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
#: Entries of the data directory that are not datasets: the store's manifest and its
#: temporary file, the Dask engine's partition folder. Compared ignoring case, as a
#: case-insensitive file system would.
DATA_DIR_ENTRIES = frozenset({"manifest.json", "manifest.json.tmp", "_partitions"})
#: Columns the service owns; attribute columns may not reuse these names.
RESERVED = ("id", "lat", "lon")
_SHOW = 5
_SHOW_NAME_CHARS = 64


def check_dataset_name(name: str) -> str:
    """Raise InvalidInput unless ``name`` may name a new dataset."""
    if not DATASET_NAME.fullmatch(name or ""):
        raise InvalidInput(
            f"invalid dataset name {shown_name(name)}: use 1 to 128 characters from "
            "[A-Za-z0-9_.-], starting with a letter or digit"
        )
    if name.casefold() in DATA_DIR_ENTRIES:
        raise InvalidInput(
            f"invalid dataset name {name!r}: the data directory keeps its own "
            f"{name.casefold()!r} there; choose another name"
        )
    return name


def shown_name(name: str) -> str:
    """``name`` quoted for a message, cut short: a status message travels in a header."""
    if len(name) <= _SHOW_NAME_CHARS:
        return repr(name)
    return f"{name[: _SHOW_NAME_CHARS // 2]!r}... ({len(name)} characters)"


def _bad_rows_message(what: str, rows: np.ndarray, values: list[str]) -> str:
    shown = ", ".join(
        f"row {int(r)}: {v}" for r, v in zip(rows[:_SHOW], values[:_SHOW], strict=False)
    )
    return f"{rows.shape[0]} row(s) with {what} (first: {shown})"


def check_coordinates(lat: np.ndarray, lon: np.ndarray, what: str = "points") -> None:
    """Raise InvalidInput unless every coordinate is finite and in range (degrees)."""
    if lat.shape != lon.shape:
        raise InvalidInput(f"{what}: lat and lon differ in length ({lat.size} != {lon.size})")
    bad = ~(np.isfinite(lat) & np.isfinite(lon) & (np.abs(lat) <= 90.0) & (np.abs(lon) <= 180.0))
    if bad.any():
        rows = np.flatnonzero(bad)
        values = [f"lat={float(lat[r])!r} lon={float(lon[r])!r}" for r in rows[:_SHOW]]
        raise InvalidInput(
            f"{what}: "
            + _bad_rows_message("invalid coordinates", rows, values)
            + "; latitude must be finite in [-90, 90] and longitude in [-180, 180] degrees"
        )


def _numeric_column(table: pa.Table, name: str, role: str) -> pa.ChunkedArray:
    col = table.column(name)
    if not (
        pa.types.is_floating(col.type)
        or pa.types.is_integer(col.type)
        or pa.types.is_decimal(col.type)
    ):
        raise InvalidInput(f"{role} column {name!r} must be numeric, got {col.type}")
    if col.null_count:
        rows = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
        raise InvalidInput(
            f"{role} column {name!r}: " + _bad_rows_message("null values", rows, ["null"] * _SHOW)
        )
    try:
        return pc.cast(col, pa.float64())
    except pa.ArrowInvalid as exc:
        raise InvalidInput(f"{role} column {name!r} cannot be read as float64: {exc}") from exc


def _pick(table: pa.Table, wanted: str, role: str) -> str:
    if wanted in table.column_names:
        return wanted
    raise InvalidInput(
        f"no {role} column {wanted!r} in the upload; columns found: "
        f"{', '.join(table.column_names) or '(none)'}; name it with the {role}_column option"
    )


def ids_are_row_numbers(table: pa.Table, id_column: str = "id") -> bool:
    """True when the upload has no id column (under the default name): rows get numbers."""
    return id_column in ("", "id") and "id" not in table.column_names


def normalise_upload(
    table: pa.Table,
    lat_column: str = "lat",
    lon_column: str = "lon",
    id_column: str = "id",
    first_row_id: int = 0,
) -> pa.Table:
    """The upload as stored: columns id, lat (float64), lon (float64), then attributes.

    Without an id column (and with the default name ``id``), row numbers starting at
    ``first_row_id`` become ids. Raises InvalidInput naming what is wrong.
    """
    if table.num_rows == 0:
        raise InvalidInput("the upload holds no rows")
    names = table.column_names
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise InvalidInput(f"column names appear more than once: {', '.join(map(repr, repeated))}")
    lat_name = _pick(table, lat_column or "lat", "lat")
    lon_name = _pick(table, lon_column or "lon", "lon")
    id_name = id_column or "id"
    if ids_are_row_numbers(table, id_column):
        ids = pa.chunked_array(
            [pa.array(np.arange(first_row_id, first_row_id + table.num_rows, dtype=np.int64))]
        )
    else:
        ids = table.column(_pick(table, id_name, "id"))
        if pa.types.is_integer(ids.type):
            try:
                ids = pc.cast(ids, pa.int64())
            except pa.ArrowInvalid as exc:
                raise InvalidInput(f"id column {id_name!r}: ids must fit in int64 ({exc})") from exc
        elif pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
            ids = pc.cast(ids, pa.string())
        else:
            raise InvalidInput(f"id column {id_name!r} must be integer or string, got {ids.type}")
        if ids.null_count:
            rows = np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))
            raise InvalidInput(
                f"id column {id_name!r}: " + _bad_rows_message("null ids", rows, ["null"] * _SHOW)
            )
    lat = _numeric_column(table, lat_name, "lat")
    lon = _numeric_column(table, lon_name, "lon")
    check_coordinates(lat.to_numpy(), lon.to_numpy(), "upload")
    columns = {"id": ids, "lat": lat, "lon": lon}
    for name in table.column_names:
        if name in (lat_name, lon_name, id_name):
            continue
        if name in RESERVED:
            raise InvalidInput(
                f"attribute column {name!r} clashes with a stored column; rename it or map "
                f"it as the {name} column"
            )
        columns[name] = table.column(name)
    return pa.table(columns).combine_chunks()


def check_unique_ids(ids: pa.ChunkedArray | pa.Array) -> None:
    """Raise InvalidInput when an id appears more than once."""
    counts = pc.value_counts(ids)
    values, freq = counts.field("values"), counts.field("counts").to_numpy()
    dup = np.flatnonzero(freq > 1)
    if dup.size:
        shown = ", ".join(repr(values[int(i)].as_py()) for i in dup[:_SHOW])
        raise InvalidInput(
            f"{dup.size} id(s) appear more than once (first: {shown}); "
            "ids must be unique within a dataset"
        )
