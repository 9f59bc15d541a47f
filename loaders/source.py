"""An opened source of points: its record batches and what is known of its size."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa

#: Rows per record batch handed on; about 3 MiB of id, lat and lon.
BATCH_ROWS = 131_072
#: Compressed files are read through, decompressed on the fly.
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")


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


def rechunk(batches: Iterable[pa.RecordBatch], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Batches of at most ``batch_rows`` rows (zero-copy slices of larger ones)."""
    for batch in batches:
        for start in range(0, batch.num_rows, batch_rows):
            yield batch.slice(start, batch_rows)


def batch_reader(
    schema: pa.Schema, batches: Iterable[pa.RecordBatch], batch_rows: int
) -> pa.RecordBatchReader:
    return pa.RecordBatchReader.from_batches(schema, rechunk(batches, batch_rows))
