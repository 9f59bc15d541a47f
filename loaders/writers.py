"""Writing tables and batch streams to Parquet, CSV or Arrow IPC files, chosen by extension.

Files are written beside their destination and renamed into place when complete, so a
failed or interrupted write never leaves a truncated file under the final name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
WRITE_FORMATS = ("parquet", "csv", "arrow")


def format_for_path(path: str | os.PathLike[str], format: str | None = None) -> str:
    """``parquet``, ``csv`` or ``arrow`` for ``path`` (by extension) unless ``format`` says."""
    if format is not None:
        if format not in WRITE_FORMATS:
            raise ValueError(f"format must be one of {', '.join(WRITE_FORMATS)}, got {format!r}")
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in _EXTENSIONS:
        raise ValueError(
            f"cannot tell the format of {os.fspath(path)!r} from its extension; "
            f"use one of {', '.join(sorted(_EXTENSIONS))}"
        )
    return _EXTENSIONS[suffix]


def write_batches(
    path: str | os.PathLike[str],
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    format: str | None = None,
) -> int:
    """Write ``batches`` (each a Parquet row group or an IPC batch) to ``path``; rows written."""
    fmt = format_for_path(path, format)
    final = Path(path)
    partial = final.with_name(final.name + ".part")
    rows = 0
    try:
        if fmt == "parquet":
            writer: Any = pq.ParquetWriter(partial, schema, compression="zstd")
        elif fmt == "csv":
            writer = pacsv.CSVWriter(partial, schema)
        else:
            writer = pa.ipc.new_file(partial, schema)
        with writer:
            for batch in batches:
                writer.write_batch(batch)
                rows += batch.num_rows
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return rows


def write_table(
    data: pa.Table | pa.RecordBatchReader | pd.DataFrame,
    path: str | os.PathLike[str],
    format: str | None = None,
) -> int:
    """Write a Table, RecordBatchReader or DataFrame to ``path``; returns the rows written."""
    if isinstance(data, pd.DataFrame):
        data = pa.Table.from_pandas(data, preserve_index=False)
    if isinstance(data, pa.Table):
        return write_batches(path, data.schema, data.to_batches(max_chunksize=1 << 20), format)
    if isinstance(data, pa.RecordBatchReader):
        return write_batches(path, data.schema, data, format)
    raise TypeError(
        f"write_table takes a pyarrow Table, RecordBatchReader or pandas "
        f"DataFrame, got {type(data).__name__}"
    )
