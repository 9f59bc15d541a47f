"""Arrow and protobuf on the wire, shared by the server, the client and the tools.

Bulk data travels as Arrow IPC inside messages: the serialized schema once, then
encapsulated record batches, each with its row count. The stream carries no dictionary
batches, so a dictionary-encoded column (a pandas categorical, say) travels as its values.
Small query point sets travel inline as repeated doubles, which costs less than Arrow's
fixed overhead.

Record batches travel uncompressed. A compressed body declares its own decompressed
size, and Arrow allocates that size before it can tell the declaration is false (68 KB
of zstd frames inflate to 2 GiB), so a batch whose metadata names a codec is refused
before its body is touched; gRPC's own compression serves the transport instead. For
the same reason a batch may not declare more rows than its body can hold.

Integer columns may travel narrower than they are (requests' ``narrow_integers``): the
server picks, once an answer, the smallest signed integer type that holds every value
the column can take there (ids in the dataset's range, ranks below k, counts), and
marks the field with its own type (``WIDE_TYPE_KEY``); :func:`messages_to_table` casts
such fields back, so the answer read is the same table, in fewer bytes.

The protocol's other small facts that more than one side needs live here too: which
calls the Python client sends compact (``COMPACT_ROWS``, ``COMPACT_RADIUS_QUERIES``), and
the ``geonear-timing`` trailer's key and parser (``TIMING_KEY``, :func:`parse_timing`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from geonear.v1 import geonear_pb2 as pb

#: Target size of one record batch on the wire; well under gRPC's 4 MiB default.
BATCH_BYTES = 1 << 20
#: The record batches of a server's answers: below glibc's mmap threshold as geonear sets
#: it (8 MiB, ``geonear.allocator``), so that each message's bytes reuse heap memory on
#: both sides, and under gRPC's default 4 MiB limit on a message received. A 64 MB
#: per-query join answer through the Python client: 586 -> 416 ms (median, 2-core
#: host) against 512 KiB batches under a 768 KiB threshold.
ANSWER_BATCH_BYTES = 2 << 20
#: Query sets up to this many points travel inline (repeated double).
INLINE_POINTS = 4096
#: KNN calls expecting at most this many rows (queries x k), without attribute columns,
#: use the unary KnnCompact RPC: one message each way, no Arrow (the cheapest per call).
#: The Python client's rule, which tools sending what it sends (``geonear loadtest``)
#: follow too; the server refuses a compact answer only above a much larger limit.
COMPACT_ROWS = 4096
#: Radius calls with at most this many queries try RadiusCompact first.
COMPACT_RADIUS_QUERIES = 16
#: The trailing-metadata key of a call's stage times, written like HTTP's Server-Timing
#: header: ``decode;dur=0.41, search;dur=11.9`` (milliseconds; see :func:`parse_timing`).
TIMING_KEY = "geonear-timing"


#: Field metadata of an integer column sent narrower than it is: its own type's name
#: (``int64``, ``int32``), the type a reader casts it back to (a list's values, for lists).
WIDE_TYPE_KEY = b"geonear.type"
_SIGNED = (pa.int8(), pa.int16(), pa.int32(), pa.int64())

#: Writes what the wire carries: record batches with uncompressed bodies.
WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression=None)


class WireError(ValueError):
    """Bytes on the wire that are not valid Arrow IPC of the expected shape."""


# -- checks of a record batch's metadata, before its body is read -----------------------
#: Codecs of Arrow's BodyCompression (format/Message.fbs: CompressionType).
_CODECS = {0: "lz4_frame", 1: "zstd"}
#: Every batch geonear reads has a numeric column (lat, lon, ids, query_index), at least
#: a byte a row, so a batch declaring more rows than its body holds at that rate is forged.
_MIN_ROW_BITS = 8


class _Flatbuffer:
    """Bounds-checked reads of the few flatbuffer fields the checks need.

    A table starts with the signed offset back to its vtable; the vtable lists each
    field's offset from the table (0: absent). Offsets to tables and vectors are
    unsigned, from where they are stored.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data

    def _read(self, fmt: str, at: int) -> int:
        if at < 0:
            raise WireError("invalid Arrow message metadata: an offset points outside it")
        try:
            value: int = struct.unpack_from(fmt, self.data, at)[0]
        except struct.error:
            raise WireError("invalid Arrow message metadata: an offset points outside it") from None
        return value

    def root(self) -> int:
        return self._read("<I", 0)

    def _field(self, table: int, index: int) -> int | None:
        vtable = table - self._read("<i", table)
        slot = 4 + 2 * index
        if slot + 2 > self._read("<H", vtable):
            return None
        offset = self._read("<H", vtable + slot)
        return table + offset if offset else None

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        at = self._field(table, index)
        return default if at is None else self._read(fmt, at)

    def table(self, table: int, index: int) -> int | None:
        at = self._field(table, index)
        return None if at is None else at + self._read("<I", at)


def _row_bits(t: pa.DataType) -> int:
    """Fewest body bits one row of type ``t`` takes in a valid batch (its data or offsets;
    0 for types whose rows may take none, as null and run-end-encoded columns)."""
    if isinstance(t, pa.BaseExtensionType):
        return _row_bits(t.storage_type)
    if pa.types.is_struct(t):
        return sum(_row_bits(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_fixed_size_list(t):
        return int(t.list_size) * _row_bits(t.value_type)
    if pa.types.is_large_list(t) or pa.types.is_large_binary(t) or pa.types.is_large_string(t):
        return 64
    if pa.types.is_list(t) or pa.types.is_map(t) or pa.types.is_binary(t) or pa.types.is_string(t):
        return 32
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t):
        return 128
    if pa.types.is_union(t):
        return 8
    if pa.types.is_null(t) or pa.types.is_run_end_encoded(t) or pa.types.is_dictionary(t):
        return 0
    try:
        return int(t.bit_width)
    except ValueError:
        return 0  # a type with no fixed width not named above: no bound from it


def _check_batch_message(message: pa.ipc.Message, schema: pa.Schema) -> None:
    """Refuse a record batch with a compressed body, or one declaring more rows than its
    body holds, from its metadata alone: nothing is decompressed or allocated."""
    if message.type != "record batch":
        raise WireError(
            f"invalid Arrow record batch: got a {message.type} message; the stream carries "
            "record batches only (no dictionary batches)"
        )
    meta = _Flatbuffer(message.metadata.to_pybytes())
    batch = meta.table(meta.root(), 2)  # Message.header, a RecordBatch
    if batch is None:
        raise WireError("invalid Arrow record batch: its metadata has no header")
    compression = meta.table(batch, 3)  # RecordBatch.compression
    if compression is not None:
        codec = meta.scalar(compression, 0, "<b")
        raise WireError(
            f"invalid Arrow record batch: its body is compressed "
            f"({_CODECS.get(codec, f'codec {codec}')}); send uncompressed record batches "
            "(gRPC compression is available for the transport)"
        )
    rows = meta.scalar(batch, 0, "<q")  # RecordBatch.length
    body_bytes = message.body.size if message.body is not None else 0
    row_bits = max(_MIN_ROW_BITS, sum(_row_bits(f.type) for f in schema))
    if rows < 0 or rows * row_bits > 8 * body_bytes:
        raise WireError(
            f"invalid Arrow record batch: it declares {rows} rows, but its {body_bytes}-byte "
            f"body holds at most {8 * body_bytes // row_bits} rows of this schema"
        )


def read_batch_message(data: bytes | pa.Buffer, schema: pa.Schema) -> pa.RecordBatch:
    """The record batch of one encapsulated IPC message, checked before it is read, then
    fully validated; raises WireError."""
    try:
        message = pa.ipc.read_message(pa.py_buffer(data) if isinstance(data, bytes) else data)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise WireError(f"invalid Arrow record batch: {exc}") from exc
    return _read_checked_batch(message, schema)


def _read_checked_batch(message: pa.ipc.Message, schema: pa.Schema) -> pa.RecordBatch:
    _check_batch_message(message, schema)
    try:
        batch = pa.ipc.read_record_batch(message, schema)
        batch.validate(full=True)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise WireError(f"invalid Arrow record batch: {exc}") from exc
    return batch


def table_to_messages(table: pa.Table, batch_bytes: int = BATCH_BYTES) -> Iterator[pb.ArrowData]:
    """Arrow table as ArrowData messages: schema in the first, then batches of bounded size.

    An empty table still yields one message carrying the schema. Dictionary columns are
    sent decoded, as their value type. Batches are uncompressed (``RecordBatch.serialize``
    writes no codec).
    """
    return tables_to_messages([table], batch_bytes)


def tables_to_messages(
    tables: Iterable[pa.Table], batch_bytes: int = BATCH_BYTES
) -> Iterator[pb.ArrowData]:
    """Tables of one schema as one stream of ArrowData messages, as ``table_to_messages``
    sends one table: each table is encoded only when the previous one has been sent."""
    for schema, batch, rows in _stream_parts(tables, batch_bytes):
        yield pb.ArrowData(
            schema=b"" if schema is None else schema.to_pybytes(),
            record_batch=b"".join(batch),
            row_count=rows,
        )


@dataclass(frozen=True, slots=True)
class EncodedArrowData:
    """One ArrowData message already in its protobuf wire format (``data`` is what
    ``SerializeToString`` gives for it), with its row count. A server hands it to gRPC
    as it is (``serialized``), skipping two copies of the batch."""

    data: bytes
    row_count: int


def tables_to_encoded(
    tables: Iterable[pa.Table], batch_bytes: int = BATCH_BYTES
) -> Iterator[EncodedArrowData]:
    """``tables_to_messages``, each message written in the wire format directly: one
    copy of the record batch, from its columns into the message's bytes, where a
    protobuf message costs four (the serialized batch, Python bytes, the message, its
    serialization). Measured, a 16 MB answer: see docs/benchmarks.md, "The transport
    alone"."""
    for schema, batch, rows in _stream_parts(tables, batch_bytes):
        parts: list[bytes | pa.Buffer] = []
        if schema is not None:
            parts += [_SCHEMA_TAG, _varint(schema.size), schema]
        if batch:
            size = sum(len(part) for part in batch)
            parts += [_BATCH_TAG, _varint(size), *batch, _ROWS_TAG, _varint(rows)]
        yield EncodedArrowData(b"".join(parts), rows)


def serialized(message: Any) -> bytes:
    """The wire bytes of a response: an encoded message's own, else its serialization."""
    if type(message) is EncodedArrowData:
        return message.data
    return message.SerializeToString()


# Tags of ArrowData's fields: (field number << 3) | wire type (2: bytes, 0: varint).
_SCHEMA_TAG, _BATCH_TAG, _ROWS_TAG = b"\x0a", b"\x12", b"\x18"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class ArrowDataView(NamedTuple):
    """An ArrowData message's fields read from its wire format (:func:`read_arrowdata`):
    the schema and the record batch as pyarrow buffers over the received bytes."""

    schema: pa.Buffer | bytes = b""
    record_batch: pa.Buffer | bytes = b""
    row_count: int = 0


def read_arrowdata(data: bytes) -> ArrowDataView:
    """An ArrowData message's fields, found by slicing its wire format rather than by a
    protobuf parse, which copies each field into bytes of its own (the reader's side of
    :func:`tables_to_encoded`). Unknown fields are skipped, as protobuf skips them; a
    field in the wrong wire type or running past the message raises WireError."""
    view = memoryview(data)
    fields: dict[int, pa.Buffer | int] = {}
    at = 0
    while at < len(view):
        key, at = _read_varint(view, at)
        number, kind = key >> 3, key & 7
        if kind == 2:
            size, at = _read_varint(view, at)
            if at + size > len(view):
                raise WireError("invalid ArrowData: a field runs past the message")
            fields[number] = pa.py_buffer(view[at : at + size])
            at += size
        elif kind == 0:
            fields[number], at = _read_varint(view, at)
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
            if at > len(view):
                raise WireError("invalid ArrowData: a field runs past the message")
        else:
            raise WireError(f"invalid ArrowData: wire type {kind}")
    schema, batch, rows = fields.get(1, b""), fields.get(2, b""), fields.get(3, 0)
    if isinstance(schema, int) or isinstance(batch, int) or not isinstance(rows, int):
        raise WireError("invalid ArrowData: a field of the wrong wire type")
    # int64 row_count: a varint holds its two's complement in 64 bits.
    return ArrowDataView(schema, batch, rows - (1 << 64) if rows >= 1 << 63 else rows)


def _read_varint(data: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("invalid ArrowData: a varint runs past the message")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _stream_parts(
    tables: Iterable[pa.Table], batch_bytes: int
) -> Iterator[tuple[pa.Buffer | None, list[bytes | pa.Buffer], int]]:
    """(schema, record batch, rows) of each message of one stream: the schema in the
    first only; the record batch as the parts of its encapsulated IPC message, its
    metadata as bytes and its body as views of the columns' buffers (``_MessageParts``),
    none for a message of the schema alone (an empty stream)."""
    schema: pa.Schema | None = None
    sent_schema = False
    sink = _MessageParts()
    writer: pa.ipc.RecordBatchStreamWriter | None = None
    for table in tables:
        table = _decode_dictionaries(table)
        if schema is None:
            schema = table.schema
            writer = pa.ipc.new_stream(sink, schema)
        elif not table.schema.equals(schema, check_metadata=True):
            raise ValueError(f"tables of one stream differ in schema: {table.schema} != {schema}")
        assert writer is not None
        row_bytes = max(1, table.nbytes // max(1, table.num_rows))
        for batch in table.to_batches(max_chunksize=max(1, batch_bytes // row_bytes)):
            if batch.num_rows == 0:
                continue
            writer.write_batch(batch)
            if sent_schema:
                yield None, sink.taken(), batch.num_rows
            else:
                encoded = schema.serialize()
                yield encoded, sink.taken(after=encoded.size), batch.num_rows
                sent_schema = True
    if schema is None:
        raise ValueError("a stream needs at least one table, for its schema")
    if not sent_schema:
        yield schema.serialize(), [], 0


class _MessageParts:
    """A file for pyarrow's IPC stream writer that keeps what it is given: a record
    batch's metadata as bytes, its body's buffers as the writer passes them, views of
    the columns (``RecordBatch.serialize`` would copy them first). Written as the
    writer writes them, the parts are the stream's bytes (``RecordBatch.serialize``'s
    for a batch, ``Schema.serialize``'s for the schema, which the writer writes before
    its first batch)."""

    closed = False

    def __init__(self) -> None:
        self.parts: list[bytes | pa.Buffer] = []

    def write(self, data: bytes | pa.Buffer) -> None:
        self.parts.append(data)

    def flush(self) -> None:
        pass

    def taken(self, after: int = 0) -> list[bytes | pa.Buffer]:
        """The parts written since the last call, less their first ``after`` bytes
        (whole parts: the schema's message before a first batch)."""
        parts, self.parts = self.parts, []
        skipped = 0
        while skipped < after:
            skipped += len(parts.pop(0))
        if skipped != after:
            raise AssertionError(f"the schema's message ends inside a part ({skipped} != {after})")
        return parts


def _decode_dictionaries(table: pa.Table) -> pa.Table:
    for i, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            values = table.column(i).cast(field.type.value_type)
            table = table.set_column(i, field.with_type(field.type.value_type), values)
    return table


def narrowest_integer(low: int, high: int) -> pa.DataType:
    """The smallest signed integer type holding every value from ``low`` to ``high``."""
    for t in _SIGNED:
        bits = t.bit_width - 1
        if -(1 << bits) <= low and high < (1 << bits):
            return t
    return pa.int64()


class Narrowing(NamedTuple):
    """How an integer column travels: in type ``sent``, its own type being ``own``."""

    sent: pa.DataType
    own: pa.DataType = pa.int64()


def narrowed(table: pa.Table, types: Mapping[str, Narrowing]) -> pa.Table:
    """``table`` with each integer column named in ``types`` (or the values of a list
    column) in its ``sent`` type where that is narrower than its ``own``, its field
    marked with its own type for :func:`widened`. A column may already be in its sent
    type (ids gathered narrow); others are cast. The caller's types hold every value
    (they come from bounds such as the dataset's id range), so the cast does not check
    each value again."""
    fields, columns = [], []
    for field, column in zip(table.schema, table.columns, strict=True):
        how = types.get(field.name)
        if (
            how is not None
            and _integer_values(field.type) is not None
            and how.sent.bit_width < how.own.bit_width
        ):
            sent = _with_values(field.type, how.sent)
            if column.type != sent:
                column = column.cast(sent, safe=False)
            field = pa.field(
                field.name,
                sent,
                field.nullable,
                {**(field.metadata or {}), WIDE_TYPE_KEY: str(how.own).encode()},
            )
        fields.append(field)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, table.schema.metadata))


def widened(schema: pa.Schema) -> pa.Schema:
    """``schema`` with each field ``narrowed`` marked back in its own type (unmarked)."""
    fields = []
    for field in schema:
        wide = (field.metadata or {}).get(WIDE_TYPE_KEY)
        if wide is not None:
            metadata = {k: v for k, v in field.metadata.items() if k != WIDE_TYPE_KEY}
            try:
                wide_type = pa.type_for_alias(wide.decode())
            except (ValueError, UnicodeDecodeError) as exc:
                raise WireError(f"field {field.name!r} names an unknown type {wide!r}") from exc
            sent = _integer_values(field.type)
            if not (pa.types.is_integer(wide_type) and sent is not None):
                raise WireError(f"field {field.name!r}: {wide!r} is not an integer type")
            if not (
                wide_type in _SIGNED and sent in _SIGNED and wide_type.bit_width >= sent.bit_width
            ):
                raise WireError(
                    f"field {field.name!r}: {sent} values cannot be widened to {wide_type}"
                )
            field = pa.field(
                field.name, _with_values(field.type, wide_type), field.nullable, metadata or None
            )
        fields.append(field)
    return pa.schema(fields, schema.metadata)


def _integer_values(t: pa.DataType) -> pa.DataType | None:
    """The integer type of a column's values (itself, or a list's), else None."""
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t if pa.types.is_integer(t) else None


def _with_values(t: pa.DataType, values: pa.DataType) -> pa.DataType:
    """Type ``t`` with ``values`` as its integer type (a list's values, for lists)."""
    if pa.types.is_fixed_size_list(t):
        return pa.list_(pa.field(t.value_field.name, values, t.value_field.nullable), t.list_size)
    if pa.types.is_large_list(t):
        return pa.large_list(pa.field(t.value_field.name, values, t.value_field.nullable))
    if pa.types.is_list(t):
        return pa.list_(pa.field(t.value_field.name, values, t.value_field.nullable))
    return values


class BatchDecoder:
    """Decodes a stream of ArrowData messages, validating each batch against the schema.
    ``schema`` is the stream's as sent; ``table_schema`` that with every field sent
    narrower (``narrowed``) in its own type, to which :func:`messages_to_table` casts."""

    def __init__(self) -> None:
        self.schema: pa.Schema | None = None
        self.table_schema: pa.Schema | None = None

    def decode(self, data: pb.ArrowData | ArrowDataView) -> pa.RecordBatch | None:
        """The message's record batch (None when it carries only the schema)."""
        if data.schema:
            if self.schema is not None:
                raise WireError("a stream may carry its Arrow schema only once")
            try:
                self.schema = _named_in_utf8(pa.ipc.read_schema(pa.py_buffer(data.schema)))
            except (pa.ArrowException, ValueError, OSError) as exc:
                raise WireError(f"invalid Arrow schema bytes: {exc}") from exc
            self.table_schema = widened(self.schema)
            encoded = [f.name for f in self.schema if pa.types.is_dictionary(f.type)]
            if encoded:
                raise WireError(
                    f"dictionary-encoded column(s) {', '.join(map(repr, encoded))}: the "
                    "stream carries no dictionary batches, so send their values instead "
                    "(the Python client decodes them itself)"
                )
        if not data.record_batch:
            return None
        if self.schema is None:
            raise WireError("the first message of an Arrow stream must carry the schema")
        batch = read_batch_message(data.record_batch, self.schema)
        if data.row_count and batch.num_rows != data.row_count:
            raise WireError(
                f"record batch holds {batch.num_rows} rows but row_count says {data.row_count}"
            )
        return batch


def messages_to_table(messages: Iterable[pb.ArrowData | bytes]) -> pa.Table:
    """Reassemble a table from ArrowData messages (schema first), every column in its
    own type: a batch with columns sent narrower is cast back as it arrives, while
    gRPC receives the next messages, rather than the whole table after the last one.
    A message may be its wire format as received (bytes), read without copying its
    batch."""
    decoder = BatchDecoder()
    batches = []
    for message in messages:
        view = read_arrowdata(message) if isinstance(message, bytes) else message
        batch = decoder.decode(view)
        if batch is not None:
            widen = decoder.table_schema != decoder.schema
            batches.append(batch.cast(decoder.table_schema) if widen else batch)
    if decoder.schema is None or decoder.table_schema is None:
        raise WireError("the Arrow stream carried no schema")
    return pa.Table.from_batches(batches, schema=decoder.table_schema)


def compact_to_table(found: pb.CompactNeighbours) -> pa.Table:
    """A CompactNeighbours answer as the table Knn and Radius stream."""
    ids = (
        pa.array(found.string_ids, pa.string())
        if found.string_ids
        else pa.array(found.int_ids, pa.int64())
    )
    table = pa.table(
        {
            "query_index": pa.array(found.query_index, pa.int64()),
            "rank": pa.array(found.rank, pa.int32()),
            "id": ids,
            "distance_m": pa.array(found.distance_m, pa.float64()),
        }
    )
    return table.replace_schema_metadata(
        {
            "geonear.version": str(found.dataset_version),
            "geonear.earth_radius_m": repr(found.earth_radius_m),
        }
    )


def ipc_stream_bytes(table: pa.Table) -> bytes:
    """A complete Arrow IPC stream (schema and uncompressed batches) as bytes."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=WRITE_OPTIONS) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _named_in_utf8(schema: pa.Schema) -> pa.Schema:
    """The schema, once every field name (nested ones too) has been read as UTF-8: Arrow
    says names are UTF-8, but bytes off the wire may not be (UnicodeDecodeError is a
    ValueError, so the callers answer it as invalid bytes)."""
    fields = list(schema)
    while fields:
        field = fields.pop()
        _ = field.name
        fields.extend(field.type.field(i) for i in range(field.type.num_fields))
    return schema


def read_ipc_stream(data: bytes) -> pa.Table:
    """The table of an Arrow IPC stream: its schema, then record batches, each checked
    before it is read (``read_batch_message``); raises WireError."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(data))
        first = reader.read_next_message()
        if first.type != "schema":  # pyarrow reads any message as a schema, even crashing
            raise WireError(f"invalid Arrow IPC stream: it starts with a {first.type} message")
        schema = _named_in_utf8(pa.ipc.read_schema(first))
        messages = list(reader)
    except StopIteration:
        raise WireError("invalid Arrow IPC stream: it holds no schema") from None
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise WireError(f"invalid Arrow IPC stream: {exc}") from exc
    if any(pa.types.is_dictionary(f.type) for f in schema):
        raise WireError("invalid Arrow IPC stream: dictionary-encoded columns are not read")
    batches = [_read_checked_batch(m, schema) for m in messages]
    return pa.Table.from_batches(batches, schema=schema)


def points_to_message(lat: np.ndarray, lon: np.ndarray) -> pb.Points:
    """Query points as a Points message: inline when small, Arrow IPC when large."""
    lat = np.ascontiguousarray(lat, dtype=np.float64).ravel()
    lon = np.ascontiguousarray(lon, dtype=np.float64).ravel()
    if lat.shape != lon.shape:
        raise ValueError(f"lat and lon differ in length: {lat.shape[0]} != {lon.shape[0]}")
    if lat.shape[0] <= INLINE_POINTS:
        return pb.Points(lat=lat.tolist(), lon=lon.tolist())
    return pb.Points(arrow_ipc=ipc_stream_bytes(pa.table({"lat": lat, "lon": lon})))


def points_from_message(points: pb.Points) -> tuple[np.ndarray, np.ndarray]:
    """(lat, lon) float64 arrays of a Points message; raises WireError when malformed."""
    if points.arrow_ipc:
        if len(points.lat) or len(points.lon):
            raise WireError("set either inline lat/lon or arrow_ipc, not both")
        table = read_ipc_stream(points.arrow_ipc)
        missing = [c for c in ("lat", "lon") if c not in table.column_names]
        if missing:
            raise WireError(
                f"query points need columns lat and lon; missing {missing}, "
                f"found {table.column_names}"
            )
        out = []
        for name in ("lat", "lon"):
            col = table.column(name)
            if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
                raise WireError(f"query column {name} must be numeric, got {col.type}")
            if col.null_count:
                raise WireError(f"query column {name} has {col.null_count} null values")
            out.append(np.asarray(col.to_numpy(), dtype=np.float64))
        return out[0], out[1]
    lat = np.asarray(points.lat, dtype=np.float64)
    lon = np.asarray(points.lon, dtype=np.float64)
    if lat.shape != lon.shape:
        raise WireError(f"lat and lon differ in length: {lat.shape[0]} != {lon.shape[0]}")
    return lat, lon


def parse_timing(value: str) -> dict[str, float]:
    """Stage name -> seconds, from a ``geonear-timing`` value; unknown parts are skipped."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if name and key == "dur":
                with suppress(ValueError):
                    out[name] = float(number) / 1e3
    return out
