"""Answers and request bodies of bounded size.

- Compressed Arrow bodies are refused from their metadata, before they inflate; so is a
  batch that declares more rows than its body holds. The hostile batches are built by
  hand (flatbuffer metadata and body), as a hostile client would.
- ``max_result_rows`` refuses a Knn, Radius or KMeans-labels answer before its work, from
  a size known in advance: queries x min(k, rows), or the engine's exact radius count.
- Compact answers are refused from the same sizes, before the search.
- Streamed answers are made in slices, so the server's memory follows the slice.

Memory is observed as the peak resident size of a server in a process of its own
(``VmHWM``, reset before each call where the kernel allows).
"""

from __future__ import annotations

import contextlib
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.clients.errors import ResourceExhausted
from geonear.geometry import EARTH_RADIUS_M, great_circle_m
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import Engine, EngineUnavailable, create_engine, engine_names
from geonear.service.queries.common import SLICE_ROWS
from geonear.service.server import ServerParts, build_server
from geonear.service.settings import (
    RESULT_ROWS_CEILING,
    RESULT_ROWS_FLOOR,
    Limits,
    ServerSettings,
    default_result_rows,
    physical_memory_bytes,
)
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import points_to_message, table_to_messages

sys.path.insert(0, str(Path(__file__).parent))
from server_process import start_server

MB = 1_000_000
#: Most a refused or streamed call may add to the server's peak resident size.
GROWTH_BOUND = 200 * MB
LAT_LON = pa.schema([("lat", pa.float64()), ("lon", pa.float64())])
CODECS = {"lz4_frame": 0, "zstd": 1}


# -- hostile Arrow bytes, built by hand -----------------------------------------------------
def _record_batch_message(
    length: int,
    nodes: list[tuple[int, int]],
    buffers: list[tuple[int, int]],
    body: bytes,
    codec: int | None = None,
) -> bytes:
    """An encapsulated Arrow IPC RecordBatch message: flatbuffer metadata (Message.fbs)
    declaring ``length`` rows, field nodes, buffers (offset, length) and, with ``codec``,
    a compressed body; then ``body``."""
    out = bytearray(8)  # the root offset, then the Message table's vtable

    def pad(n: int) -> None:
        out.extend(b"\0" * (-len(out) % n))

    def offset_to(at: int, target: int) -> None:
        struct.pack_into("<I", out, at, target - at)

    # Message: version (V5), header_type (RecordBatch), header, bodyLength
    vtable = len(out)
    out.extend(struct.pack("<HHHHHH", 12, 24, 4, 6, 8, 16))
    pad(8)
    message = len(out)
    out.extend(struct.pack("<ihBxI4xq", message - vtable, 4, 3, 0, len(body)))
    struct.pack_into("<I", out, 0, message)
    # RecordBatch: length, nodes, buffers, compression
    vtable = len(out)
    out.extend(struct.pack("<HHHHHH", 12, 24, 8, 4, 16, 0 if codec is None else 20))
    pad(8)
    batch = len(out)
    out.extend(struct.pack("<iIqII", batch - vtable, 0, length, 0, 0))
    offset_to(message + 8, batch)
    for field, items in ((4, nodes), (16, buffers)):
        out.extend(b"\0" * ((4 - len(out)) % 8))  # struct elements 8-aligned
        offset_to(batch + field, len(out))
        out.extend(struct.pack("<I", len(items)))
        for a, b in items:
            out.extend(struct.pack("<qq", a, b))
    if codec is not None:  # BodyCompression: codec, method (BUFFER)
        pad(2)
        vtable = len(out)
        out.extend(struct.pack("<HHHH", 8, 8, 4, 5))
        pad(8)
        compression = len(out)
        out.extend(struct.pack("<iBBxx", compression - vtable, codec, 0))
        offset_to(batch + 20, compression)
    pad(8)
    return struct.pack("<Ii", -1 & 0xFFFFFFFF, len(out)) + bytes(out) + body


def _inflating_batch(codec: str) -> bytes:
    """lat and lon of zeros, each a compressed buffer declaring 1 GiB once decompressed
    (Arrow's 8-byte length before the frames). zstd: 64 frames of 16 MiB of zeros, 531
    bytes each, which do inflate to 1 GiB; lz4_frame (one frame a buffer in Arrow): one
    frame of 16 MiB behind a declaration of 1 GiB."""
    frame = pa.Codec("lz4" if codec == "lz4_frame" else codec).compress(
        np.zeros(1 << 24, dtype=np.uint8)
    )
    repeats = 64 if codec == "zstd" else 1
    column = struct.pack("<q", 1 << 30) + frame.to_pybytes() * repeats
    size, padded = len(column), len(column) + (-len(column) % 8)
    rows = (1 << 30) // 8
    return _record_batch_message(
        rows,
        [(rows, 0), (rows, 0)],
        [(0, 0), (0, size), (padded, 0), (padded, size)],
        (column + bytes(padded - size)) * 2,
        codec=CODECS[codec],
    )


def _huge_length_batch(kind: str) -> tuple[pa.Schema, bytes]:
    """A batch declaring far more rows than its body holds."""
    if kind == "float64 columns":  # 2**40 rows over 64 bytes
        body = np.arange(3.0).tobytes() + bytes(8) + np.arange(3.0).tobytes() + bytes(8)
        rows = 1 << 40
        buffers = [(0, 0), (0, 24), (32, 0), (32, 24)]
        return LAT_LON, _record_batch_message(rows, [(rows, 0)] * 2, buffers, body)
    # null columns need no buffers, so 2**28 rows fit in no body at all
    schema = pa.schema([("lat", pa.null()), ("lon", pa.null())])
    rows = 1 << 28
    return schema, _record_batch_message(rows, [(rows, rows)] * 2, [], b"")


def _stream(schema: pa.Schema, batch: bytes) -> bytes:
    """An Arrow IPC stream: schema message, the batch, end of stream."""
    return schema.serialize().to_pybytes() + batch + struct.pack("<Ii", -1 & 0xFFFFFFFF, 0)


def _upload_call(
    stub: pb_grpc.GeoNearStub, schema: pa.Schema, batch: bytes
) -> Callable[[], object]:
    requests = [
        pb.UploadRequest(header=pb.UploadHeader(dataset="hostile")),
        pb.UploadRequest(data=pb.ArrowData(schema=schema.serialize().to_pybytes())),
        pb.UploadRequest(data=pb.ArrowData(record_batch=batch)),
    ]
    return lambda: stub.Upload(iter(requests), timeout=120)


def _query_call(stub: pb_grpc.GeoNearStub, schema: pa.Schema, batch: bytes) -> Callable[[], object]:
    points = pb.Points(arrow_ipc=_stream(schema, batch))
    request = pb.KnnRequest(dataset="big", queries=points, k=1)
    return lambda: list(stub.Knn(request, timeout=120))


# -- a server in a process of its own, for its memory ---------------------------------------
class Served:
    def __init__(self, proc, target: str) -> None:
        self.proc, self.target = proc, target
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GeoNearStub(self.channel)

    def _status_bytes(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {key} in /proc/{self.proc.pid}/status")

    def peak_growth(self, call: Callable[[], object]) -> tuple[int, object]:
        """(bytes the server's peak resident size grew by during ``call``, its result or
        RpcError)."""
        with contextlib.suppress(OSError):  # 5: the peak becomes the current size
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        before = self._status_bytes("VmHWM")
        try:
            result: object = call()
        except grpc.RpcError as exc:
            result = exc
        return self._status_bytes("VmHWM") - before, result


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("served")
    # max_upload_rows keeps a hostile upload that got through from being stored.
    args = ["-m", "geonear", "serve", "--port", "0", "--memory-only", "--backend", "cpu"]
    args += ["--no-request-log", "--max-upload-rows", "1000000"]
    proc, target = start_server(args, directory / "server.log", directory)
    server = Served(proc, target)
    try:
        lat, lon = uniform_points(200_000, seed=1)
        with Client(target, timeout_s=120) as client:
            client.upload("big", pa.table({"lat": lat, "lon": lon}))
        yield server
    finally:
        server.channel.close()
        proc.terminate()
        proc.wait(timeout=30)


def _refused(result: object, code: grpc.StatusCode, *words: str) -> None:
    assert isinstance(result, grpc.RpcError), f"not refused: {result!r}"[:300]
    assert result.code() == code, result.details()
    for word in words:
        assert word in result.details()


# -- 1. request bodies ---------------------------------------------------------------------
@pytest.mark.parametrize("path", ["upload", "query points"])
@pytest.mark.parametrize("codec", ["zstd", "lz4_frame"])
def test_compressed_record_batches_are_refused_before_they_inflate(
    served: Served, codec: str, path: str
) -> None:
    batch = _inflating_batch(codec)
    assert len(batch) < 200_000  # declaring 2 GiB
    call = (_upload_call if path == "upload" else _query_call)(served.stub, LAT_LON, batch)
    growth, result = served.peak_growth(call)
    _refused(result, grpc.StatusCode.INVALID_ARGUMENT, f"compressed ({codec})", "uncompressed")
    assert growth < GROWTH_BOUND
    assert "hostile" not in [
        d.name for d in served.stub.ListDatasets(pb.ListDatasetsRequest()).datasets
    ]


@pytest.mark.parametrize("path", ["upload", "query points"])
@pytest.mark.parametrize("kind", ["float64 columns", "null columns"])
def test_a_batch_declaring_more_rows_than_its_body_holds_is_refused(
    served: Served, kind: str, path: str
) -> None:
    schema, batch = _huge_length_batch(kind)
    call = (_upload_call if path == "upload" else _query_call)(served.stub, schema, batch)
    growth, result = served.peak_growth(call)
    _refused(result, grpc.StatusCode.INVALID_ARGUMENT, "declares", "rows, but its")
    assert growth < GROWTH_BOUND


def test_the_python_client_sends_uncompressed_batches(client: Client) -> None:
    lat, lon = uniform_points(10_000, seed=3)
    table = pa.table({"lat": lat, "lon": lon, "name": [f"p{i}" for i in range(10_000)]})
    assert len(list(table_to_messages(table, batch_bytes=1 << 16))) > 1
    assert client.upload("pts", table).rows == 10_000
    # more query points than travel inline: they go as an Arrow IPC stream
    assert points_to_message(lat, lon).arrow_ipc
    assert client.knn("pts", lat, lon, k=2).shape[0] == 20_000


# -- 2. max_result_rows ---------------------------------------------------------------------
@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ServerParts]]:
    started: list[ServerParts] = []

    def make(**limits: int) -> ServerParts:
        settings = ServerSettings(
            host="127.0.0.1",
            port=0,
            data_dir=None,
            backend="cpu",
            log_requests=False,
            limits=Limits(**limits),
        )
        parts = build_server(settings)
        parts.server.start()
        started.append(parts)
        return parts

    yield make
    for parts in started:
        parts.stop(None)


def _client(parts: ServerParts) -> Client:
    return Client(f"127.0.0.1:{parts.port}", timeout_s=60)


def _server_info(parts: ServerParts) -> pb.ServerInfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{parts.port}") as channel:
        return pb_grpc.GeoNearStub(channel).ServerInfo(pb.ServerInfoRequest(), timeout=30)


def test_server_info_reports_max_result_rows(make_server) -> None:
    assert _server_info(make_server(max_result_rows=12_345)).limits.max_result_rows == 12_345
    reported = _server_info(make_server()).limits.max_result_rows
    assert reported == Limits().result_rows() == default_result_rows(physical_memory_bytes())
    assert RESULT_ROWS_FLOOR <= reported <= RESULT_ROWS_CEILING


def test_the_default_max_result_rows_follows_host_memory() -> None:
    assert default_result_rows(0) == RESULT_ROWS_FLOOR
    assert default_result_rows(16 << 30) == (16 << 30) // 1200
    assert default_result_rows(64 << 30) == (64 << 30) // 1200
    assert default_result_rows(1 << 50) == RESULT_ROWS_CEILING


def _names_the_cap(message: str, cap: int) -> None:
    assert f"max_result_rows={cap}" in message
    assert "GEONEAR_MAX_RESULT_ROWS" in message


def test_knn_beyond_max_result_rows_is_refused(make_server) -> None:
    with _client(make_server(max_result_rows=1000)) as client:
        client.upload("pts", pa.table(dict(zip(("lat", "lon"), uniform_points(40), strict=True))))
        qlat, qlon = uniform_points(100, seed=2)
        # k above the dataset's rows counts as its rows: 25 x 40 = 1000, at the cap
        assert client.knn("pts", qlat[:25], qlon[:25], k=500).shape[0] == 1000
        for k in (11, 500):  # 100 x 11 and 100 x min(500, 40) rows
            with pytest.raises(ResourceExhausted) as refused:
                client.knn("pts", qlat, qlon, k=k)
            _names_the_cap(refused.value.message, 1000)


def test_radius_beyond_max_result_rows_is_refused_by_its_count(make_server) -> None:
    cap = 2000
    with _client(make_server(max_result_rows=cap)) as client:
        lat, lon = uniform_points(1000, seed=4)
        client.upload("pts", pa.table({"lat": lat, "lon": lon}))
        qlat, qlon = uniform_points(20, seed=5)
        distances = great_circle_m(qlat[:, None], qlon[:, None], lat[None, :], lon[None, :])
        # the radius whose answer is exactly the cap passes; one point more is refused
        radius_at_cap = float(np.sort(distances, axis=None)[cap - 1])
        assert int((distances <= radius_at_cap).sum()) == cap
        assert client.radius("pts", qlat, qlon, radius_at_cap).shape[0] == cap
        beyond = float(np.sort(distances, axis=None)[cap])
        for radius_m in (beyond, 1e9):
            with pytest.raises(ResourceExhausted) as refused:
                client.radius("pts", qlat, qlon, radius_m)
            _names_the_cap(refused.value.message, cap)
            assert f"{int((distances <= radius_m).sum())} result rows" in refused.value.message


def test_kmeans_labels_beyond_max_result_rows_are_refused(make_server) -> None:
    with _client(make_server(max_result_rows=500)) as client:
        client.upload("pts", pa.table(dict(zip(("lat", "lon"), uniform_points(1000), strict=True))))
        with pytest.raises(ResourceExhausted) as refused:
            client.kmeans("pts", k=3, return_labels=True)
        _names_the_cap(refused.value.message, 500)
        assert client.kmeans("pts", k=3).centroids.shape[0] == 3


# -- the radius count ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=engine_names())
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    try:
        engine = create_engine(request.param)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    yield engine
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def test_radius_count_is_the_radius_answers_size_on_every_engine(engine: Engine) -> None:
    lat, lon = clustered_points(3000, seed=11, n_clusters=40, spread_m=20_000.0)
    lat, lon = np.concatenate([lat, lat[:100]]), np.concatenate([lon, lon[:100]])  # duplicates
    qlat, qlon = uniform_points(300, seed=3)
    qlat, qlon = np.concatenate([qlat, lat[:40]]), np.concatenate([qlon, lon[:40]])
    index = engine.build_index(lat, lon)
    reference = create_engine("numpy-brute").build_index(lat, lon)
    # a radius equal to a distance between points puts a point on the boundary
    on_boundary = float(great_circle_m(lat[0], lon[0], lat[7], lon[7]))
    half_circumference = np.pi * EARTH_RADIUS_M
    for radius_m in (0.0, 1.0, 5_000.0, on_boundary, 400_000.0, half_circumference, 1e9):
        counts = index.radius_count(qlat, qlon, radius_m)
        assert counts.dtype == np.int64 and counts.shape == (qlat.shape[0],)
        assert np.array_equal(counts, np.diff(index.radius(qlat, qlon, radius_m).offsets))
        assert np.array_equal(counts, reference.radius_count(qlat, qlon, radius_m))
    assert index.radius_count(qlat[:0], qlon[:0], 5_000.0).shape == (0,)


# -- 3. compact answers ----------------------------------------------------------------------
@pytest.mark.parametrize("rpc", ["KnnCompact", "RadiusCompact"])
def test_compact_answers_beyond_their_bound_are_refused_before_the_search(
    served: Served, rpc: str
) -> None:
    if rpc == "KnnCompact":  # 1000 queries x k=10,000: 10M rows
        request = pb.KnnRequest(
            dataset="big", queries=points_to_message(*uniform_points(1000, seed=6)), k=10_000
        )
        rows = 10_000_000
    else:  # every point of 200k for each of 50 queries: 10M rows
        request = pb.RadiusRequest(
            dataset="big", queries=points_to_message(*uniform_points(50, seed=6)), radius_m=1e9
        )
        rows = 10_000_000
    growth, result = served.peak_growth(lambda: getattr(served.stub, rpc)(request, timeout=120))
    _refused(result, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{rows} result rows", "compact")
    assert growth < GROWTH_BOUND


# -- 4. streamed answers ---------------------------------------------------------------------
@pytest.mark.parametrize("rpc", ["Knn", "Radius"])
def test_a_large_streamed_answer_is_made_in_bounded_slices(served: Served, rpc: str) -> None:
    if rpc == "Knn":  # 100k queries x k=40: 4M rows
        request = pb.KnnRequest(
            dataset="big", queries=points_to_message(*uniform_points(100_000, seed=7)), k=40
        )
        call = served.stub.Knn
    else:  # every point of 200k for each of 20 queries: 4M rows
        request = pb.RadiusRequest(
            dataset="big", queries=points_to_message(*uniform_points(20, seed=7)), radius_m=1e9
        )
        call = served.stub.Radius
    growth, rows = served.peak_growth(lambda: sum(m.row_count for m in call(request, timeout=300)))
    assert rows == 4_000_000
    assert growth < GROWTH_BOUND  # ~110-140 bytes a row when the answer was made whole


@pytest.mark.parametrize("rpc", ["Knn", "Radius"])
def test_an_answer_of_many_slices_equals_one_engine_call(client: Client, rpc: str) -> None:
    lat, lon = clustered_points(3000, seed=12, n_clusters=30, spread_m=30_000.0)
    notes = pa.array([f"place {i}" for i in range(3000)])
    ids = np.arange(3000, dtype=np.int64) * 7
    client.upload("pts", pa.table({"id": ids, "lat": lat, "lon": lon, "note": notes}))
    qlat, qlon = uniform_points(30_000, seed=8)
    qlat[::10], qlon[::10] = lat, lon  # many queries inside clusters
    index = create_engine("cpu").build_index(lat, lon)
    if rpc == "Knn":
        got = client.knn("pts", qlat, qlon, k=12, columns=["note"], as_arrow=True)
        want = index.knn(qlat, qlon, 12)
        query_index = np.repeat(np.arange(qlat.shape[0]), 12)
        rows, distances = want.indices.ravel(), want.distances_m.ravel()
    else:
        got = client.radius("pts", qlat, qlon, 40_000.0, columns=["note"], as_arrow=True)
        want = index.radius(qlat, qlon, 40_000.0)
        query_index, rows, distances = want.query_index, want.indices, want.distances_m
    assert got.num_rows > 2 * SLICE_ROWS  # several slices
    assert np.array_equal(got.column("query_index").to_numpy(), query_index)
    assert np.array_equal(got.column("id").to_numpy(), ids[rows])
    assert np.allclose(got.column("distance_m").to_numpy(), distances, rtol=0, atol=1e-6)
    assert got.column("note").to_pylist() == notes.take(pa.array(rows)).to_pylist()
    assert got.schema.metadata[b"geonear.dataset"] == b"pts"
