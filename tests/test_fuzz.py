"""Untrusted bytes and fields: fuzzed Arrow IPC and property tests over request fields.

For every input the server answers with a status from the documented set
(docs/errors.md), never UNKNOWN or INTERNAL; it keeps answering; and a refused upload
leaves the stored datasets exactly as they were. Iterations are bounded so that the
file runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import random
import struct
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pyarrow as pa
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import (
    BatchDecoder,
    WireError,
    ipc_stream_bytes,
    messages_to_table,
    points_from_message,
    read_arrowdata,
    tables_to_encoded,
)

#: Statuses an input may earn: the documented ones. UNKNOWN and INTERNAL mean a bug.
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
DECODER_MUTATIONS = 1500
UPLOAD_MUTATIONS = 120
QUERY_MUTATIONS = 80


def _sample_table(n: int = 64) -> pa.Table:
    rng = np.random.default_rng(0)
    return pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "lat": rng.uniform(-90, 90, n),
            "lon": rng.uniform(-180, 180, n),
            "name": pa.array([f"p{i}" * (i % 4) for i in range(n)]),
            "tags": pa.array([[i, i + 1][: i % 3] for i in range(n)], pa.list_(pa.int32())),
            "score": pa.array([None if i % 5 == 0 else float(i) for i in range(n)]),
        }
    )


SCHEMA_BYTES = _sample_table().schema.serialize().to_pybytes()
BATCH_BYTES = _sample_table().to_batches()[0].serialize().to_pybytes()


def _mutations(data: bytes, rng: random.Random) -> Iterator[bytes]:
    """Truncations, bit flips, byte overwrites and huge little-endian lengths."""
    while True:
        kind = rng.randrange(4)
        buf = bytearray(data)
        if kind == 0:
            yield bytes(buf[: rng.randrange(len(buf))])
        elif kind == 1:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(buf))
                buf[i] ^= 1 << rng.randrange(8)
            yield bytes(buf)
        elif kind == 2:
            i = rng.randrange(len(buf))
            buf[i : i + 4] = rng.randbytes(4)
            yield bytes(buf)
        else:
            # A length or offset field made huge (or negative): any aligned 8 bytes.
            i = rng.randrange(0, len(buf) - 8) & ~7
            buf[i : i + 8] = struct.pack("<q", rng.choice([1 << 40, (1 << 62) - 1, -1, 1 << 31]))
            yield bytes(buf)


# -- the decoder alone: many inputs -----------------------------------------------------------
def test_the_batch_decoder_refuses_or_fully_validates_every_mutation() -> None:
    rng = random.Random(1234)
    batches, schemas = _mutations(BATCH_BYTES, rng), _mutations(SCHEMA_BYTES, rng)
    accepted = refused = 0
    for i in range(DECODER_MUTATIONS):
        decoder = BatchDecoder()
        schema = next(schemas) if i % 5 == 0 else SCHEMA_BYTES
        try:
            decoder.decode(pb.ArrowData(schema=schema))
            batch = decoder.decode(pb.ArrowData(record_batch=next(batches)))
        except WireError:
            refused += 1
            continue
        # What gets through is structurally sound: every buffer in bounds, offsets sane.
        assert batch is not None
        batch.validate(full=True)
        batch.to_pylist()
        accepted += 1
    assert refused > DECODER_MUTATIONS // 2
    assert accepted + refused == DECODER_MUTATIONS


def test_arrowdata_read_by_hand_is_refused_or_matches_protobuf() -> None:
    """The client reads an answer's ArrowData messages from their wire format: a mutated
    message is refused with WireError, or read as protobuf reads it and then decoded
    (or refused) by the same checks."""
    table = _sample_table()
    (message,) = (m.data for m in tables_to_encoded([table]))
    assert messages_to_table([message]).equals(table)
    rng = random.Random(99)
    mutated = _mutations(message, rng)
    hand_refused = 0
    for _ in range(DECODER_MUTATIONS // 3):
        data = next(mutated)
        try:
            view = read_arrowdata(data)
        except WireError:
            hand_refused += 1
            continue
        try:
            parsed = pb.ArrowData.FromString(data)
        except DecodeError:  # protobuf refuses more (field numbers): a stricter reader
            continue
        assert (bytes(view.schema), bytes(view.record_batch), view.row_count) == (
            parsed.schema,
            parsed.record_batch,
            parsed.row_count,
        )
        with contextlib.suppress(WireError):
            messages_to_table([data]).validate(full=True)
    assert hand_refused > 0


def test_arrowdata_fields_of_the_wrong_wire_type_are_refused() -> None:
    # Field 1 (schema) as a varint; field 3 (row_count) as bytes; wire type 3 (a group).
    for data in (b"\x08\x01", b"\x1a\x01x", b"\x0b"):
        with pytest.raises(WireError):
            read_arrowdata(data)
    # Unknown fields are skipped, as protobuf skips them; row_count is an int64.
    view = read_arrowdata(b"\x20\x05\x29" + bytes(8) + b"\x18" + b"\xff" * 9 + b"\x01")
    assert (view.schema, view.record_batch, view.row_count) == (b"", b"", -1)


def test_query_point_bytes_are_refused_or_read_whole() -> None:
    good = ipc_stream_bytes(pa.table({"lat": [1.0, 2.0, 3.0], "lon": [4.0, 5.0, 6.0]}))
    rng = random.Random(99)
    mutations = _mutations(good, rng)
    for _ in range(DECODER_MUTATIONS // 2):
        try:
            lat, lon = points_from_message(pb.Points(arrow_ipc=next(mutations)))
        except WireError:
            continue
        assert lat.dtype == lon.dtype == np.float64 and lat.shape == lon.shape


def _compressed_batch_with_declared_length(length: int) -> tuple[bytes, bytes]:
    table = pa.table({"lat": np.zeros(1000), "lon": np.zeros(1000)})
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    reader = pa.ipc.MessageReader.open_stream(sink.getvalue())
    reader.read_next_message()  # the schema
    raw = reader.read_next_message().serialize().to_pybytes()
    at = raw.find(struct.pack("<q", 8000))  # the first buffer's uncompressed length
    assert at > 0
    return table.schema.serialize().to_pybytes(), raw[:at] + struct.pack("<q", length) + raw[
        at + 8 :
    ]


@pytest.mark.parametrize("declared", [1 << 40, 3 << 30, 7999])
def test_a_compressed_buffer_declaring_a_false_length_is_refused(declared: int) -> None:
    schema, batch = _compressed_batch_with_declared_length(declared)
    decoder = BatchDecoder()
    decoder.decode(pb.ArrowData(schema=schema))
    with pytest.raises(WireError, match="invalid Arrow record batch"):
        decoder.decode(pb.ArrowData(record_batch=batch))


# -- through the server -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from geonear.service.server import build_server
    from geonear.service.settings import Limits, ServerSettings

    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        data_dir=tmp_path_factory.mktemp("fuzz-data"),
        backend="cpu",
        log_requests=False,
        limits=Limits(max_k=100, max_matrix_cells=100_000, max_query_points=1000),
    )
    parts = build_server(settings)
    parts.server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{parts.port}")
    stub = pb_grpc.GeoNearStub(channel)
    _upload(stub, "base", _sample_table(200))
    yield stub, parts
    channel.close()
    parts.stop(None)


def _upload_requests(name: str, schema: bytes, batches: list[bytes], **header) -> list:
    messages = [pb.UploadRequest(header=pb.UploadHeader(dataset=name, **header))]
    messages.append(pb.UploadRequest(data=pb.ArrowData(schema=schema)))
    messages += [pb.UploadRequest(data=pb.ArrowData(record_batch=b)) for b in batches]
    return messages


def _upload(stub, name: str, table: pa.Table, **header) -> pb.UploadResponse:
    batches = [b.serialize().to_pybytes() for b in table.to_batches()]
    return stub.Upload(
        iter(_upload_requests(name, table.schema.serialize().to_pybytes(), batches, **header))
    )


def _snapshot(stub) -> list[tuple[str, int, int]]:
    listed = stub.ListDatasets(pb.ListDatasetsRequest(), timeout=30).datasets
    return [(d.name, d.version, d.rows) for d in listed]


def _expect_handled(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as exc:
        assert exc.code() in EXPECTED, f"{exc.code()}: {exc.details()}"
        return exc.code()
    return grpc.StatusCode.OK


def _still_answers(stub) -> None:
    reply = stub.Knn(
        pb.KnnRequest(dataset="base", queries=pb.Points(lat=[0.0], lon=[0.0]), k=3), timeout=30
    )
    assert sum(m.row_count for m in reply) == 3


def test_mutated_uploads_are_refused_without_touching_stored_data(fuzz_server) -> None:
    stub, parts = fuzz_server
    rng = random.Random(7)
    schemas, batches = _mutations(SCHEMA_BYTES, rng), _mutations(BATCH_BYTES, rng)
    before = _snapshot(stub)
    stored = 0
    for i in range(UPLOAD_MUTATIONS):
        name = f"fuzz{i}"
        schema = next(schemas) if i % 4 == 0 else SCHEMA_BYTES
        requests = _upload_requests(name, schema, [next(batches), BATCH_BYTES])
        code = _expect_handled(lambda r=requests: stub.Upload(iter(r), timeout=30))
        after = _snapshot(stub)
        if code == grpc.StatusCode.OK:
            # A mutation that is still a valid table (a flipped bit in a value) is stored.
            stored += 1
            stub.DropDataset(pb.DropDatasetRequest(dataset=name), timeout=30)
        else:
            assert after == before, f"refused upload {i} changed the store"
    assert _snapshot(stub) == before
    assert stored < UPLOAD_MUTATIONS // 2
    _still_answers(stub)
    assert parts.store.get("base").rows == 200


def test_mutated_query_points_are_refused_or_answered(fuzz_server) -> None:
    stub, _ = fuzz_server
    good = ipc_stream_bytes(pa.table({"lat": [1.0, 2.0], "lon": [3.0, 4.0]}))
    rng = random.Random(11)
    mutations = _mutations(good, rng)
    for _ in range(QUERY_MUTATIONS):
        points = pb.Points(arrow_ipc=next(mutations))
        _expect_handled(lambda p=points: stub.Knn(pb.KnnRequest(dataset="base", queries=p, k=2)))
        _expect_handled(
            lambda p=points: stub.DistanceMatrix(pb.DistanceMatrixRequest(queries=p, targets=p))
        )
    _still_answers(stub)


def _schema_and_batch(table: pa.Table) -> tuple[bytes, list[bytes]]:
    return table.schema.serialize().to_pybytes(), [
        b.serialize().to_pybytes() for b in table.to_batches()
    ]


ODD_TABLES: dict[str, Callable[[], pa.Table]] = {
    "uuid extension ids": lambda: pa.table(
        {
            "id": pa.ExtensionArray.from_storage(
                pa.uuid(), pa.array([bytes(16), b"\x01" * 16], pa.binary(16))
            ),
            "lat": [0.0, 1.0],
            "lon": [0.0, 1.0],
        }
    ),
    "json extension coordinates": lambda: pa.table(
        {
            "lat": pa.ExtensionArray.from_storage(pa.json_(), pa.array(["1.0", "2.0"])),
            "lon": [0.0, 1.0],
        }
    ),
    "bool8 extension attribute": lambda: pa.table(
        {
            "lat": [0.0, 1.0],
            "lon": [0.0, 1.0],
            "flag": pa.ExtensionArray.from_storage(pa.bool8(), pa.array([0, 1], pa.int8())),
        }
    ),
    "tensor extension latitude": lambda: pa.table(
        {
            "lat": pa.ExtensionArray.from_storage(
                pa.fixed_shape_tensor(pa.float64(), [2]),
                pa.array([[0.0, 1.0], [2.0, 3.0]], pa.list_(pa.float64(), 2)),
            ),
            "lon": [0.0, 1.0],
        }
    ),
    "struct latitude": lambda: pa.table(
        {"lat": pa.array([{"v": 1.0}, {"v": 2.0}]), "lon": [0.0, 1.0]}
    ),
    "dictionary latitude": lambda: pa.table(
        {"lat": pa.array(["a", "b"]).dictionary_encode(), "lon": [0.0, 1.0]}
    ),
    "duplicate column names": lambda: pa.Table.from_arrays(
        [pa.array([0.0]), pa.array([0.0]), pa.array([1.0])], names=["lat", "lon", "lat"]
    ),
    "half-float coordinates": lambda: pa.table(
        {"lat": pa.array(np.array([1.0], np.float16)), "lon": pa.array(np.array([1.0], np.float16))}
    ),
    "decimal coordinates": lambda: pa.table(
        {"lat": pa.array([1], pa.decimal128(38, 0)), "lon": pa.array([2], pa.decimal128(38, 0))}
    ),
    "no columns": lambda: pa.table({"lat": [0.0]}).drop_columns(["lat"]),
    "binary ids": lambda: pa.table({"id": [b"a"], "lat": [0.0], "lon": [0.0]}),
    "unsigned ids beyond int64": lambda: pa.table(
        {"id": pa.array([2**64 - 1], pa.uint64()), "lat": [0.0], "lon": [0.0]}
    ),
}


@pytest.mark.parametrize("case", ODD_TABLES)
def test_odd_schemas_are_refused_or_stored_whole(fuzz_server, case: str) -> None:
    stub, _ = fuzz_server
    before = _snapshot(stub)
    schema, batches = _schema_and_batch(ODD_TABLES[case]())
    name = "odd_" + case.replace(" ", "_").replace("-", "_")
    code = _expect_handled(lambda: stub.Upload(iter(_upload_requests(name, schema, batches))))
    if code == grpc.StatusCode.OK:
        info = stub.GetDataset(pb.GetDatasetRequest(dataset=name))
        assert info.rows >= 1
        stub.DropDataset(pb.DropDatasetRequest(dataset=name))
    assert _snapshot(stub) == before
    _still_answers(stub)


def test_a_batch_of_another_schema_is_refused(fuzz_server) -> None:
    stub, _ = fuzz_server
    schema = pa.schema([("lat", pa.float64()), ("lon", pa.float64())]).serialize().to_pybytes()
    other = pa.table({"lat": ["x"], "lon": ["y"]}).to_batches()[0].serialize().to_pybytes()
    code = _expect_handled(lambda: stub.Upload(iter(_upload_requests("other", schema, [other]))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


# -- properties over request fields ----------------------------------------------------------
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
coords = st.floats(allow_nan=True, allow_infinity=True, width=64) | st.floats(-90, 90)
names = st.text(max_size=140) | st.sampled_from(["base", "missing", "", "a" * 129, "../x"])
columns = st.lists(st.text(max_size=12) | st.sampled_from(["name", "score", "lat"]), max_size=3)


def _points(lat: list[float], lon: list[float]) -> pb.Points:
    return pb.Points(lat=lat, lon=lon)


@FUZZ
@given(
    dataset=names,
    lat=st.lists(coords, max_size=6),
    lon=st.lists(coords, max_size=6),
    k=st.integers(0, 2**32 - 1),
    max_distance=st.none() | st.floats(allow_nan=True),
    cols=columns,
)
def test_knn_fields(fuzz_server, dataset, lat, lon, k, max_distance, cols) -> None:
    stub, _ = fuzz_server
    request = pb.KnnRequest(dataset=dataset, queries=_points(lat, lon), k=k, columns=cols)
    if max_distance is not None:
        request.max_distance_m = max_distance
    _expect_handled(lambda: stub.Knn(request, timeout=30))


@FUZZ
@given(
    dataset=names,
    lat=st.lists(coords, max_size=6),
    lon=st.lists(coords, max_size=6),
    radius_m=st.floats(allow_nan=True, allow_infinity=True),
    cols=columns,
)
def test_radius_fields(fuzz_server, dataset, lat, lon, radius_m, cols) -> None:
    stub, _ = fuzz_server
    request = pb.RadiusRequest(
        dataset=dataset, queries=_points(lat, lon), radius_m=radius_m, columns=cols
    )
    _expect_handled(lambda: stub.Radius(request, timeout=30))


@FUZZ
@given(
    lat=st.lists(coords, max_size=5),
    lon=st.lists(coords, max_size=5),
    dataset=st.sampled_from(["", "base", "missing"]),
    int_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    string_ids=st.lists(st.text(max_size=5), max_size=2),
    targets=st.booleans(),
    dtype=st.integers(0, 7),
)
def test_matrix_fields(fuzz_server, lat, lon, dataset, int_ids, string_ids, targets, dtype) -> None:
    stub, _ = fuzz_server
    request = pb.DistanceMatrixRequest(queries=_points(lat, lon), dataset=dataset, dtype=dtype)
    if int_ids or string_ids:
        request.ids.int_ids.extend(int_ids)
        request.ids.string_ids.extend(string_ids)
    if targets:
        request.targets.CopyFrom(_points(lon, lat))
    _expect_handled(lambda: stub.DistanceMatrix(request, timeout=30))


@FUZZ
@example(
    dataset="base",
    k=2,
    seed=0,
    n_init=2**32 - 1,
    max_iter=1,
    tol=0.0,
    weight_column="",
    labels=False,
)
@given(
    dataset=st.sampled_from(["base", "missing", ""]),
    k=st.integers(0, 2**32 - 1) | st.integers(0, 300),
    seed=st.integers(0, 2**64 - 1),
    n_init=st.integers(0, 2**32 - 1) | st.integers(0, 3),
    max_iter=st.integers(0, 2**32 - 1) | st.integers(0, 5),
    tol=st.floats(allow_nan=True, allow_infinity=True),
    weight_column=st.sampled_from(["", "score", "name", "id", "nope"]),
    labels=st.booleans(),
)
def test_kmeans_fields(
    fuzz_server, dataset, k, seed, n_init, max_iter, tol, weight_column, labels
) -> None:
    stub, _ = fuzz_server
    request = pb.KMeansRequest(
        dataset=dataset,
        k=k,
        seed=seed,
        n_init=n_init,
        max_iter=max_iter,
        tol=tol,
        weight_column=weight_column,
        return_labels=labels,
    )
    _expect_handled(lambda: stub.KMeans(request, timeout=30))


@FUZZ
@given(
    dataset=names,
    mode=st.integers(0, 9),
    lat_column=st.text(max_size=6) | st.sampled_from(["lat", "lon", "id", "name"]),
    lon_column=st.text(max_size=6) | st.sampled_from(["lat", "lon", "id", "name"]),
    id_column=st.text(max_size=6) | st.sampled_from(["id", "name", "score", ""]),
)
def test_upload_header_fields(
    fuzz_server, dataset, mode, lat_column, lon_column, id_column
) -> None:
    stub, _ = fuzz_server
    before = _snapshot(stub)
    requests = _upload_requests(
        dataset,
        SCHEMA_BYTES,
        [BATCH_BYTES],
        mode=mode,
        lat_column=lat_column,
        lon_column=lon_column,
        id_column=id_column,
    )
    code = _expect_handled(lambda: stub.Upload(iter(requests), timeout=30))
    if code != grpc.StatusCode.OK:
        assert _snapshot(stub) == before
    elif dataset != "base":
        stub.DropDataset(pb.DropDatasetRequest(dataset=dataset), timeout=30)
    else:
        # a replace or append of the base dataset that succeeded: put it back
        _upload(stub, "base", _sample_table(200), mode=pb.REPLACE)


@FUZZ
@given(
    dataset=st.sampled_from(["base", "missing"]),
    int_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
    string_ids=st.lists(st.text(max_size=5), max_size=3),
)
def test_delete_fields(fuzz_server, dataset, int_ids, string_ids) -> None:
    stub, _ = fuzz_server
    request = pb.DeleteRowsRequest(dataset=dataset, int_ids=int_ids, string_ids=string_ids)
    code = _expect_handled(lambda: stub.DeleteRows(request, timeout=30))
    if code == grpc.StatusCode.OK and _snapshot(stub)[0][2] != 200:
        _upload(stub, "base", _sample_table(200), mode=pb.REPLACE)
    _still_answers(stub)
