"""Readers: every supported source as a stream of Arrow record batches.

:func:`open_source` takes a path, a glob, a directory, ``"-"`` (CSV on standard input),
a bundled data set's name or an in-memory object (pandas or GeoPandas DataFrame,
pyarrow Table, RecordBatch, RecordBatchReader or Dataset, anything with
``__arrow_c_stream__``) and returns a :class:`Source` whose reader yields record
batches of at most ``batch_rows`` rows, so that a file larger than memory streams.

Formats: CSV (any delimiter, header detected), Parquet, Arrow IPC file or stream
(Feather v2), GeoJSON (FeatureCollection, Feature or newline-delimited features; Point
geometries) and GeoParquet (WKB or GeoArrow point geometries). Point geometries are
decoded into ``lat``/``lon`` columns that :class:`Source.geometry` names.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from geonear.loaders.columns import coordinate_candidates

#: Rows per record batch handed on; about 3 MiB of id, lat and lon.
BATCH_ROWS = 131_072
_SAMPLE_BYTES = 1 << 16
_EXTENSIONS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".tab": "csv",
    ".txt": "csv",
    ".psv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".geoparquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".arrows": "arrow",
    ".geojson": "geojson",
    ".json": "geojson",
    ".geojsonl": "geojson",
    ".geojsons": "geojson",
    ".geojsonseq": "geojson",
    ".ndjson": "geojson",
}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
FORMATS = ("csv", "parquet", "arrow", "geojson")
_DELIMITERS = (",", "\t", ";", "|")
_WKB_TYPES = {
    1: "Point",
    2: "LineString",
    3: "Polygon",
    4: "MultiPoint",
    5: "MultiLineString",
    6: "MultiPolygon",
    7: "GeometryCollection",
}


@dataclass
class Source:
    """An opened source: its batches and what is known about its size.

    Attributes
    ----------
    reader : pyarrow.RecordBatchReader
        The source's columns, batch by batch (at most ``batch_rows`` rows each).
    description : str
        What was opened, for messages ("CSV file pts.csv").
    total_rows : int or None
        Rows in the source when known without reading it (Parquet, Arrow, in memory).
    total_bytes : int or None
        Bytes of an uncompressed file when rows are not known (CSV), else None.
    bytes_read : callable or None
        Bytes of ``total_bytes`` read so far.
    geometry : (str, str) or None
        ``(lat, lon)`` column names decoded from a point geometry.
    """

    reader: pa.RecordBatchReader
    description: str
    total_rows: int | None = None
    total_bytes: int | None = None
    bytes_read: Callable[[], int] | None = None
    geometry: tuple[str, str] | None = None


# -- dispatch ------------------------------------------------------------------------------
def open_source(
    source: Any,
    *,
    format: str | None = None,
    delimiter: str | None = None,
    header: bool | None = None,
    lat: str | None = None,
    lon: str | None = None,
    batch_rows: int = BATCH_ROWS,
) -> Source:
    """Open ``source`` as a stream of record batches.

    Parameters
    ----------
    source : path, str, file object or in-memory table
        A file, a directory, a glob (``data/*.parquet``), ``"-"`` for CSV on standard
        input, a bundled data set's name (``airports``), a binary file object, or a
        pandas / GeoPandas DataFrame, pyarrow Table / RecordBatch / RecordBatchReader /
        Dataset or any object with ``__arrow_c_stream__``.
    format : {"csv", "parquet", "arrow", "geojson"}, optional
        Overrides detection by file extension (then by the file's first bytes).
    delimiter : str, optional
        CSV field delimiter; detected from the first lines when None.
    header : bool, optional
        Whether the CSV's first line names the columns; detected when None.
    lat, lon : str, optional
        Columns the caller maps as coordinates; CSV reads them as text so that a
        non-numeric value is reported by row instead of failing the whole read.
    batch_rows : int
        Largest batch handed on.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    csv_options = {"delimiter": delimiter, "header": header, "lat": lat, "lon": lon}
    if isinstance(source, str | os.PathLike):
        return _open_path(os.fspath(source), format, csv_options, batch_rows)
    if hasattr(source, "read") and not isinstance(source, pd.DataFrame):
        return _read_csv(source, "CSV stream", csv_options, batch_rows)
    return _open_object(source, batch_rows)


def _open_path(
    text: str, format: str | None, csv_options: dict[str, Any], batch_rows: int
) -> Source:
    if text == "-":
        return _read_csv(sys.stdin.buffer, "CSV on standard input", csv_options, batch_rows)
    path = Path(text)
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and _format_of(p, None) and not p.name.startswith((".", "_"))
        )
        if not files:
            raise FileNotFoundError(f"no readable files in directory {text}")
        return _open_files(files, format, csv_options, batch_rows, f"directory {text}")
    if path.is_file():
        return _open_files([path], format, csv_options, batch_rows, str(path))
    if glob.has_magic(text):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"no files match {text}")
        return _open_files(files, format, csv_options, batch_rows, f"files {text}")
    from geonear.loaders.bundled import DATA_SETS, load_bundled

    if text in DATA_SETS:
        table = load_bundled(text)
        return Source(
            table.to_reader(batch_rows), f"bundled data set {text}", total_rows=table.num_rows
        )
    raise FileNotFoundError(
        f"{text} is not a file, directory, glob or bundled data set "
        f"(bundled: {', '.join(DATA_SETS)})"
    )


def _format_of(path: Path, given: str | None) -> str | None:
    if given:
        return given
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return _EXTENSIONS.get(suffixes[-1]) if suffixes else None


def _sniff_format(path: Path) -> str:
    """Format from a file's first bytes, for files without a known extension."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith((b"ARROW1", b"\xff\xff\xff\xff")):
        return "arrow"
    if head.lstrip()[:1] in (b"{", b"\x1e"):
        return "geojson"
    return "csv"


def _open_files(
    files: Sequence[Path],
    format: str | None,
    csv_options: dict[str, Any],
    batch_rows: int,
    what: str,
) -> Source:
    formats = {_format_of(p, format) or _sniff_format(p) for p in files}
    if len(formats) > 1:
        raise ValueError(
            f"{what} mixes formats ({', '.join(sorted(formats))}); "
            "load one format at a time or pass format="
        )
    (fmt,) = formats
    if len(files) == 1:
        path = files[0]
        if fmt == "csv":
            return _read_csv(path, f"CSV file {path}", csv_options, batch_rows)
        if fmt == "parquet":
            return _read_parquet(path, batch_rows)
        if fmt == "arrow":
            return _read_arrow(path, batch_rows)
        return _read_geojson_files(files, batch_rows, f"GeoJSON file {path}")
    if fmt == "geojson":
        return _read_geojson_files(files, batch_rows, f"GeoJSON {what}")
    return _read_dataset(files, fmt, csv_options, batch_rows, what)


def _open_object(obj: Any, batch_rows: int) -> Source:
    if _is_geodataframe(obj):
        return _read_geopandas(obj, batch_rows)
    if isinstance(obj, pd.DataFrame):
        # A named index (e.g. set_index("id")) is kept as a column; a RangeIndex is not.
        table = pa.Table.from_pandas(obj)
        meta = table.schema.metadata or {}
        table = table.replace_schema_metadata({k: v for k, v in meta.items() if k != b"pandas"})
        return _from_table(table, batch_rows, "pandas DataFrame")
    if isinstance(obj, pa.RecordBatch):
        obj = pa.Table.from_batches([obj])
    if isinstance(obj, pa.Table):
        return _from_table(obj, batch_rows, "pyarrow Table")
    if isinstance(obj, ds.Dataset):
        scanner = obj.scanner(batch_size=batch_rows)
        return _with_geometry(scanner.to_reader(), "pyarrow Dataset", obj.count_rows(), batch_rows)
    if isinstance(obj, pa.RecordBatchReader):
        return _with_geometry(obj, "pyarrow RecordBatchReader", None, batch_rows)
    if hasattr(obj, "__arrow_c_stream__"):
        return _with_geometry(
            pa.RecordBatchReader.from_stream(obj), type(obj).__name__, None, batch_rows
        )
    raise TypeError(
        "cannot read points from a "
        f"{type(obj).__name__}: give a path, glob, '-', bundled name, pandas or GeoPandas "
        "DataFrame, or a pyarrow Table, RecordBatch, RecordBatchReader or Dataset"
    )


def _from_table(table: pa.Table, batch_rows: int, what: str) -> Source:
    return _with_geometry(table.to_reader(batch_rows), what, table.num_rows, batch_rows)


# -- batching ------------------------------------------------------------------------------
def _rechunk(batches: Iterable[pa.RecordBatch], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Batches of at most ``batch_rows`` rows (zero-copy slices of larger ones)."""
    for batch in batches:
        for start in range(0, batch.num_rows, batch_rows):
            yield batch.slice(start, batch_rows)


def _reader(
    schema: pa.Schema, batches: Iterable[pa.RecordBatch], batch_rows: int
) -> pa.RecordBatchReader:
    return pa.RecordBatchReader.from_batches(schema, _rechunk(batches, batch_rows))


# -- CSV -----------------------------------------------------------------------------------
class _Prefixed(io.RawIOBase):
    """A binary stream with bytes already read from it put back in front."""

    def __init__(self, prefix: bytes, rest: Any) -> None:
        self._prefix = memoryview(prefix)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._prefix.nbytes:
            n = min(len(buffer), self._prefix.nbytes)
            buffer[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def sniff_csv(
    sample: str, delimiter: str | None = None, header: bool | None = None
) -> tuple[str, bool, list[str]]:
    """(delimiter, has_header, first row's fields) of a CSV from its first lines.

    The delimiter is the candidate that splits every sampled line into the same number
    (more than one) of fields, the most fields winning. The first line is a header when
    some field of it is not a number while the same field of the next line is (or, for a
    one-line sample, when any field is not a number).
    """
    lines = sample.splitlines()
    if len(lines) > 1 and not sample.endswith(("\n", "\r")):
        lines = lines[:-1]  # the sample may end inside a line
    lines = [line for line in lines[:50] if line.strip()]
    if not lines:
        raise ValueError("the CSV input is empty")
    if delimiter is None:
        best: tuple[int, str] | None = None
        for cand in _DELIMITERS:
            counts = {len(row) for row in csv.reader(lines, delimiter=cand)}
            if len(counts) == 1 and (n := counts.pop()) > 1 and (best is None or n > best[0]):
                best = (n, cand)
        delimiter = best[1] if best else ","
    rows = list(csv.reader(lines[:2], delimiter=delimiter))
    if header is None:
        first = rows[0]
        if len(rows) > 1:
            header = any(
                not _is_number(a) and _is_number(b) for a, b in zip(first, rows[1], strict=False)
            )
            header = header or not any(_is_number(a) for a in first if a.strip())
        else:
            header = not all(_is_number(a) for a in first if a.strip())
    return delimiter, header, rows[0]


def _csv_names(sample_bytes: bytes, options: dict[str, Any]) -> tuple[str, bool, list[str]]:
    sample = sample_bytes.decode("utf-8", errors="replace").lstrip("\ufeff")
    delimiter, header, first = sniff_csv(sample, options["delimiter"], options["header"])
    names = [f.strip() for f in first] if header else [f"f{i}" for i in range(len(first))]
    return delimiter, header, names


def _csv_options(
    sample_bytes: bytes, options: dict[str, Any]
) -> tuple[pacsv.ReadOptions, pacsv.ParseOptions, pacsv.ConvertOptions]:
    delimiter, header, names = _csv_names(sample_bytes, options)
    text_columns = coordinate_candidates(names, options["lat"], options["lon"])
    return (
        # Arrow's streaming CSV reader reads a fixed number of blocks ahead: small blocks
        # keep that read-ahead (and so memory) to tens of MB whatever the file's size.
        pacsv.ReadOptions(column_names=names, skip_rows=1 if header else 0, block_size=1 << 20),
        pacsv.ParseOptions(delimiter=delimiter),
        # Coordinates are parsed later, by row, so a bad value is reported with its row.
        pacsv.ConvertOptions(column_types={c: pa.string() for c in text_columns}),
    )


def _read_csv(source: Path | Any, what: str, options: dict[str, Any], batch_rows: int) -> Source:
    """CSV from a file path (read natively) or a binary stream such as standard input."""
    size = None
    if isinstance(source, Path):
        with pa.input_stream(str(source), compression="detect") as f:
            sample_bytes = f.read(_SAMPLE_BYTES)
        stream: Any = pa.input_stream(str(source), compression="detect")
        if source.suffix.lower() not in _COMPRESSED:
            size = source.stat().st_size
    else:
        sample_bytes = source.read(_SAMPLE_BYTES)
        stream = io.BufferedReader(_Prefixed(sample_bytes, source), buffer_size=1 << 20)
    read_options, parse_options, convert_options = _csv_options(sample_bytes, options)
    try:
        reader = pacsv.open_csv(
            stream,
            read_options=read_options,
            parse_options=parse_options,
            convert_options=convert_options,
        )
    except pa.ArrowInvalid as exc:
        raise ValueError(f"cannot read {what}: {exc}") from exc

    def batches() -> Iterator[pa.RecordBatch]:
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as exc:
                raise ValueError(f"cannot read {what}: {exc}") from exc
            yield batch

    def bytes_read() -> int:
        try:
            return int(stream.tell())
        except (OSError, ValueError):
            return 0

    return Source(
        _reader(reader.schema, batches(), batch_rows),
        what,
        total_bytes=size,
        bytes_read=bytes_read if size else None,
    )


def _csv_format(path: Path, options: dict[str, Any]) -> ds.CsvFileFormat:
    with pa.input_stream(str(path), compression="detect") as f:
        sample_bytes = f.read(_SAMPLE_BYTES)
    read_options, parse_options, convert_options = _csv_options(sample_bytes, options)
    return ds.CsvFileFormat(
        parse_options=parse_options, read_options=read_options, convert_options=convert_options
    )


# -- Parquet, Arrow, datasets -----------------------------------------------------------
def _read_parquet(path: Path, batch_rows: int) -> Source:
    try:
        # Without pre-buffering, each row group's buffers are freed once decoded; with it,
        # memory grows with the file.
        file = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"cannot read Parquet file {path}: {exc}") from exc
    schema = file.schema_arrow
    reader = _reader(schema, file.iter_batches(batch_size=batch_rows), batch_rows)
    return _with_geometry(reader, f"Parquet file {path}", file.metadata.num_rows, batch_rows)


def _read_arrow(path: Path, batch_rows: int) -> Source:
    source = pa.memory_map(str(path))
    try:
        file = pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        try:
            stream = pa.ipc.open_stream(pa.memory_map(str(path)))
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{path} is neither an Arrow IPC file nor stream: {exc}") from exc
        return _with_geometry(
            _reader(stream.schema, stream, batch_rows), f"Arrow IPC stream {path}", None, batch_rows
        )
    rows = sum(file.get_batch(i).num_rows for i in range(file.num_record_batches))
    batches = (file.get_batch(i) for i in range(file.num_record_batches))
    return _with_geometry(
        _reader(file.schema, batches, batch_rows), f"Arrow IPC file {path}", rows, batch_rows
    )


def _read_dataset(
    files: Sequence[Path], fmt: str, csv_options: dict[str, Any], batch_rows: int, what: str
) -> Source:
    file_format: Any = "ipc"
    if fmt == "parquet":
        file_format = ds.ParquetFileFormat(
            default_fragment_scan_options=ds.ParquetFragmentScanOptions(
                pre_buffer=False, buffer_size=1 << 20
            )
        )
    elif fmt == "csv":
        file_format = _csv_format(files[0], csv_options)
    try:
        dataset = ds.dataset([str(p) for p in files], format=file_format)
        # Little read-ahead keeps memory bounded on large files.
        scanner = dataset.scanner(batch_size=batch_rows, batch_readahead=2, fragment_readahead=1)
        rows = dataset.count_rows() if fmt != "csv" else None
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"cannot read {what}: {exc}") from exc
    size = sum(p.stat().st_size for p in files) if fmt == "csv" else None
    return _with_geometry(scanner.to_reader(), f"{fmt} {what}", rows, batch_rows, total_bytes=size)


# -- point geometries ----------------------------------------------------------------------
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


def _with_geometry(
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
            _reader(reader.schema, reader, batch_rows),
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
        _reader(schema, batches(), batch_rows),
        what,
        total_rows=rows,
        total_bytes=total_bytes,
        geometry=(lat_name, lon_name),
    )


def _is_geodataframe(obj: Any) -> bool:
    return any(
        c.__module__.startswith("geopandas") and c.__name__ == "GeoDataFrame"
        for c in type(obj).__mro__
    )


def _read_geopandas(frame: Any, batch_rows: int) -> Source:
    """A GeoDataFrame of points: its active geometry decoded through WKB."""
    if frame.crs is not None and frame.crs.to_epsg() != 4326:
        raise ValueError(
            f"the GeoDataFrame's CRS is {frame.crs.to_string()}; convert it "
            "with frame.to_crs(4326) first"
        )
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
    source = _from_table(table, batch_rows, "GeoDataFrame")
    return source


# -- GeoJSON -------------------------------------------------------------------------------
class _JsonStream:
    """Values of a JSON text read piecewise, so a large FeatureCollection streams.

    Only the top level is walked by hand (objects' keys, the ``features`` array); every
    value is decoded by :class:`json.JSONDecoder`.
    """

    def __init__(self, text: io.TextIOBase, what: str) -> None:
        self._text = text
        self._what = what
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._decoder = json.JSONDecoder()

    def _fill(self) -> bool:
        if self._eof:
            return False
        chunk = self._text.read(1 << 20)
        if not chunk:
            self._eof = True
            return False
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end)."""
        while True:
            while self._pos < len(self._buf) and self._buf[self._pos] in " \t\r\n\x1e":
                self._pos += 1
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill():
                return ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            got = self.peek() or "end of input"
            raise ValueError(f"invalid GeoJSON in {self._what}: expected {char!r}, got {got!r}")
        self._pos += 1

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                # Possibly cut off at the end of the buffer: read more and try again.
                if self._fill():
                    continue
                raise ValueError(f"invalid GeoJSON in {self._what}: {exc}") from exc
            # A number at the very end of the buffer may continue in the next chunk.
            if end == len(self._buf) and isinstance(value, int | float) and self._fill():
                continue
            self._pos = end
            return value


def _geojson_features(stream: _JsonStream) -> Iterator[dict[str, Any]]:
    """Features of a FeatureCollection, a Feature, or a sequence of either."""
    while stream.peek():
        if stream.peek() != "{":
            yield from _features_of(stream.value())
            continue
        stream.expect("{")
        members: dict[str, Any] = {}
        while stream.peek() != "}":
            key = stream.value()
            stream.expect(":")
            if key == "features" and stream.peek() == "[":
                stream.expect("[")
                while stream.peek() != "]":
                    yield stream.value()
                    if stream.peek() == ",":
                        stream.expect(",")
                stream.expect("]")
            else:
                members[key] = stream.value()
            if stream.peek() == ",":
                stream.expect(",")
        stream.expect("}")
        if members.get("type") == "Feature":
            yield members
        elif members.get("type") not in ("FeatureCollection", None):
            raise ValueError(
                f"GeoJSON object of type {members.get('type')!r} holds no "
                "features; give a FeatureCollection or Features"
            )


def _features_of(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, list):
        for item in value:
            yield from _features_of(item)
    elif isinstance(value, dict) and value.get("type") == "FeatureCollection":
        yield from value.get("features", [])
    elif isinstance(value, dict) and value.get("type") == "Feature":
        yield value
    else:
        raise ValueError("GeoJSON input must hold Feature objects")


def _feature_rows(
    features: Iterable[dict[str, Any]], first_row: int
) -> Iterator[tuple[float, float, dict[str, Any]]]:
    for i, feature in enumerate(features, first_row):
        geometry = feature.get("geometry")
        props = dict(feature.get("properties") or {})
        if "id" in feature and "id" not in props:
            props["id"] = feature["id"]
        if geometry is None:
            yield float("nan"), float("nan"), props
            continue
        kind = geometry.get("type")
        if kind != "Point":
            raise ValueError(
                f"feature {i} has a {kind} geometry; only Point features can be loaded"
            )
        coords = geometry.get("coordinates") or []
        if len(coords) < 2:
            yield float("nan"), float("nan"), props
            continue
        yield coords[0], coords[1], props


def _read_geojson_files(files: Sequence[Path], batch_rows: int, what: str) -> Source:
    def features() -> Iterator[dict[str, Any]]:
        for path in files:
            raw = pa.input_stream(str(path), compression="detect")
            with io.TextIOWrapper(raw, encoding="utf-8-sig") as text:
                yield from _geojson_features(_JsonStream(text, str(path)))

    rows = _feature_rows(features(), 0)
    first = _geojson_batch(rows, batch_rows, None)
    if first is None:
        schema = pa.schema([("lat", pa.float64()), ("lon", pa.float64())])
        return Source(
            pa.RecordBatchReader.from_batches(schema, iter(())), what, geometry=("lat", "lon")
        )
    schema = first.schema

    def batches() -> Iterator[pa.RecordBatch]:
        yield first
        while (batch := _geojson_batch(rows, batch_rows, schema)) is not None:
            yield batch

    lat_name, lon_name = schema.names[0], schema.names[1]
    return Source(
        pa.RecordBatchReader.from_batches(schema, batches()), what, geometry=(lat_name, lon_name)
    )


def _geojson_batch(
    rows: Iterator[tuple[float, float, dict[str, Any]]], batch_rows: int, schema: pa.Schema | None
) -> pa.RecordBatch | None:
    """The next batch of features; the first batch fixes the schema of the rest."""
    lons, lats, props = [], [], []
    for lon, lat, p in rows:
        lons.append(lon)
        lats.append(lat)
        props.append(p)
        if len(props) == batch_rows:
            break
    if not props:
        return None
    if schema is None:
        attrs = pa.Table.from_pylist(props)
        lat_name = "lat" if "lat" not in attrs.column_names else "geometry_lat"
        lon_name = "lon" if "lon" not in attrs.column_names else "geometry_lon"
        schema = pa.schema([(lat_name, pa.float64()), (lon_name, pa.float64()), *attrs.schema])
    else:
        try:
            attrs = pa.Table.from_pylist(props, schema=pa.schema(list(schema)[2:]))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(
                f"GeoJSON properties change type after the first {batch_rows} features: {exc}"
            ) from exc
    coords = [_coordinate_array(lats), _coordinate_array(lons)]
    return pa.RecordBatch.from_arrays(
        coords + [attrs.column(i).combine_chunks() for i in range(attrs.num_columns)], schema=schema
    )


def _coordinate_array(values: list[Any]) -> pa.Array:
    """Coordinates as float64; a value that is not a JSON number becomes null (missing)."""
    try:
        return pa.array(values, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array(
            [v if isinstance(v, int | float) and not isinstance(v, bool) else None for v in values],
            pa.float64(),
        )
