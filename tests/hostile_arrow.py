"""Seeded, structurally valid but adversarial Arrow IPC bytes, for ``test_hostile.py``.

Every generator takes a ``numpy.random.RandomState`` and returns cases whose bytes are
built by pyarrow from real tables and then edited where the attack lives: the
flatbuffer metadata of a record batch (its declared row count, a column's length or
null count, a buffer's offset or length, the body length), the body of a compressed
batch (a decompression bomb of concatenated zstd frames), or the bytes themselves
(truncated, bit-flipped). This process never reads the hostile bytes back; only the
server under test does.

A case says which statuses it may end in, by their gRPC names: ``OK`` where the bytes
are still a valid table, the refusals where they are not.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

REFUSED = frozenset({"INVALID_ARGUMENT"})
#: Bytes that would make the server allocate beyond its limits: refused either as
#: malformed or as too large, never accepted.
REFUSED_OR_LIMIT = frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})
STORED = frozenset({"OK"})
#: Random damage may leave a valid table (a flipped bit in a value) or not.
EITHER = frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})


@dataclass(frozen=True)
class ArrowUpload:
    """An Upload's Arrow part: schema bytes, record batch messages, their row counts."""

    label: str
    schema: bytes
    batches: list[bytes]
    accept: frozenset[str]
    row_counts: list[int] | None = None
    header: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ArrowPoints:
    """Query points as an Arrow IPC stream (``Points.arrow_ipc``)."""

    label: str
    ipc: bytes
    accept: frozenset[str]


# -- real tables ---------------------------------------------------------------------------
def coords_table(rng: np.random.RandomState, n: int) -> pa.Table:
    """Integer ids, valid coordinates."""
    return pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "lat": rng.uniform(-90, 90, n),
            "lon": rng.uniform(-180, 180, n),
        }
    )


def attrs_table(rng: np.random.RandomState, n: int) -> pa.Table:
    """String ids and attributes of several layouts (strings, nulls, lists)."""
    return pa.table(
        {
            "id": pa.array([f"p{i}" for i in range(n)]),
            "lat": rng.uniform(-90, 90, n),
            "lon": rng.uniform(-180, 180, n),
            "name": pa.array(["x" * int(rng.randint(0, 20)) for _ in range(n)]),
            "score": pa.array([None if i % 3 == 0 else float(i) for i in range(n)]),
            "tags": pa.array([list(range(i % 4)) for i in range(n)], pa.list_(pa.int32())),
        }
    )


def rowid_table(rng: np.random.RandomState, n: int) -> pa.Table:
    """No id column: the server numbers the rows."""
    return pa.table({"lat": rng.uniform(-90, 90, n), "lon": rng.uniform(-180, 180, n)})


TABLES: dict[str, Callable[[np.random.RandomState, int], pa.Table]] = {
    "coords": coords_table,
    "attrs": attrs_table,
    "rowid": rowid_table,
}


def schema_bytes(table: pa.Table | pa.Schema) -> bytes:
    schema = table if isinstance(table, pa.Schema) else table.schema
    return schema.serialize().to_pybytes()


def batch_bytes(table: pa.Table) -> list[bytes]:
    return [b.serialize().to_pybytes() for b in table.to_batches()]


def stream_messages(table: pa.Table, options: pa.ipc.IpcWriteOptions) -> list[bytes]:
    """Every message of the IPC stream pyarrow writes for ``table`` with ``options``:
    the schema first, then dictionary and record batches as written."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    reader = pa.ipc.MessageReader.open_stream(sink.getvalue())
    return [message.serialize().to_pybytes() for message in reader]


def ipc_stream(table: pa.Table, options: pa.ipc.IpcWriteOptions | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


# -- the flatbuffer metadata of an encapsulated message ------------------------------------
class MessageLayout:
    """Where the fields of one encapsulated record batch message lie in its bytes.

    The message is 0xFFFFFFFF, the metadata's int32 size, the flatbuffer ``Message``
    (format/Message.fbs), then the body. A table begins with the signed offset back to
    its vtable; the vtable lists each field's offset from the table (0: absent, the
    field holds its default). Every position here is absolute, into the message bytes.
    """

    def __init__(self, raw: bytes) -> None:
        assert raw[:4] == b"\xff\xff\xff\xff", "an encapsulated message with continuation"
        self.raw = raw
        self.meta_size = struct.unpack_from("<i", raw, 4)[0]
        self.base = 8
        self.body_start = self.base + self.meta_size
        message = self.base + struct.unpack_from("<I", raw, self.base)[0]
        self.body_length = self._field(message, 3)  # Message.bodyLength
        header = self._child(message, 2)  # Message.header
        assert header is not None
        self.batch = header
        self.length = self._field(header, 0)  # RecordBatch.length
        self.nodes = self._vector(header, 1, 16)  # [FieldNode{length, null_count}]
        self.buffers = self._vector(header, 2, 16)  # [Buffer{offset, length}]
        self.compression = self._field(header, 3)

    def _field(self, table: int, index: int) -> int | None:
        vtable = table - struct.unpack_from("<i", self.raw, table)[0]
        vtable_size = struct.unpack_from("<H", self.raw, vtable)[0]
        slot = 4 + 2 * index
        if slot + 2 > vtable_size:
            return None
        offset = struct.unpack_from("<H", self.raw, vtable + slot)[0]
        return table + offset if offset else None

    def _child(self, table: int, index: int) -> int | None:
        at = self._field(table, index)
        return None if at is None else at + struct.unpack_from("<I", self.raw, at)[0]

    def _vector(self, table: int, index: int, element: int) -> list[int]:
        start = self._child(table, index)
        if start is None:
            return []
        count = struct.unpack_from("<I", self.raw, start)[0]
        return [start + 4 + element * i for i in range(count)]

    def read(self, at: int) -> int:
        value: int = struct.unpack_from("<q", self.raw, at)[0]
        return value

    def buffer_span(self, i: int) -> tuple[int, int]:
        """(absolute start, length) of body buffer ``i``."""
        offset, length = struct.unpack_from("<qq", self.raw, self.buffers[i])
        return self.body_start + offset, length


def with_int64(raw: bytes, at: int, value: int) -> bytes:
    """``raw`` with the little-endian int64 at ``at`` set to ``value`` (wrapped to int64)."""
    out = bytearray(raw)
    struct.pack_into("<q", out, at, (value + (1 << 63)) % (1 << 64) - (1 << 63))
    return bytes(out)


# -- generators ------------------------------------------------------------------------------
def _random_table(rng: np.random.RandomState) -> tuple[str, pa.Table]:
    name = str(rng.choice(sorted(TABLES)))
    return name, TABLES[name](rng, int(rng.randint(2, 40)))


def compressed(rng: np.random.RandomState, count: int) -> Iterator[ArrowUpload]:
    """Valid tables whose batches are compressed (zstd, lz4_frame), one or several
    batches; a compressed body declares its own size, so it is refused whatever it holds."""
    for i in range(count):
        codec = ("zstd", "lz4")[i % 2]
        name, table = _random_table(rng)
        if rng.rand() < 0.3:
            table = pa.concat_tables([table] * int(rng.randint(2, 5)))
        options = pa.ipc.IpcWriteOptions(compression=codec)
        messages = stream_messages(table, options)
        yield ArrowUpload(
            f"{codec} {name} {table.num_rows} rows",
            messages[0],
            messages[1:],
            REFUSED_OR_LIMIT,
        )


def compressed_false_lengths(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """A compressed buffer whose 8-byte uncompressed-length prefix lies (too large,
    negative, or one short), so that a reader trusting it allocates that much."""
    for codec in ("zstd", "lz4"):
        table = pa.table({"lat": np.zeros(1000), "lon": np.zeros(1000)})
        schema, batch = stream_messages(table, pa.ipc.IpcWriteOptions(compression=codec))[:2]
        layout = MessageLayout(batch)
        start, _ = layout.buffer_span(1)  # lat's data buffer (0 is its absent validity)
        for declared in (1 << 40, 3 << 30, (1 << 63) - 1, -2, 7999, 8001):
            yield ArrowUpload(
                f"{codec} buffer declaring {declared} bytes",
                schema,
                [with_int64(batch, start, declared)],
                REFUSED_OR_LIMIT,
            )


def zstd_bomb(rows: int = 1 << 28) -> ArrowUpload:
    """A zstd batch that honestly decompresses to ``rows`` float64 zeros per column
    (2 GiB each by default) from about 70 KB of concatenated frames: a reader that
    decompresses it allocates all of it."""
    chunk = 1 << 23
    frame = pa.Codec("zstd").compress(bytes(chunk), asbytes=True)
    column_bytes = rows * 8
    assert column_bytes % chunk == 0
    compressed_column = struct.pack("<q", column_bytes) + frame * (column_bytes // chunk)
    padded = compressed_column + bytes(-len(compressed_column) % 8)
    table = pa.table({"lat": np.zeros(8), "lon": np.zeros(8)})
    schema, batch = stream_messages(table, pa.ipc.IpcWriteOptions(compression="zstd"))[:2]
    layout = MessageLayout(batch)
    metadata = batch[: layout.body_start]
    # Buffers: lat validity (empty), lat data, lon validity (empty), lon data.
    spans = [(0, 0), (0, len(compressed_column)), (len(padded), 0)]
    spans.append((len(padded), len(compressed_column)))
    for i, (offset, length) in enumerate(spans):
        metadata = with_int64(metadata, layout.buffers[i], offset)
        metadata = with_int64(metadata, layout.buffers[i] + 8, length)
    for node in layout.nodes:
        metadata = with_int64(metadata, node, rows)
    assert layout.length is not None and layout.body_length is not None
    metadata = with_int64(metadata, layout.length, rows)
    metadata = with_int64(metadata, layout.body_length, 2 * len(padded))
    return ArrowUpload(
        f"zstd bomb: {2 * column_bytes >> 30} GiB from {2 * len(padded) >> 10} KiB",
        schema,
        [metadata + padded + padded],
        REFUSED_OR_LIMIT,
    )


def lz4_bomb(rows: int = 1 << 22) -> ArrowUpload:
    """An lz4_frame batch of ``rows`` float64 zeros a column, honestly compressed
    (64 MiB a column from about 256 KiB)."""
    table = pa.table({"lat": np.zeros(rows), "lon": np.zeros(rows)})
    schema, batch = stream_messages(table, pa.ipc.IpcWriteOptions(compression="lz4"))[:2]
    return ArrowUpload(
        f"lz4 bomb: {rows * 16 >> 20} MiB from {len(batch) >> 10} KiB",
        schema,
        [batch],
        REFUSED_OR_LIMIT,
    )


#: Declared lengths that cannot fit a small body, or that overflow int32/int64 arithmetic.
HUGE = (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 40, (1 << 62) + 1, (1 << 63) - 1
NEGATIVE = -1, -(1 << 31), -(1 << 63)


def forged_lengths(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """Record batches whose metadata declares more than the body holds: the batch's row
    count, a column's length, null count, a buffer's offset or length, the body length.
    Smaller, consistent declarations (fewer rows) leave a valid batch."""
    for name in sorted(TABLES):
        table = TABLES[name](rng, int(rng.randint(4, 30)))
        schema = schema_bytes(table)
        (batch,) = batch_bytes(table)
        layout = MessageLayout(batch)
        n = table.num_rows
        assert layout.length is not None and layout.body_length is not None
        for value in (n + 1, 2 * n, *HUGE, *NEGATIVE):
            yield ArrowUpload(
                f"{name}: batch length {value}",
                schema,
                [with_int64(batch, layout.length, value)],
                REFUSED_OR_LIMIT,
            )
        yield ArrowUpload(
            f"{name}: batch length {n - 1} (fewer rows than the buffers hold)",
            schema,
            [with_int64(batch, layout.length, n - 1)],
            EITHER,
        )
        for i, node in enumerate(layout.nodes):
            for value in rng.choice(HUGE + NEGATIVE, 3, replace=False):
                yield ArrowUpload(
                    f"{name}: node {i} length {value}",
                    schema,
                    [with_int64(batch, node, int(value))],
                    REFUSED_OR_LIMIT,
                )
            for value in (n + 1, 1 << 40, -5):
                yield ArrowUpload(
                    f"{name}: node {i} null count {value}",
                    schema,
                    [with_int64(batch, node + 8, value)],
                    EITHER,
                )
        for i, buffer in enumerate(layout.buffers):
            _, length = layout.buffer_span(i)
            for value in (length + 8, *rng.choice(HUGE + NEGATIVE, 2, replace=False)):
                yield ArrowUpload(
                    f"{name}: buffer {i} length {value}",
                    schema,
                    [with_int64(batch, buffer + 8, int(value))],
                    # An empty buffer (the validity bitmap of a column without
                    # nulls) is never read, whatever its length says.
                    EITHER if value == length + 8 or length == 0 else REFUSED_OR_LIMIT,
                )
            for value in (1 << 40, -8):
                yield ArrowUpload(
                    f"{name}: buffer {i} offset {value}",
                    schema,
                    [with_int64(batch, buffer, value)],
                    # An empty buffer's offset is never read: it stays valid.
                    EITHER if length == 0 else REFUSED_OR_LIMIT,
                )
        for value in (1 << 40, -1, (1 << 63) - 1):
            yield ArrowUpload(
                f"{name}: body length {value}",
                schema,
                [with_int64(batch, layout.body_length, value)],
                REFUSED_OR_LIMIT,
            )


def _dict_table(rng: np.random.RandomState, n: int, column: str) -> pa.Table:
    table = coords_table(rng, n).append_column("name", pa.array([f"n{i % 3}" for i in range(n)]))
    i = table.schema.get_field_index(column)
    return table.set_column(i, column, table.column(column).dictionary_encode())


def dictionaries(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """Dictionary-encoded columns, dictionary batches and dictionary deltas: the wire
    carries no dictionary batches, so each is refused, nested ones included."""
    for column in ("name", "lat", "id"):
        table = _dict_table(rng, int(rng.randint(3, 20)), column)
        messages = stream_messages(table, pa.ipc.IpcWriteOptions())
        yield ArrowUpload(f"dictionary {column}: whole stream", messages[0], messages[1:], REFUSED)
        plain = schema_bytes(coords_table(rng, 1).append_column("name", pa.array(["a"])))
        yield ArrowUpload(
            f"dictionary {column}: its dictionary batch under a plain schema",
            plain,
            [messages[1]],
            REFUSED,
        )
    # Deltas: each batch grows the dictionary of the last.
    n = 6
    base = coords_table(rng, n)
    batches = []
    for step in range(1, 5):
        names = pa.DictionaryArray.from_arrays(
            pa.array(np.arange(n) % (step + 1), pa.int32()),
            pa.array([f"v{j}" for j in range(step + 1)]),
        )
        columns = [c.combine_chunks() for c in base.columns]
        batches.append(
            pa.RecordBatch.from_arrays([*columns, names], names=[*base.column_names, "name"])
        )
    table = pa.Table.from_batches(batches)
    for deltas in (True, False):
        options = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=deltas)
        messages = stream_messages(table, options)
        yield ArrowUpload(
            f"dictionary deltas={deltas}: {len(messages) - 1} messages",
            messages[0],
            messages[1:],
            REFUSED,
        )
        yield ArrowUpload(
            f"dictionary deltas={deltas}: dictionary batches only",
            schema_bytes(base.schema.append(pa.field("name", pa.string()))),
            [m for m in messages[1:] if pa.ipc.read_message(m).type == "dictionary batch"],
            REFUSED,
        )
    # Dictionaries inside a list or a struct: the schema's top level shows none.
    inner = pa.array(["a", "b", "a"]).dictionary_encode()
    nested = {
        "list of dictionary": pa.ListArray.from_arrays(pa.array([0, 1, 3, 3], pa.int32()), inner),
        "struct of dictionary": pa.StructArray.from_arrays([inner], names=["d"]),
    }
    for label, array in nested.items():
        table = coords_table(rng, len(array)).append_column("tag", array)
        messages = stream_messages(table, pa.ipc.IpcWriteOptions())
        yield ArrowUpload(label, messages[0], messages[1:], REFUSED)
        yield ArrowUpload(
            f"{label}: record batch without its dictionary",
            messages[0],
            [m for m in messages[1:] if pa.ipc.read_message(m).type == "record batch"],
            REFUSED,
        )


def nested_type(rng: np.random.RandomState, depth: int) -> tuple[str, pa.DataType]:
    """A type ``depth`` levels deep: lists, large lists, structs, or a random mix."""
    style = str(rng.choice(["list", "struct", "mixed", "large_list"]))
    t: pa.DataType = pa.float64()
    for level in range(depth):
        pick = style if style != "mixed" else str(rng.choice(["list", "struct", "large_list"]))
        if pick == "list":
            t = pa.list_(t)
        elif pick == "large_list":
            t = pa.large_list(t)
        else:
            t = pa.struct([pa.field(f"f{level}", t), pa.field("x", pa.int8())])
    return style, t


def nested(rng: np.random.RandomState, count: int) -> Iterator[ArrowUpload]:
    """Attribute (or coordinate) columns nested up to 63 levels deep, the most pyarrow
    writes (Arrow reads at most 64). An attribute is stored or refused; a nested
    coordinate is refused."""
    depths = [50, 63, 63, *rng.randint(2, 64, count)]
    for i, depth in enumerate(depths[:count]):
        style, t = nested_type(rng, int(depth))
        n = int(rng.randint(1, 5))
        values = pa.array([None] * n, t) if rng.rand() < 0.5 else _nested_values(t, n)
        base = coords_table(rng, n)
        as_coordinate = i % 7 == 3
        if as_coordinate:
            table = base.set_column(1, "lat", values)
        else:
            table = base.append_column("deep", values)
        yield ArrowUpload(
            f"{style} {depth} deep as {'lat' if as_coordinate else 'an attribute'}",
            schema_bytes(table),
            batch_bytes(table),
            REFUSED if as_coordinate else EITHER,
        )


def _nested_values(t: pa.DataType, n: int) -> pa.Array:
    def value(t: pa.DataType) -> object:
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return [value(t.value_type)]
        if pa.types.is_struct(t):
            return {t.field(0).name: value(t.field(0).type), "x": 1}
        return 1.5

    return pa.array([value(t) for _ in range(n)], t)


def other_layouts(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """Attributes of the layouts pyarrow can write beyond the common ones."""
    n = 4
    arrays = {
        "sparse union": pa.UnionArray.from_sparse(
            pa.array([0, 1, 0, 1], pa.int8()), [pa.array([1, 2, 3, 4]), pa.array(["a"] * 4)]
        ),
        "dense union": pa.UnionArray.from_dense(
            pa.array([0, 1, 0, 1], pa.int8()),
            pa.array([0, 0, 1, 1], pa.int32()),
            [pa.array([1, 2]), pa.array(["a", "b"])],
        ),
        "map": pa.array([[("k", 1)]] * n, pa.map_(pa.string(), pa.int64())),
        "list view": pa.array([[1], [2, 3], [], None], pa.list_view(pa.int64())),
        "string view": pa.array(["a" * 40, "b", None, "c"], pa.string_view()),
        "run-end encoded": pa.RunEndEncodedArray.from_arrays(
            pa.array([2, 4], pa.int32()), pa.array([1.0, 2.0])
        ),
        "fixed-size list of 65536": pa.FixedSizeListArray.from_arrays(
            pa.array(np.zeros(n * 65536, np.int8)), 65536
        ),
        "null type": pa.nulls(n),
        "large string": pa.array(["x" * 10] * n, pa.large_string()),
        "timestamps": pa.array(np.arange(n).astype("datetime64[ns]")),
        "decimal256": pa.array([1, 2, 3, 4], pa.decimal256(76, 0)),
    }
    for label, array in arrays.items():
        table = coords_table(rng, n).append_column("odd", array)
        yield ArrowUpload(f"{label} attribute", schema_bytes(table), batch_bytes(table), EITHER)
        coordinate = coords_table(rng, n).set_column(2, "lon", array)
        # A decimal longitude is a number: read as float64 and stored.
        accept = STORED if label == "decimal256" else REFUSED
        yield ArrowUpload(
            f"{label} longitude", schema_bytes(coordinate), batch_bytes(coordinate), accept
        )


def many_tiny_batches(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """Thousands of one-row and empty batches in one upload: all stored."""
    for n_batches, rows, label in ((2000, 1, "one-row"), (3000, 0, "empty"), (600, 1, "counted")):
        table = coords_table(rng, max(1, n_batches * rows))
        one = [table.slice(i, rows).to_batches(max_chunksize=1) for i in range(n_batches)]
        batches = [b.serialize().to_pybytes() for group in one for b in group]
        if rows == 0:
            empty = table.slice(0, 0).to_batches()
            zero = (
                empty[0]
                if empty
                else pa.RecordBatch.from_arrays(
                    [pa.array([], f.type) for f in table.schema], schema=table.schema
                )
            )
            batches = [zero.serialize().to_pybytes()] * n_batches + batch_bytes(table)
        counts = [1] * len(batches) if label == "counted" else None
        yield ArrowUpload(
            f"{len(batches)} {label} batches", schema_bytes(table), batches, STORED, counts
        )


def schema_mismatches(rng: np.random.RandomState, count: int) -> Iterator[ArrowUpload]:
    """A batch written under one schema sent under another: other types, other column
    counts, other order. Same-width types may reinterpret cleanly, so either."""
    pool = [
        coords_table(rng, 5),
        attrs_table(rng, 5),
        rowid_table(rng, 5),
        pa.table({"lat": pa.array([1, 2, 3], pa.int64()), "lon": pa.array([1, 2, 3], pa.int64())}),
        pa.table({"lat": ["1", "2"], "lon": ["3", "4"]}),
        pa.table({"lon": np.zeros(3), "lat": np.ones(3)}),
        pa.table({"lat": np.zeros(3, np.float32), "lon": np.zeros(3, np.float32)}),
        pa.table({"lat": [[1.0], [2.0]], "lon": [[1.0], [2.0]]}),
        pa.table({"a": np.zeros(2)}),
    ]
    for _ in range(count):
        a, b = rng.choice(len(pool), 2, replace=False)
        yield ArrowUpload(
            f"batch of table {b} under schema of table {a}",
            schema_bytes(pool[a]),
            batch_bytes(pool[b]),
            EITHER,
        )


def truncated(rng: np.random.RandomState, count: int) -> Iterator[ArrowUpload]:
    """The schema or a batch cut short at any byte."""
    for i in range(count):
        name, table = _random_table(rng)
        schema, (batch,) = schema_bytes(table), batch_bytes(table.combine_chunks())
        if i % 3 == 0:
            cut = int(rng.randint(1, len(schema)))
            yield ArrowUpload(
                f"{name} schema cut at {cut}/{len(schema)}", schema[:cut], [batch], EITHER
            )
        else:
            cut = int(rng.randint(1, len(batch)))
            yield ArrowUpload(
                f"{name} batch cut at {cut}/{len(batch)}", schema, [batch[:cut]], EITHER
            )


def bit_flips(rng: np.random.RandomState, count: int) -> Iterator[ArrowUpload]:
    """1 to 8 flipped bits, mostly in the flatbuffer metadata, where lengths live."""
    for _ in range(count):
        name, table = _random_table(rng)
        schema, (batch,) = schema_bytes(table), batch_bytes(table.combine_chunks())
        target = "schema" if rng.rand() < 0.25 else "batch"
        data = bytearray(schema if target == "schema" else batch)
        meta_end = 8 + struct.unpack_from("<i", data, 4)[0]
        flips = int(rng.randint(1, 9))
        for _ in range(flips):
            at = int(rng.randint(8, meta_end)) if rng.rand() < 0.7 else int(rng.randint(len(data)))
            data[at] ^= 1 << int(rng.randint(8))
        label = f"{name} {target}: {flips} bit(s) flipped"
        if target == "schema":
            yield ArrowUpload(label, bytes(data), [batch], EITHER)
        else:
            yield ArrowUpload(label, schema, [bytes(data)], EITHER)


def row_counts(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """ArrowData.row_count disagreeing with the batch (0 means unset: fine)."""
    table = coords_table(rng, 10)
    schema, batches = schema_bytes(table), batch_bytes(table)
    for value in (0, 10, 9, 11, -1, 1 << 31, (1 << 63) - 1, -(1 << 63), 1):
        accept = STORED if value in (0, 10) else REFUSED
        yield ArrowUpload(f"row_count {value} for 10 rows", schema, batches, accept, [value])


BAD_COORDINATES = (
    ("lat", float("nan")),
    ("lon", float("nan")),
    ("lat", float("inf")),
    ("lon", float("-inf")),
    ("lat", 90.000001),
    ("lat", -90.5),
    ("lon", 180.0000001),
    ("lon", -181.0),
    ("lat", 1e308),
    ("lon", -1.7976931348623157e308),
    ("lat", 1e300),
)
EDGE_COORDINATES = (
    ("lat", 90.0),
    ("lat", -90.0),
    ("lon", 180.0),
    ("lon", -180.0),
    ("lat", -0.0),
    ("lon", 5e-324),
    ("lat", 2.2250738585072014e-308),
)


def coordinates(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """One bad coordinate among valid rows, in float64, float32, float16, integers and
    decimals; the poles, the antimeridian and subnormals are ordinary points."""
    for column, value in BAD_COORDINATES + EDGE_COORDINATES:
        for dtype in ("float64", "float32"):
            table = coords_table(rng, int(rng.randint(2, 50)))
            values = table.column(column).to_numpy().copy()
            values[int(rng.randint(values.shape[0]))] = value
            with np.errstate(over="ignore"):
                cast = values.astype(dtype)
            bad = not (
                np.isfinite(cast).all() and (np.abs(cast) <= (90 if column == "lat" else 180)).all()
            )
            table = table.set_column(table.schema.get_field_index(column), column, pa.array(cast))
            yield ArrowUpload(
                f"{column}={value!r} as {dtype}",
                schema_bytes(table),
                batch_bytes(table),
                REFUSED if bad else STORED,
            )
    for label, lat, accept in (
        ("int8 coordinates", pa.array([1, -90, 90], pa.int8()), STORED),
        ("int8 latitude 127", pa.array([1, 127, 0], pa.int8()), REFUSED),
        ("uint64 latitude 2**64-1", pa.array([0, 2**64 - 1, 0], pa.uint64()), REFUSED),
        ("int64 latitude -2**63", pa.array([0, -(2**63), 0], pa.int64()), REFUSED),
        ("float16 latitude", pa.array(np.array([1.0, 2.0, 3.0], np.float16)), STORED),
        ("float16 inf", pa.array(np.array([1.0, np.inf, 3.0], np.float16)), REFUSED),
        ("decimal latitude", pa.array([1, 2, 3], pa.decimal128(38, 0)), STORED),
        ("decimal latitude 10**37", pa.array([1, 10**37, 3], pa.decimal128(38, 0)), REFUSED),
        ("null latitude", pa.array([1.0, None, 3.0]), REFUSED),
        ("all-null latitude", pa.array([None, None, None], pa.float64()), REFUSED),
        ("string latitude", pa.array(["1", "2", "3"]), REFUSED),
        ("boolean latitude", pa.array([True, False, True]), REFUSED),
        ("binary latitude", pa.array([b"1", b"2", b"3"]), REFUSED),
        ("struct latitude", pa.array([{"v": 1.0}] * 3), REFUSED),
        ("list latitude", pa.array([[1.0]] * 3), REFUSED),
        ("timestamp latitude", pa.array(np.array([0, 1, 2], dtype="datetime64[s]")), REFUSED),
    ):
        table = pa.table({"id": pa.array([1, 2, 3]), "lat": lat, "lon": [0.0, 1.0, 2.0]})
        yield ArrowUpload(label, schema_bytes(table), batch_bytes(table), accept)


def ids(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """Null, duplicate, out-of-range and odd-typed ids; huge and unicode string ids."""
    lat, lon = [0.0, 1.0, 2.0], [3.0, 4.0, 5.0]
    cases: list[tuple[str, pa.Array, frozenset[str]]] = [
        ("null int id", pa.array([1, None, 3]), REFUSED),
        ("all null ids", pa.array([None, None, None], pa.int64()), REFUSED),
        ("null string id", pa.array(["a", None, "c"]), REFUSED),
        ("duplicate int ids", pa.array([7, 7, 8]), REFUSED),
        ("duplicate string ids", pa.array(["x", "y", "x"]), REFUSED),
        ("uint64 id above int64", pa.array([1, 2**63, 3], pa.uint64()), REFUSED),
        ("uint64 ids within int64", pa.array([1, 2, 2**63 - 1], pa.uint64()), STORED),
        ("int64 extremes", pa.array([-(2**63), 0, 2**63 - 1]), STORED),
        ("int8 ids", pa.array([-128, 0, 127], pa.int8()), STORED),
        ("float ids", pa.array([1.0, 2.0, 3.0]), REFUSED),
        ("binary ids", pa.array([b"a", b"b", b"c"]), REFUSED),
        ("bool ids", pa.array([True, False, True]), REFUSED),
        ("list ids", pa.array([[1], [2], [3]]), REFUSED),
        ("empty string ids", pa.array(["", "a", "b"]), STORED),
        ("two empty string ids", pa.array(["", "", "b"]), REFUSED),
        ("unicode ids", pa.array(["名前", "données", "🛰️\u200d"]), STORED),
        ("NUL in ids", pa.array(["a\x00b", "a", "b"]), STORED),
        ("large_string ids", pa.array(["a", "b", "c"], pa.large_string()), STORED),
        ("1 MiB string id", pa.array(["i" * (1 << 20), "a", "b"]), STORED),
        ("dictionary ids", pa.array(["a", "b", "c"]).dictionary_encode(), REFUSED),
    ]
    for label, id_array, accept in cases:
        table = pa.table({"id": id_array, "lat": lat, "lon": lon})
        if pa.types.is_dictionary(id_array.type):
            messages = stream_messages(table, pa.ipc.IpcWriteOptions())
            yield ArrowUpload(label, messages[0], messages[1:], accept)
        else:
            yield ArrowUpload(label, schema_bytes(table), batch_bytes(table), accept)
    # Duplicates split across batches, found only when the batches are joined.
    table = coords_table(rng, 10)
    twice = pa.concat_tables([table, table])
    yield ArrowUpload(
        "duplicate ids in two batches", schema_bytes(table), batch_bytes(twice), REFUSED
    )
    # Ids under another name, mapped or not.
    renamed = table.rename_columns(["key", "lat", "lon"])
    yield ArrowUpload(
        "id column mapped",
        schema_bytes(renamed),
        batch_bytes(renamed),
        STORED,
        header={"id_column": "key"},
    )
    yield ArrowUpload(
        "id column mapped to a missing name",
        schema_bytes(renamed),
        batch_bytes(renamed),
        REFUSED,
        header={"id_column": "nope"},
    )
    yield ArrowUpload(
        "id column mapped to the latitude",
        schema_bytes(table),
        batch_bytes(table),
        EITHER,
        header={"id_column": "lat"},
    )
    clash = table.append_column("lat2", table.column("lat")).rename_columns(
        ["id", "y", "lon", "lat"]
    )
    yield ArrowUpload(
        "an attribute named lat beside the mapped latitude",
        schema_bytes(clash),
        batch_bytes(clash),
        REFUSED,
        header={"lat_column": "y"},
    )


def _replace_once(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and data.count(old) == 1, (old, data.count(old))
    return data.replace(old, new)


NOT_UTF8 = b"\xff\xfe\xc3\x28\xa0\xa1\xe2\x28"


def column_names(rng: np.random.RandomState) -> Iterator[ArrowUpload]:
    """Column names and string values that are not UTF-8 (Arrow requires it), empty,
    repeated, 100,000 characters long or holding NUL; schema metadata of 1 MiB."""
    base = coords_table(rng, 3)
    marker = b"QQQQQQQQ"
    for label, table, accept in (
        ("an attribute name", base.append_column("QQQQQQQQ", pa.array([1, 2, 3])), REFUSED),
        (
            "a struct field's name",
            base.append_column("s", pa.array([{"QQQQQQQQ": 1}] * 3)),
            frozenset({"OK", "INVALID_ARGUMENT"}),
        ),
    ):
        schema = _replace_once(schema_bytes(table), marker, NOT_UTF8)
        yield ArrowUpload(f"{label} not UTF-8", schema, batch_bytes(table), accept)
    for label, table in (
        ("string attribute values", base.append_column("name", pa.array(["QQQQQQQQ", "b", "c"]))),
        ("string ids", base.set_column(0, "id", pa.array(["QQQQQQQQ", "b", "c"]))),
    ):
        (batch,) = batch_bytes(table)
        yield ArrowUpload(
            f"{label} not UTF-8",
            schema_bytes(table),
            [_replace_once(batch, marker, NOT_UTF8)],
            REFUSED,
        )
    for label, name, accept in (
        ("an empty attribute name", "", frozenset({"OK", "INVALID_ARGUMENT"})),
        (
            "a 100,000-character attribute name",
            "n" * 100_000,
            frozenset({"OK", "INVALID_ARGUMENT"}),
        ),
        ("NUL in an attribute name", "a\x00b", frozenset({"OK", "INVALID_ARGUMENT"})),
        ("an attribute named like the id", "id", REFUSED),
    ):
        table = base.append_column(name, pa.array([1, 2, 3]))
        yield ArrowUpload(label, schema_bytes(table), batch_bytes(table), accept)
    meta = base.replace_schema_metadata({"k": "v" * (1 << 20)})
    yield ArrowUpload("1 MiB of schema metadata", schema_bytes(meta), batch_bytes(meta), STORED)
    # Wide schemas: stored, or beyond one message (RESOURCE_EXHAUSTED).
    for width, accept in ((10_000, STORED), (200_000, frozenset({"RESOURCE_EXHAUSTED"}))):
        ones = pa.array(np.ones(3, np.int8))
        wide = pa.Table.from_arrays(
            [*base.columns, *[ones] * width], names=[*base.column_names, *map(str, range(width))]
        )
        yield ArrowUpload(f"{width} columns", schema_bytes(wide), batch_bytes(wide), accept)


def huge_strings(rng: np.random.RandomState, max_message_bytes: int) -> Iterator[ArrowUpload]:
    """Attribute strings near and beyond one message's limit: stored below it, refused
    (RESOURCE_EXHAUSTED) above it, by geonear up to twice the limit and by gRPC beyond."""
    for size, accept in (
        (1 << 20, STORED),
        (max_message_bytes // 2, STORED),
        (max_message_bytes + 4096, frozenset({"RESOURCE_EXHAUSTED"})),
        (2 * max_message_bytes + 4096, frozenset({"RESOURCE_EXHAUSTED"})),
    ):
        table = coords_table(rng, 2).append_column("blob", pa.array(["s" * size, ""]))
        yield ArrowUpload(f"a {size}-byte string", schema_bytes(table), batch_bytes(table), accept)
    # Many long strings in several batches, each under the limit: together past the
    # host budget they are refused as they arrive.
    blob = "b" * (max_message_bytes // 2)
    table = coords_table(rng, 1).append_column("blob", pa.array([blob]))
    schema, (batch,) = schema_bytes(table), batch_bytes(table)
    yield ArrowUpload(
        "80 batches of half a message each", schema, [batch] * 80, frozenset({"RESOURCE_EXHAUSTED"})
    )


def too_many_rows(rng: np.random.RandomState, max_upload_rows: int) -> Iterator[ArrowUpload]:
    """One row beyond max_upload_rows, in one batch and in several."""
    table = rowid_table(rng, max_upload_rows + 1)
    schema = schema_bytes(table)
    yield ArrowUpload(
        f"{max_upload_rows + 1} rows in one batch",
        schema,
        batch_bytes(table.combine_chunks()),
        frozenset({"RESOURCE_EXHAUSTED"}),
    )
    parts = [
        b.serialize().to_pybytes() for b in table.to_batches(max_chunksize=max_upload_rows // 3)
    ]
    yield ArrowUpload(
        f"{max_upload_rows + 1} rows in {len(parts)} batches",
        schema,
        parts,
        frozenset({"RESOURCE_EXHAUSTED"}),
    )
    exact = rowid_table(rng, max_upload_rows)
    yield ArrowUpload(f"exactly {max_upload_rows} rows", schema, batch_bytes(exact), STORED)


# -- query points as Arrow -------------------------------------------------------------------
def query_points(rng: np.random.RandomState, count: int) -> Iterator[ArrowPoints]:
    """Points.arrow_ipc streams: valid, compressed, dictionary, forged, truncated, flipped."""
    good = pa.table({"lat": rng.uniform(-90, 90, 3), "lon": rng.uniform(-180, 180, 3)})
    yield ArrowPoints("valid", ipc_stream(good), STORED)
    yield ArrowPoints(
        "integer coordinates", ipc_stream(pa.table({"lat": [1, 2], "lon": [3, 4]})), STORED
    )
    yield ArrowPoints(
        "no rows", ipc_stream(good.slice(0, 0)), frozenset({"OK", "INVALID_ARGUMENT"})
    )
    yield ArrowPoints("schema only", schema_bytes(good), frozenset({"OK", "INVALID_ARGUMENT"}))
    for codec in ("zstd", "lz4"):
        yield ArrowPoints(
            f"{codec} compressed",
            ipc_stream(good, pa.ipc.IpcWriteOptions(compression=codec)),
            REFUSED_OR_LIMIT,
        )
    yield ArrowPoints(
        "dictionary latitude",
        ipc_stream(good.set_column(0, "lat", good.column("lat").dictionary_encode())),
        REFUSED,
    )
    yield ArrowPoints(
        "null latitude", ipc_stream(pa.table({"lat": [1.0, None], "lon": [1.0, 2.0]})), REFUSED
    )
    yield ArrowPoints(
        "string latitude", ipc_stream(pa.table({"lat": ["1"], "lon": [1.0]})), REFUSED
    )
    yield ArrowPoints(
        "NaN latitude", ipc_stream(pa.table({"lat": [np.nan], "lon": [1.0]})), REFUSED
    )
    yield ArrowPoints("no longitude", ipc_stream(pa.table({"lat": [1.0]})), REFUSED)
    yield ArrowPoints("a batch first", batch_bytes(good)[0], REFUSED)
    extra = good.append_column("QQQQQQQQ", pa.array([1, 2, 3]))
    not_utf8 = _replace_once(ipc_stream(extra), b"QQQQQQQQ", NOT_UTF8)
    yield ArrowPoints("a column name not UTF-8", not_utf8, REFUSED)
    bomb = zstd_bomb(1 << 24)
    yield ArrowPoints("zstd bomb: 256 MiB", bomb.schema + bomb.batches[0], REFUSED_OR_LIMIT)
    stream = ipc_stream(good)
    schema_len = len(schema_bytes(good))
    layout = MessageLayout(stream[schema_len:])
    assert layout.length is not None
    for value in HUGE + NEGATIVE:
        forged = stream[:schema_len] + with_int64(stream[schema_len:], layout.length, value)
        yield ArrowPoints(f"batch length {value}", forged, REFUSED_OR_LIMIT)
    for i in range(count):
        data = bytearray(stream)
        if i % 2:
            cut = int(rng.randint(1, len(data)))
            yield ArrowPoints(f"cut at {cut}/{len(data)}", bytes(data[:cut]), EITHER)
        else:
            for _ in range(int(rng.randint(1, 6))):
                data[int(rng.randint(len(data)))] ^= 1 << int(rng.randint(8))
            yield ArrowPoints("bits flipped", bytes(data), EITHER)
