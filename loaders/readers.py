"""Readers: every supported source as a stream of Arrow record batches.

:func:`open_source` takes a path, a glob, a directory, ``"-"`` (CSV on standard input),
a bundled data set's name or an in-memory object (pandas or GeoPandas DataFrame,
pyarrow Table, RecordBatch, RecordBatchReader or Dataset, anything with
``__arrow_c_stream__``) and returns a :class:`Source` whose reader yields record
batches of at most ``batch_rows`` rows, so that a file larger than memory streams.

Formats: CSV (any delimiter, header detected), Parquet, Arrow IPC file or stream
(Feather v2), GeoJSON (FeatureCollection, Feature or newline-delimited features; Point
geometries) and GeoParquet (WKB or GeoArrow point geometries). Point geometries are
decoded into ``lat``/``lon`` columns that :class:`Source.geometry` names. CSV, GeoJSON
and point geometries are read in modules of their own (``csv_files``, ``geojson_files``,
``point_geometry``); Parquet and Arrow files here.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from geonear.loaders.csv_files import csv_file_format, read_csv
from geonear.loaders.geojson_files import read_geojson_files
from geonear.loaders.point_geometry import (
    from_table,
    is_geodataframe,
    is_geoseries,
    read_geopandas,
    with_point_columns,
)
from geonear.loaders.source import BATCH_ROWS, COMPRESSED_SUFFIXES, Source, batch_reader

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
FORMATS = ("csv", "parquet", "arrow", "geojson")


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
        return read_csv(source, "CSV stream", csv_options, batch_rows)
    return _open_object(source, batch_rows)


def _open_path(
    text: str, format: str | None, csv_options: dict[str, Any], batch_rows: int
) -> Source:
    if text == "-":
        return _open_stdin(format, csv_options, batch_rows)
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


def _open_stdin(format: str | None, csv_options: dict[str, Any], batch_rows: int) -> Source:
    """Standard input in ``format``, or in the format its first bytes show.

    CSV, GeoJSON and Arrow IPC streams are read as they arrive; Parquet and Arrow IPC
    files keep their index at the end, so they are read whole first.
    """
    stdin = sys.stdin.buffer
    fmt = format or _sniff_bytes(stdin.peek(8)[:8] if hasattr(stdin, "peek") else b"")
    if fmt == "csv":
        return read_csv(stdin, "CSV on standard input", csv_options, batch_rows)
    if fmt == "geojson":
        return read_geojson_files([stdin], batch_rows, "GeoJSON on standard input")
    if fmt == "parquet":
        return _read_parquet(pa.BufferReader(stdin.read()), batch_rows, "Parquet on standard input")
    head = stdin.peek(8)[:8] if hasattr(stdin, "peek") else b""
    if head.startswith(b"ARROW1"):
        return _read_arrow(pa.BufferReader(stdin.read()), batch_rows, "Arrow on standard input")
    try:
        stream = pa.ipc.open_stream(stdin)
    except pa.ArrowInvalid as exc:
        raise ValueError(f"standard input is not an Arrow IPC stream: {exc}") from exc
    return with_point_columns(
        batch_reader(stream.schema, stream, batch_rows),
        "Arrow IPC stream on standard input",
        None,
        batch_rows,
    )


def _format_of(path: Path, given: str | None) -> str | None:
    if given:
        return given
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        suffixes = suffixes[:-1]
    return _EXTENSIONS.get(suffixes[-1]) if suffixes else None


def _sniff_format(path: Path) -> str:
    """Format from a file's first bytes, for files without a known extension."""
    with open(path, "rb") as f:
        return _sniff_bytes(f.read(8))


def _sniff_bytes(head: bytes) -> str:
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
            "load one format at a time or pass --format / format="
        )
    (fmt,) = formats
    if len(files) == 1:
        path = files[0]
        if fmt == "csv":
            return read_csv(path, f"CSV file {path}", csv_options, batch_rows)
        if fmt == "parquet":
            return _read_parquet(path, batch_rows)
        if fmt == "arrow":
            return _read_arrow(path, batch_rows)
        return read_geojson_files(files, batch_rows, f"GeoJSON file {path}")
    if fmt == "geojson":
        return read_geojson_files(files, batch_rows, f"GeoJSON {what}")
    return _read_dataset(files, fmt, csv_options, batch_rows, what)


def _open_object(obj: Any, batch_rows: int) -> Source:
    if is_geodataframe(obj) or is_geoseries(obj):
        return read_geopandas(obj, batch_rows)
    if isinstance(obj, pd.DataFrame):
        # A named index (e.g. set_index("id")) is kept as a column; a RangeIndex is not.
        table = pa.Table.from_pandas(obj)
        meta = table.schema.metadata or {}
        table = table.replace_schema_metadata({k: v for k, v in meta.items() if k != b"pandas"})
        return from_table(table, batch_rows, "pandas DataFrame")
    if isinstance(obj, pa.RecordBatch):
        obj = pa.Table.from_batches([obj])
    if isinstance(obj, pa.Table):
        return from_table(obj, batch_rows, "pyarrow Table")
    if isinstance(obj, ds.Dataset):
        scanner = obj.scanner(batch_size=batch_rows)
        return with_point_columns(
            scanner.to_reader(), "pyarrow Dataset", obj.count_rows(), batch_rows
        )
    if isinstance(obj, pa.RecordBatchReader):
        return with_point_columns(obj, "pyarrow RecordBatchReader", None, batch_rows)
    if hasattr(obj, "__arrow_c_stream__"):
        return with_point_columns(
            pa.RecordBatchReader.from_stream(obj), type(obj).__name__, None, batch_rows
        )
    raise TypeError(
        f"cannot read points from a {type(obj).__name__}: give a pandas DataFrame, pyarrow "
        "Table, RecordBatch, RecordBatchReader or Dataset, a GeoDataFrame or GeoSeries of "
        "points, or a path, glob, '-' or bundled data set name"
    )


# -- Parquet, Arrow, datasets -----------------------------------------------------------
def _read_parquet(path: Path | pa.BufferReader, batch_rows: int, what: str = "") -> Source:
    what = what or f"Parquet file {path}"
    try:
        # Without pre-buffering, each row group's buffers are freed once decoded; with it,
        # memory grows with the file.
        file = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"cannot read {what}: {exc}") from exc
    schema = file.schema_arrow
    reader = batch_reader(schema, file.iter_batches(batch_size=batch_rows), batch_rows)
    return with_point_columns(reader, what, file.metadata.num_rows, batch_rows)


def _read_arrow(path: Path | pa.BufferReader, batch_rows: int, what: str = "") -> Source:
    def source() -> Any:
        if isinstance(path, pa.BufferReader):
            path.seek(0)
            return path
        return pa.memory_map(str(path))

    try:
        file = pa.ipc.open_file(source())
    except pa.ArrowInvalid:
        try:
            stream = pa.ipc.open_stream(source())
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{path} is neither an Arrow IPC file nor stream: {exc}") from exc
        return with_point_columns(
            batch_reader(stream.schema, stream, batch_rows),
            what or f"Arrow IPC stream {path}",
            None,
            batch_rows,
        )
    rows = sum(file.get_batch(i).num_rows for i in range(file.num_record_batches))
    batches = (file.get_batch(i) for i in range(file.num_record_batches))
    return with_point_columns(
        batch_reader(file.schema, batches, batch_rows),
        what or f"Arrow IPC file {path}",
        rows,
        batch_rows,
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
        file_format = csv_file_format(files[0], csv_options)
    try:
        dataset = ds.dataset([str(p) for p in files], format=file_format)
        # Little read-ahead keeps memory bounded on large files.
        scanner = dataset.scanner(batch_size=batch_rows, batch_readahead=2, fragment_readahead=1)
        rows = dataset.count_rows() if fmt != "csv" else None
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"cannot read {what}: {exc}") from exc
    size = sum(p.stat().st_size for p in files) if fmt == "csv" else None
    return with_point_columns(
        scanner.to_reader(), f"{fmt} {what}", rows, batch_rows, total_bytes=size
    )
