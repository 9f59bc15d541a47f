"""Arrow and protobuf on the wire, shared by the server and the client.

Bulk data travels as Arrow IPC inside messages: the serialized schema once, then
encapsulated record batches, each with its row count. The stream carries no dictionary
batches, so a dictionary-encoded column (a pandas categorical, say) travels as its values.
Small query point sets travel inline as repeated doubles, which costs less than Arrow's
fixed overhead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from geonear.v1 import geonear_pb2 as pb

#: Target size of one record batch on the wire; well under gRPC's 4 MiB default.
BATCH_BYTES = 1 << 20
#: Query sets up to this many points travel inline (repeated double).
INLINE_POINTS = 4096


class WireError(ValueError):
    """Bytes on the wire that are not valid Arrow IPC of the expected shape."""


def table_to_messages(table: pa.Table, batch_bytes: int = BATCH_BYTES) -> Iterator[pb.ArrowData]:
    """Arrow table as ArrowData messages: schema in the first, then batches of bounded size.

    An empty table still yields one message carrying the schema. Dictionary columns are
    sent decoded, as their value type.
    """
    table = _decode_dictionaries(table)
    schema_bytes = table.schema.serialize().to_pybytes()
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    rows_per_batch = max(1, batch_bytes // row_bytes)
    first = True
    for batch in table.to_batches(max_chunksize=rows_per_batch):
        if batch.num_rows == 0:
            continue
        yield pb.ArrowData(
            schema=schema_bytes if first else b"",
            record_batch=batch.serialize().to_pybytes(),
            row_count=batch.num_rows,
        )
        first = False
    if first:
        yield pb.ArrowData(schema=schema_bytes)


def _decode_dictionaries(table: pa.Table) -> pa.Table:
    for i, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            values = table.column(i).cast(field.type.value_type)
            table = table.set_column(i, field.with_type(field.type.value_type), values)
    return table


class BatchDecoder:
    """Decodes a stream of ArrowData messages, validating each batch against the schema."""

    def __init__(self) -> None:
        self.schema: pa.Schema | None = None

    def decode(self, data: pb.ArrowData) -> pa.RecordBatch | None:
        """The message's record batch (None when it carries only the schema)."""
        if data.schema:
            if self.schema is not None:
                raise WireError("a stream may carry its Arrow schema only once")
            try:
                self.schema = pa.ipc.read_schema(pa.py_buffer(data.schema))
            except (pa.ArrowException, ValueError, OSError) as exc:
                raise WireError(f"invalid Arrow schema bytes: {exc}") from exc
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
        try:
            batch = pa.ipc.read_record_batch(pa.py_buffer(data.record_batch), self.schema)
            batch.validate(full=True)
        except (pa.ArrowException, ValueError, OSError) as exc:
            raise WireError(f"invalid Arrow record batch: {exc}") from exc
        if data.row_count and batch.num_rows != data.row_count:
            raise WireError(
                f"record batch holds {batch.num_rows} rows but row_count says {data.row_count}"
            )
        return batch


def messages_to_table(messages: Iterable[pb.ArrowData]) -> pa.Table:
    """Reassemble a table from ArrowData messages (schema first)."""
    decoder = BatchDecoder()
    batches = [b for b in (decoder.decode(m) for m in messages) if b is not None]
    if decoder.schema is None:
        raise WireError("the Arrow stream carried no schema")
    return pa.Table.from_batches(batches, schema=decoder.schema)


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
    """A complete Arrow IPC stream (schema and batches) as bytes."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def read_ipc_stream(data: bytes) -> pa.Table:
    try:
        with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
            table = reader.read_all()
        for batch in table.to_batches():
            batch.validate(full=True)
        return table
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise WireError(f"invalid Arrow IPC stream: {exc}") from exc


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
