"""Sources as validated point streams, and their upload to a server.

``read_points(source)`` is the one-liner: any source :func:`~geonear.loaders.readers.
open_source` takes, its columns mapped (:mod:`~geonear.loaders.columns`) and validated
(:mod:`~geonear.loaders.validate`) batch by batch, as a ``pyarrow.RecordBatchReader`` of
columns ``id``, ``lat``, ``lon`` (float64 degrees) and the source's other columns.
``upload_points(client, name, source)`` streams one into a server with bounded memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from geonear.loaders.columns import ColumnError, ColumnMapping, detect_columns
from geonear.loaders.readers import open_source
from geonear.loaders.source import BATCH_ROWS, Source
from geonear.loaders.validate import PointValidator, ValidationReport

#: Schema metadata key saying where the ids came from ("column NAME" or "row numbers").
IDS_METADATA = b"geonear.ids"


@dataclass
class PointStream:
    """A source opened as points: the mapped, validated batches and what was decided.

    ``report`` fills in as ``reader`` is consumed and is final once it is exhausted.
    """

    reader: pa.RecordBatchReader
    source: Source
    mapping: ColumnMapping
    report: ValidationReport

    @property
    def ids_are_row_numbers(self) -> bool:
        return self.mapping.ids_are_row_numbers


def _id_type(schema: pa.Schema, name: str) -> pa.DataType:
    t = schema.field(name).type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.string()
    raise ColumnError(
        f"id column {name!r} has type {t}; ids must be integers or text "
        "(or pass id=False / --row-ids to number the rows)"
    )


def open_points(
    source: Any,
    lat: str | None = None,
    lon: str | None = None,
    id: str | bool | None = None,
    *,
    skip_invalid: bool = False,
    format: str | None = None,
    delimiter: str | None = None,
    header: bool | None = None,
    batch_rows: int = BATCH_ROWS,
) -> PointStream:
    """Open ``source`` as mapped, validated points; see :func:`read_points`."""
    opened = open_source(
        source,
        format=format,
        delimiter=delimiter,
        header=header,
        lat=lat,
        lon=lon,
        batch_rows=batch_rows,
    )
    in_schema = opened.reader.schema
    mapping = detect_columns(in_schema.names, lat=lat, lon=lon, id=id, geometry=opened.geometry)
    id_type = pa.int64() if mapping.id is None else _id_type(in_schema, mapping.id)
    attributes = [n for n in in_schema.names if n not in (mapping.lat, mapping.lon, mapping.id)]
    ids_from = "row numbers" if mapping.id is None else f"column {mapping.id}"
    out_schema = pa.schema(
        [pa.field("id", id_type), pa.field("lat", pa.float64()), pa.field("lon", pa.float64())]
        + [in_schema.field(n).with_name(mapping.renamed.get(n, n)) for n in attributes],
        metadata={IDS_METADATA: ids_from.encode()},
    )
    validator = PointValidator(
        skip_invalid=skip_invalid,
        check_ids=mapping.id is not None,
        what=opened.description,
        id_column=mapping.id,
        id_detected=id is None,
    )

    def mapped(batch: pa.RecordBatch, first_row: int) -> pa.RecordBatch:
        if mapping.id is None:
            ids: pa.Array = pa.array(
                np.arange(first_row, first_row + batch.num_rows, dtype=np.int64)
            )
        else:
            ids = batch.column(mapping.id)
            if pa.types.is_dictionary(ids.type):
                ids = ids.dictionary_decode()
            ids = ids.cast(id_type)
        columns = [ids, batch.column(mapping.lat), batch.column(mapping.lon)]
        columns += [batch.column(n) for n in attributes]
        return pa.RecordBatch.from_arrays(columns, names=out_schema.names)

    def batches() -> Iterator[pa.RecordBatch]:
        for batch in opened.reader:
            checked = validator.validate(mapped(batch, validator.report.rows_read))
            # After a bad row nothing more is handed on, but counting goes on to the end
            # so the error can say how many rows are bad.
            if not validator.failed and checked.num_rows:
                yield pa.RecordBatch.from_arrays(checked.columns, schema=out_schema)
        validator.finish()

    reader = pa.RecordBatchReader.from_batches(out_schema, batches())
    return PointStream(reader, opened, mapping, validator.report)


def read_points(
    source: Any,
    lat: str | None = None,
    lon: str | None = None,
    id: str | bool | None = None,
    *,
    skip_invalid: bool = False,
    format: str | None = None,
    delimiter: str | None = None,
    header: bool | None = None,
    batch_rows: int = BATCH_ROWS,
) -> pa.RecordBatchReader:
    """Points of ``source`` as a RecordBatchReader of id, lat, lon and other columns.

    Parameters
    ----------
    source : path, glob, "-", bundled name or in-memory table
        Anything :func:`geonear.loaders.open_source` reads (CSV, Parquet, Arrow IPC /
        Feather, GeoJSON, GeoParquet; pandas, GeoPandas, pyarrow objects).
    lat, lon, id : str, optional
        Source columns to map; detected from common names when None (see
        :mod:`geonear.loaders.columns`). ``id=False`` numbers the rows even when an
        id-like column exists.
    skip_invalid : bool
        Drop invalid rows instead of raising; the count is in :func:`open_points`'s
        ``report``.

    Returns
    -------
    pyarrow.RecordBatchReader
        Columns ``id`` (int64 or string), ``lat``, ``lon`` (float64 degrees), then the
        source's other columns. Without an id column the ids are the 0-based row numbers
        and the schema metadata ``geonear.ids`` says ``row numbers``.

    Raises
    ------
    ColumnError
        lat/lon/id columns missing or ambiguous (raised at once).
    InvalidPoints
        While reading, once the whole input has been counted: the bad rows.
    """
    return open_points(
        source,
        lat,
        lon,
        id,
        skip_invalid=skip_invalid,
        format=format,
        delimiter=delimiter,
        header=header,
        batch_rows=batch_rows,
    ).reader


@dataclass(frozen=True)
class LoadResult:
    """What one :func:`upload_points` call stored."""

    dataset: Any  # the server's DatasetInfo of the new version
    rows_read: int
    rows_stored: int
    rows_dropped: int
    mapping: ColumnMapping
    ids_are_row_numbers: bool
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows_read / self.seconds if self.seconds > 0 else float("inf")

    def describe(self) -> str:
        d = self.dataset
        text = (
            f"loaded {self.rows_stored:,} rows into {d.name} (version {d.version}, "
            f"{d.rows:,} rows) in {self.seconds:.1f} s, {self.rows_per_s:,.0f} rows/s"
        )
        if self.rows_dropped:
            text += f"; dropped {self.rows_dropped:,} invalid rows"
        return text + f"; {self.mapping.describe()}"


def upload_points(
    client: Any,
    name: str,
    source: Any,
    *,
    mode: str = "create",
    lat: str | None = None,
    lon: str | None = None,
    id: str | bool | None = None,
    skip_invalid: bool = False,
    format: str | None = None,
    delimiter: str | None = None,
    batch_rows: int = BATCH_ROWS,
    on_batch: Callable[[int, PointStream], None] | None = None,
    on_sent: Callable[[PointStream], None] | None = None,
    timeout_s: float | None = None,
) -> LoadResult:
    """Stream the points of ``source`` into dataset ``name`` of ``client``'s server.

    Batches are validated as they are read and sent as they pass, so memory stays
    bounded. When a bad row is found (and ``skip_invalid`` is off) the upload is
    cancelled, which leaves the server's previous version untouched, and the
    validation error is raised. Row-number ids continue the dataset's numbering on
    ``mode="append"``. ``on_batch(rows, stream)`` is called after each batch is sent,
    ``on_sent(stream)`` once the last one is, while the server builds the new version.
    """
    stream = open_points(
        source,
        lat,
        lon,
        id,
        skip_invalid=skip_invalid,
        format=format,
        delimiter=delimiter,
        batch_rows=batch_rows,
    )
    schema = stream.reader.schema
    # On append the server numbers rows after its last id, so row numbers are not sent.
    drop_ids = stream.ids_are_row_numbers and mode == "append"
    if drop_ids:
        schema = schema.remove(0)
    failure: list[BaseException] = []
    it = iter(stream.reader)
    start = time.perf_counter()
    # The first batch is read before the call starts: an empty or bad input fails here.
    first = next(it, None)
    if first is None:
        raise AssertionError("unreachable: an empty stream raises")  # pragma: no cover

    def batches() -> Iterator[pa.RecordBatch]:
        try:
            batch: pa.RecordBatch | None = first
            while batch is not None:
                out = (
                    pa.RecordBatch.from_arrays(batch.columns[1:], schema=schema)
                    if drop_ids
                    else batch
                )
                yield out
                if on_batch is not None:
                    on_batch(batch.num_rows, stream)
                batch = next(it, None)
            if on_sent is not None:
                on_sent(stream)
        except BaseException as exc:
            failure.append(exc)
            raise

    try:
        info = client.upload_mapped(
            name,
            pa.RecordBatchReader.from_batches(schema, batches()),
            mode=mode,
            timeout_s=timeout_s,
        )
    except Exception as exc:
        if failure:
            raise failure[0] from None
        raise exc
    seconds = time.perf_counter() - start
    report = stream.report
    return LoadResult(
        dataset=info,
        rows_read=report.rows_read,
        rows_stored=report.rows_kept,
        rows_dropped=report.rows_dropped,
        mapping=stream.mapping,
        ids_are_row_numbers=stream.ids_are_row_numbers,
        seconds=seconds,
    )


def read_query_points(
    source: Any, lat: str | None = None, lon: str | None = None, **options: Any
) -> tuple[np.ndarray, np.ndarray]:
    """(lat, lon) float64 arrays of a file of query points, validated; row order kept.

    Ids are not needed for queries: a result's ``query_index`` is the row number.
    """
    table = open_points(source, lat, lon, id=False, **options).reader.read_all()
    return (table.column("lat").to_numpy(), table.column("lon").to_numpy())


def read_query_frame(
    source: Any, lat: str | None = None, lon: str | None = None, **options: Any
) -> pd.DataFrame:
    """A file of query points as a DataFrame: ``lat``, ``lon``, then its other columns.

    Coordinates are detected and validated as for :func:`read_points` (the source's
    coordinate columns become ``lat`` and ``lon``, float64 degrees); every other column
    keeps its name; rows keep their order.
    """
    stream = open_points(source, lat, lon, id=False, **options)
    table = stream.reader.read_all().drop_columns(["id"])
    restored = {new: old for old, new in stream.mapping.renamed.items()}
    return table.rename_columns([restored.get(n, n) for n in table.column_names]).to_pandas()
