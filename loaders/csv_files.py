"""CSV files and streams: delimiter and header detected from the first lines."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds

from geonear.loaders.columns import coordinate_candidates
from geonear.loaders.source import COMPRESSED_SUFFIXES, Source, batch_reader

_SAMPLE_BYTES = 1 << 16
_DELIMITERS = (",", "\t", ";", "|")


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


def read_csv(source: Path | Any, what: str, options: dict[str, Any], batch_rows: int) -> Source:
    """CSV from a file path (read natively) or a binary stream such as standard input."""
    size = None
    if isinstance(source, Path):
        with pa.input_stream(str(source), compression="detect") as f:
            sample_bytes = f.read(_SAMPLE_BYTES)
        stream: Any = pa.input_stream(str(source), compression="detect")
        if source.suffix.lower() not in COMPRESSED_SUFFIXES:
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
        batch_reader(reader.schema, batches(), batch_rows),
        what,
        total_bytes=size,
        bytes_read=bytes_read if size else None,
    )


def csv_file_format(path: Path, options: dict[str, Any]) -> ds.CsvFileFormat:
    with pa.input_stream(str(path), compression="detect") as f:
        sample_bytes = f.read(_SAMPLE_BYTES)
    read_options, parse_options, convert_options = _csv_options(sample_bytes, options)
    return ds.CsvFileFormat(
        parse_options=parse_options, read_options=read_options, convert_options=convert_options
    )
