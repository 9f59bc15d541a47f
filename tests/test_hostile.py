"""Hostile input against one real server process: every case ends in a documented status.

One ``geonear serve`` process (memory only, small limits, so that every case is cheap)
is started for the module and sent over two thousand seeded cases: adversarial Arrow
(compressed bodies and decompression bombs, forged lengths in the flatbuffer metadata,
dictionaries and dictionary deltas, types nested 63 deep, thousands of tiny batches,
schema/batch mismatches, truncated and bit-flipped bytes, wrong row counts, bad
coordinates, ids and column names, huge strings; ``hostile_arrow.py`` builds them) and adversarial
request fields (k, radii, columns, query sets at and beyond the limits, dataset names
that look like paths, matrices with both id kinds, k-means options, undecodable
protobuf).

Each case may end only in the statuses its kind documents (docs/errors.md): never
UNKNOWN, INTERNAL or a dropped connection. Every few cases the process must still be
alive, and its peak resident memory (VmHWM) stays under ``PEAK_RSS_LIMIT_BYTES``; at
the end a reference dataset uploaded first is unchanged and answers a known KNN exactly.
The peak memory and a summary are printed (``pytest -s``) and written to
``$TMPDIR/geonear-hostile-report.json``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import hostile_arrow as ha
import numpy as np
import pyarrow as pa
import pytest
from scipy.spatial import cKDTree
from server_process import start_server

from geonear.loaders.synthetic import uniform_points
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

Code: TypeAlias = grpc.StatusCode
OK = Code.OK
INVALID = Code.INVALID_ARGUMENT
NOT_FOUND = Code.NOT_FOUND
EXISTS = Code.ALREADY_EXISTS
PRECONDITION = Code.FAILED_PRECONDITION
EXHAUSTED = Code.RESOURCE_EXHAUSTED

# -- the server under test ------------------------------------------------------------------
MAX_K = 1000
MAX_QUERY_POINTS = 20_000
MAX_MATRIX_CELLS = 1_000_000
MAX_UPLOAD_ROWS = 30_000
MAX_MESSAGE_BYTES = 4 << 20
MAX_RESULT_ROWS = 20_000
MAX_HOST_BYTES = 128 << 20
MAX_CONCURRENT_RPCS = 16
MAX_CONCURRENT_UPLOADS = 4
UPLOAD_IDLE_TIMEOUT_S = 3
#: Set as environment variables, so that a setting the server does not know is ignored.
SERVER_ENV = {
    "GEONEAR_MAX_K": MAX_K,
    "GEONEAR_MAX_QUERY_POINTS": MAX_QUERY_POINTS,
    "GEONEAR_MAX_MATRIX_CELLS": MAX_MATRIX_CELLS,
    "GEONEAR_MAX_UPLOAD_ROWS": MAX_UPLOAD_ROWS,
    "GEONEAR_MAX_MESSAGE_BYTES": MAX_MESSAGE_BYTES,
    "GEONEAR_MAX_RESULT_ROWS": MAX_RESULT_ROWS,
    "GEONEAR_MAX_DATASET_HOST_BYTES": MAX_HOST_BYTES,
    "GEONEAR_MAX_CONCURRENT_RPCS": MAX_CONCURRENT_RPCS,
    "GEONEAR_MAX_CONCURRENT_UPLOADS": MAX_CONCURRENT_UPLOADS,
    "GEONEAR_UPLOAD_IDLE_TIMEOUT_S": UPLOAD_IDLE_TIMEOUT_S,
}
#: The process peaks at about 340 MiB over this suite (CPU backend, 2 cores); one
#: decompressed bomb (4 GiB) or an answer built past max_result_rows would pass this.
PEAK_RSS_LIMIT_BYTES = 1536 << 20
#: Liveness and memory are checked after every this many cases, and at each kind's end.
CHECK_EVERY = 25
CALL_TIMEOUT_S = 60
EARTH_RADIUS_M = 6_371_008.8
REPORT_PATH = Path(tempfile.gettempdir()) / "geonear-hostile-report.json"
#: Statuses a hostile case may never end in, whatever its kind.
NEVER = {Code.UNKNOWN, Code.INTERNAL, Code.UNAVAILABLE, Code.DATA_LOSS}

#: Datasets that stay for the whole module: the reference (never changed), a larger
#: one (more rows than one answer may hold) and a small one with weight columns.
REF, BIG, SMALL = "ref", "big", "small"
REF_ROWS, BIG_ROWS, SMALL_ROWS = 2000, 25_000, 200


def _codes(names: Iterable[str]) -> frozenset[Code]:
    return frozenset(grpc.StatusCode[n] for n in names)


@dataclass
class Outcome:
    kind: str
    label: str
    code: Code
    details: str
    accept: frozenset[Code]

    @property
    def failed(self) -> bool:
        return self.code not in self.accept or self.code in NEVER


@dataclass
class HostileServer:
    """The server process, a channel to it, and what the cases saw."""

    proc: Any
    target: str
    log_path: Path
    channel: grpc.Channel
    stub: pb_grpc.GeoNearStub
    started_s: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    peak_rss_kb: int = 0
    peak_hwm_kb: int = 0
    since_check: int = 0

    # -- health of the process -----------------------------------------------------------
    def memory_kb(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the server process, KiB."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
        return fields["VmRSS"], fields["VmHWM"]

    def check(self) -> None:
        """The process is alive, and its peak memory under the limit."""
        self.since_check = 0
        last = self.outcomes[-1] if self.outcomes else None
        after = f"{last.kind}: {last.label}" if last else "the start"
        if self.proc.poll() is not None:
            raise AssertionError(
                f"the server exited ({self.proc.returncode}) after {after}\n{self.log_tail()}"
            )
        rss, hwm = self.memory_kb()
        self.peak_rss_kb = max(self.peak_rss_kb, rss)
        self.peak_hwm_kb = max(self.peak_hwm_kb, hwm)
        assert hwm * 1024 < PEAK_RSS_LIMIT_BYTES, (
            f"server peak RSS {hwm / 1024:.0f} MiB beyond {PEAK_RSS_LIMIT_BYTES >> 20} MiB "
            f"after {after}"
        )

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    # -- cases -----------------------------------------------------------------------------
    def record(
        self, kind: str, label: str, code: Code, details: str, accept: Iterable[Code]
    ) -> Outcome:
        outcome = Outcome(kind, label, code, details, frozenset(accept))
        self.outcomes.append(outcome)
        self.since_check += 1
        if self.since_check >= CHECK_EVERY:
            self.check()
        return outcome

    def call(
        self, rpc: str, request: Any, timeout: float = CALL_TIMEOUT_S
    ) -> tuple[Code, str, Any]:
        """Run one RPC to its end (reading every streamed answer): (code, details, answer)."""
        method = getattr(self.stub, rpc)
        if rpc == "Upload":
            request = iter(request)  # gRPC reads a request stream with next()
        try:
            answer = method(request, timeout=timeout)
            if isinstance(answer, Iterator):
                answer = list(answer)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None
        return OK, "", answer

    def raw(self, rpc: str, data: bytes, streaming: bool) -> tuple[Code, str]:
        """Send ``data`` as the request message's bytes, whatever they hold."""
        method = f"/geonear.v1.GeoNear/{rpc}"
        try:
            if rpc == "Upload":
                self.channel.stream_unary(method)(iter([data]), timeout=CALL_TIMEOUT_S)
            elif streaming:
                list(self.channel.unary_stream(method)(data, timeout=CALL_TIMEOUT_S))
            else:
                self.channel.unary_unary(method)(data, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return OK, ""

    def drop(self, name: str) -> None:
        code, details, _ = self.call("DropDataset", pb.DropDatasetRequest(dataset=name))
        assert code == OK, f"cannot drop {name!r}: {code} {details}"

    def upload_table(self, name: str, table: pa.Table, mode: int = pb.CREATE) -> None:
        code, details, _ = self.call(
            "Upload",
            upload_requests(name, ha.schema_bytes(table), ha.batch_bytes(table), mode=mode),
        )
        assert code == OK, f"cannot upload {name!r}: {code} {details}"

    def version(self, name: str) -> tuple[int, int]:
        info = self.stub.GetDataset(pb.GetDatasetRequest(dataset=name), timeout=CALL_TIMEOUT_S)
        return info.version, info.rows


def upload_requests(
    name: str,
    schema: bytes,
    batches: Iterable[bytes],
    row_counts: list[int] | None = None,
    schema_alone: bool = True,
    **header: Any,
) -> Iterator[pb.UploadRequest]:
    """An Upload stream: the header (with the schema unless ``schema_alone``), then a
    message a batch, made as they are sent."""
    first = pb.UploadRequest(header=pb.UploadHeader(dataset=name, **header))
    if not schema_alone:
        first.data.schema = schema
    yield first
    if schema_alone:
        yield pb.UploadRequest(data=pb.ArrowData(schema=schema))
    for i, batch in enumerate(batches):
        count = row_counts[i] if row_counts and i < len(row_counts) else 0
        yield pb.UploadRequest(data=pb.ArrowData(record_batch=batch, row_count=count))


# -- data and the exact answer ------------------------------------------------------------
def great_circle_m(
    lat1: np.ndarray, lon1: np.ndarray, lat2: np.ndarray, lon2: np.ndarray
) -> np.ndarray:
    """Great-circle metres, atan2 (Vincenty) form, broadcasting; degrees in."""
    p1, l1, p2, l2 = (np.radians(np.asarray(v, np.float64)) for v in (lat1, lon1, lat2, lon2))
    dl = l2 - l1
    y = np.hypot(
        np.cos(p2) * np.sin(dl), np.cos(p1) * np.sin(p2) - np.sin(p1) * np.cos(p2) * np.cos(dl)
    )
    x = np.sin(p1) * np.sin(p2) + np.cos(p1) * np.cos(p2) * np.cos(dl)
    return EARTH_RADIUS_M * np.arctan2(y, x)


def unit_vectors(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    p, lam = np.radians(lat), np.radians(lon)
    return np.column_stack([np.cos(p) * np.cos(lam), np.cos(p) * np.sin(lam), np.sin(p)])


def reference_table() -> pa.Table:
    lat, lon = uniform_points(REF_ROWS, seed=7)
    rng = np.random.RandomState(3)
    return pa.table(
        {
            "id": pa.array(np.arange(REF_ROWS, dtype=np.int64) * 3 + 1),
            "lat": lat,
            "lon": lon,
            "name": pa.array([f"place {i}" for i in range(REF_ROWS)]),
            "score": pa.array([None if i % 7 == 0 else float(i) for i in range(REF_ROWS)]),
            "tag": pa.array(rng.randint(0, 5, REF_ROWS).astype(np.int32)),
        }
    )


def small_table() -> pa.Table:
    rng = np.random.RandomState(5)
    n = SMALL_ROWS
    weight = rng.uniform(0, 5, n)
    return pa.table(
        {
            "id": pa.array([f"s{i}" for i in range(n)]),
            "lat": rng.uniform(-60, 60, n),
            "lon": rng.uniform(-180, 180, n),
            "weight": weight,
            "negative": np.where(np.arange(n) == 3, -1.0, weight),
            "zero": np.zeros(n),
            "nulls": pa.array([None if i == 5 else 1.0 for i in range(n)]),
            "infinite": np.where(np.arange(n) == 9, np.inf, weight),
            "label": pa.array([f"l{i}" for i in range(n)]),
            "count": pa.array(np.arange(n, dtype=np.int64)),
        }
    )


QUERY_LAT = np.array([51.47, -33.94, 0.0, 89.9, -89.9, 12.3])
QUERY_LON = np.array([-0.45, 151.18, 0.0, 179.99, -179.99, -45.6])
KNOWN_K = 10


def expected_knn(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(ids, distances) of the KNOWN_K nearest reference points of each query, by brute force."""
    lat, lon = table.column("lat").to_numpy(), table.column("lon").to_numpy()
    d = great_circle_m(QUERY_LAT[:, None], QUERY_LON[:, None], lat[None, :], lon[None, :])
    order = np.argsort(d, axis=1, kind="stable")[:, :KNOWN_K]
    ids = table.column("id").to_numpy()
    return ids[order], np.take_along_axis(d, order, axis=1)


def assert_known_knn(server: HostileServer, table: pa.Table) -> None:
    request = pb.KnnRequest(
        dataset=REF, queries=pb.Points(lat=QUERY_LAT.tolist(), lon=QUERY_LON.tolist()), k=KNOWN_K
    )
    answer = server.stub.KnnCompact(request, timeout=CALL_TIMEOUT_S)
    ids, distances = expected_knn(table)
    got_ids = np.asarray(answer.int_ids).reshape(ids.shape)
    got_d = np.asarray(answer.distance_m).reshape(ids.shape)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_allclose(got_d, distances, rtol=0, atol=1e-3)


# -- the module's server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileServer]:
    workdir = tmp_path_factory.mktemp("hostile")
    saved = {k: os.environ.get(k) for k in SERVER_ENV}
    os.environ.update({k: str(v) for k, v in SERVER_ENV.items()})
    try:
        args = ["-m", "geonear", "serve", "--port", "0", "--memory-only", "--backend", "cpu"]
        proc, target = start_server([*args, "--no-request-log"], workdir / "server.log", workdir)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    channel = grpc.insecure_channel(target, options=options)
    server = HostileServer(
        proc, target, workdir / "server.log", channel, pb_grpc.GeoNearStub(channel)
    )
    try:
        server.upload_table(REF, reference_table())
        server.upload_table(BIG, ha.coords_table(np.random.RandomState(9), BIG_ROWS))
        server.upload_table(SMALL, small_table())
        assert_known_knn(server, reference_table())
        server.check()
        yield server
    finally:
        _write_report(server)
        channel.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _write_report(server: HostileServer) -> None:
    if server.proc.poll() is None:
        with contextlib.suppress(AssertionError):
            server.check()  # for the peak memory; a failure was reported where it came
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for o in server.outcomes:
        kinds[o.kind][o.code.name] += 1
    failures = [o for o in server.outcomes if o.failed]
    report = {
        "cases": len(server.outcomes),
        "runtime_s": round(time.monotonic() - server.started_s, 1),
        "peak_rss_mib": round(server.peak_rss_kb / 1024, 1),
        "peak_hwm_mib": round(server.peak_hwm_kb / 1024, 1),
        "server_alive": server.proc.poll() is None,
        "statuses_by_kind": {k: dict(v) for k, v in sorted(kinds.items())},
        "failures": [
            {
                "kind": o.kind,
                "case": o.label[:200],
                "status": o.code.name,
                "accepted": sorted(c.name for c in o.accept),
                "details": o.details[:300],
            }
            for o in failures
        ],
    }
    REPORT_PATH.write_text(json.dumps(report, indent=1))
    print(
        f"\nhostile suite: {report['cases']} cases in {report['runtime_s']} s, "
        f"{len(failures)} outside their documented statuses; server peak RSS (VmHWM) "
        f"{report['peak_hwm_mib']} MiB; report {REPORT_PATH}"
    )


# -- running a kind of case -----------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One request and the statuses it may end in; ``cleanup`` names a dataset to drop
    when the request created it, ``then`` checks what the answer left behind."""

    label: str
    rpc: str
    request: Any
    accept: frozenset[Code]
    cleanup: str | None = None
    then: Callable[[HostileServer, Code], None] | None = None


def run_cases(server: HostileServer, kind: str, cases: Iterable[Case]) -> None:
    """Run each case, record its status, and fail with every case outside its statuses."""
    for case in cases:
        request = case.request() if callable(case.request) else case.request
        code, details, _ = server.call(case.rpc, request)
        server.record(kind, case.label, code, details, case.accept)
        if code == OK and case.cleanup is not None:
            server.drop(case.cleanup)
        if case.then is not None:
            case.then(server, code)
    server.check()
    failed = [o for o in server.outcomes if o.kind == kind and o.failed]
    assert not failed, f"{len(failed)} {kind} case(s) outside their statuses:\n" + "\n".join(
        f"  {o.label[:120]}: {o.code.name} (accepted {sorted(c.name for c in o.accept)})"
        f" {o.details[:160]!r}"
        for o in failed[:40]
    )


_serial = iter(range(1 << 30))


def fresh_name(prefix: str = "h") -> str:
    return f"{prefix}{next(_serial)}"


def arrow_upload_cases(
    uploads: Iterable[ha.ArrowUpload], rng: np.random.RandomState
) -> Iterator[Case]:
    for upload in uploads:
        name = fresh_name()
        request = _upload_factory(name, upload, bool(rng.rand() < 0.7))
        yield Case(upload.label, "Upload", request, _codes(upload.accept), cleanup=name)


def _upload_factory(name: str, upload: ha.ArrowUpload, schema_alone: bool) -> Callable[[], Any]:
    return lambda: upload_requests(
        name, upload.schema, upload.batches, upload.row_counts, schema_alone, **upload.header
    )


# -- Arrow cases ---------------------------------------------------------------------------------
ARROW_KINDS: dict[str, Callable[[np.random.RandomState], Iterable[ha.ArrowUpload]]] = {
    "compressed": lambda rng: [
        *ha.compressed(rng, 40),
        *ha.compressed_false_lengths(rng),
        ha.zstd_bomb(),
        ha.lz4_bomb(),
    ],
    "forged lengths": ha.forged_lengths,
    "dictionaries": ha.dictionaries,
    "nested types": lambda rng: [*ha.nested(rng, 60), *ha.other_layouts(rng)],
    "many tiny batches": ha.many_tiny_batches,
    "schema mismatch": lambda rng: ha.schema_mismatches(rng, 40),
    "truncated": lambda rng: ha.truncated(rng, 150),
    "bit flips": lambda rng: ha.bit_flips(rng, 300),
    "row counts": ha.row_counts,
    "coordinates": ha.coordinates,
    "ids": ha.ids,
    "column names": ha.column_names,
    "huge strings": lambda rng: ha.huge_strings(rng, MAX_MESSAGE_BYTES),
    "too many rows": lambda rng: ha.too_many_rows(rng, MAX_UPLOAD_ROWS),
}


@pytest.mark.parametrize("kind", ARROW_KINDS)
def test_hostile_arrow_uploads_end_in_documented_statuses(
    hostile: HostileServer, kind: str
) -> None:
    rng = np.random.RandomState(sorted(ARROW_KINDS).index(kind) + 1)
    run_cases(hostile, kind, arrow_upload_cases(ARROW_KINDS[kind](rng), rng))


def test_hostile_query_points_end_in_documented_statuses(hostile: HostileServer) -> None:
    rng = np.random.RandomState(101)

    def cases() -> Iterator[Case]:
        for points in ha.query_points(rng, 40):
            accept = _codes(points.accept)
            queries = pb.Points(arrow_ipc=points.ipc)
            yield Case(
                f"Knn: {points.label}",
                "Knn",
                pb.KnnRequest(dataset=REF, queries=queries, k=3),
                accept,
            )
            yield Case(
                f"Radius: {points.label}",
                "Radius",
                pb.RadiusRequest(dataset=REF, queries=queries, radius_m=1000.0),
                accept,
            )
            yield Case(
                f"DistanceMatrix targets: {points.label}",
                "DistanceMatrix",
                pb.DistanceMatrixRequest(queries=pb.Points(lat=[1.0], lon=[2.0]), targets=queries),
                accept,
            )
        both = pb.Points(
            lat=[1.0], lon=[2.0], arrow_ipc=ha.ipc_stream(pa.table({"lat": [1.0], "lon": [2.0]}))
        )
        yield Case(
            "inline and Arrow points together",
            "Knn",
            pb.KnnRequest(dataset=REF, queries=both, k=1),
            frozenset({INVALID}),
        )
        for n, accept in ((MAX_QUERY_POINTS, OK), (MAX_QUERY_POINTS + 1, EXHAUSTED)):
            table = pa.table({"lat": rng.uniform(-90, 90, n), "lon": rng.uniform(-180, 180, n)})
            queries = pb.Points(arrow_ipc=ha.ipc_stream(table))
            for rpc in ("Knn", "KnnCompact"):
                request = pb.KnnRequest(dataset=REF, queries=queries, k=1)
                yield Case(f"{rpc}: {n} points as Arrow", rpc, request, frozenset({accept}))

    run_cases(hostile, "query points", cases())


# -- changes to the reference dataset are refused whole --------------------------------------
def test_refused_changes_leave_the_reference_dataset_untouched(hostile: HostileServer) -> None:
    rng = np.random.RandomState(202)
    ref = reference_table()
    first = ref.slice(0, 10)
    bad_lat = first.set_column(1, "lat", pa.array(np.full(10, 91.0)))
    null_ids = first.set_column(0, "id", pa.array([None] * 10, pa.int64()))
    other_schema = ha.coords_table(rng, 10)
    compressed = ha.stream_messages(first, pa.ipc.IpcWriteOptions(compression="zstd"))
    (batch,) = ha.batch_bytes(first)
    layout = ha.MessageLayout(batch)
    assert layout.length is not None
    variants: list[tuple[str, bytes, list[bytes], frozenset[Code]]] = [
        ("ids already stored", ha.schema_bytes(first), [batch], frozenset({INVALID})),
        ("bad latitude", ha.schema_bytes(bad_lat), ha.batch_bytes(bad_lat), frozenset({INVALID})),
        ("null ids", ha.schema_bytes(null_ids), ha.batch_bytes(null_ids), frozenset({INVALID})),
        (
            "other columns",
            ha.schema_bytes(other_schema),
            ha.batch_bytes(other_schema),
            frozenset({PRECONDITION, INVALID}),
        ),
        ("compressed", compressed[0], compressed[1:], frozenset({INVALID, EXHAUSTED})),
        (
            "forged length",
            ha.schema_bytes(first),
            [ha.with_int64(batch, layout.length, 1 << 40)],
            frozenset({INVALID, EXHAUSTED}),
        ),
        ("truncated", ha.schema_bytes(first), [batch[: len(batch) // 2]], frozenset({INVALID})),
    ]

    def untouched(server: HostileServer, code: Code) -> None:
        assert server.version(REF) == (1, REF_ROWS), "a refused change altered the reference"

    def cases() -> Iterator[Case]:
        for label, schema, batches, accept in variants:
            for mode, mode_name in (
                (pb.APPEND, "append"),
                (pb.REPLACE, "replace"),
                (pb.CREATE, "create"),
            ):
                if mode == pb.REPLACE and label in ("ids already stored", "other columns"):
                    continue  # a valid table: replace would succeed
                request = upload_requests(REF, schema, batches, mode=mode)
                allowed = accept | {EXISTS} if mode == pb.CREATE else accept
                yield Case(
                    f"{mode_name}: {label}", "Upload", list(request), allowed, then=untouched
                )
        twin = upload_requests("REF", ha.schema_bytes(first), [batch])
        yield Case(
            "a case twin of the reference",
            "Upload",
            list(twin),
            frozenset({EXISTS}),
            then=untouched,
        )
        for ids in ([-5, 10**18], [2]):
            yield Case(
                f"delete ids not stored {ids}",
                "DeleteRows",
                pb.DeleteRowsRequest(dataset=REF, int_ids=ids),
                frozenset({OK}),
                then=untouched,
            )
        yield Case(
            "delete both id kinds",
            "DeleteRows",
            pb.DeleteRowsRequest(dataset=REF, int_ids=[1], string_ids=["1"]),
            frozenset({INVALID}),
            then=untouched,
        )
        yield Case(
            "delete string ids of int ids",
            "DeleteRows",
            pb.DeleteRowsRequest(dataset=REF, string_ids=["1"]),
            frozenset({INVALID}),
            then=untouched,
        )

    run_cases(hostile, "reference untouched", cases())


# -- Upload streams that break the protocol ---------------------------------------------------
def test_broken_upload_streams_are_refused(hostile: HostileServer) -> None:
    rng = np.random.RandomState(303)
    table = ha.coords_table(rng, 8)
    schema, batches = ha.schema_bytes(table), ha.batch_bytes(table)
    empty = table.slice(0, 0).to_batches()

    def header(name: str, **fields: Any) -> pb.UploadRequest:
        return pb.UploadRequest(header=pb.UploadHeader(dataset=name, **fields))

    def data(**fields: Any) -> pb.UploadRequest:
        return pb.UploadRequest(data=pb.ArrowData(**fields))

    streams: list[tuple[str, Callable[[str], list[pb.UploadRequest]], frozenset[Code]]] = [
        ("empty stream", lambda n: [], frozenset({INVALID})),
        ("header only", lambda n: [header(n)], frozenset({INVALID})),
        ("data first", lambda n: [data(schema=schema), header(n)], frozenset({INVALID})),
        (
            "two headers",
            lambda n: [header(n), data(schema=schema), header(n)],
            frozenset({INVALID}),
        ),
        (
            "two schemas",
            lambda n: [
                header(n),
                data(schema=schema),
                data(schema=schema, record_batch=batches[0]),
            ],
            frozenset({INVALID}),
        ),
        (
            "batch before schema",
            lambda n: [header(n), data(record_batch=batches[0])],
            frozenset({INVALID}),
        ),
        ("schema, no batch", lambda n: [header(n), data(schema=schema)], frozenset({INVALID})),
        (
            "only empty batches",
            lambda n: (
                [header(n), data(schema=schema)]
                + [data(record_batch=b.serialize().to_pybytes()) for b in empty] * 3
            ),
            frozenset({INVALID}),
        ),
        (
            "empty messages between batches",
            lambda n: [
                header(n),
                data(schema=schema),
                pb.UploadRequest(),
                data(),
                data(record_batch=batches[0]),
                data(),
            ],
            frozenset({OK}),
        ),
        (
            "schema in the header message",
            lambda n: [
                pb.UploadRequest(
                    header=pb.UploadHeader(dataset=n),
                    data=pb.ArrowData(schema=schema, record_batch=batches[0]),
                )
            ],
            frozenset({OK}),
        ),
        (
            "schema bytes as a batch",
            lambda n: [header(n), data(schema=schema), data(record_batch=schema)],
            frozenset({INVALID}),
        ),
        (
            "batch bytes as the schema",
            lambda n: [header(n), data(schema=batches[0])],
            frozenset({INVALID}),
        ),
        (
            "garbage schema",
            lambda n: [header(n), data(schema=rng.bytes(64)), data(record_batch=batches[0])],
            frozenset({INVALID}),
        ),
        (
            "mode 7",
            lambda n: [header(n, mode=7), data(schema=schema, record_batch=batches[0])],
            frozenset({INVALID}),
        ),
        (
            "mode -1",
            lambda n: [header(n, mode=-1), data(schema=schema, record_batch=batches[0])],
            frozenset({INVALID}),
        ),
        (
            "append to a missing dataset",
            lambda n: [header(n, mode=pb.APPEND), data(schema=schema, record_batch=batches[0])],
            frozenset({NOT_FOUND}),
        ),
        (
            "latitude and longitude swapped",
            lambda n: [
                header(n, lat_column="lon", lon_column="lat"),
                data(schema=schema, record_batch=batches[0]),
            ],
            frozenset({OK, INVALID}),
        ),
        (
            "one column for both",
            lambda n: [
                header(n, lat_column="lat", lon_column="lat"),
                data(schema=schema, record_batch=batches[0]),
            ],
            frozenset({OK, INVALID}),
        ),
        (
            "ids as latitude",
            lambda n: [header(n, lat_column="id"), data(schema=schema, record_batch=batches[0])],
            frozenset({OK, INVALID}),
        ),
        (
            "100,000-character column name",
            lambda n: [
                header(n, lat_column="y" * 100_000),
                data(schema=schema, record_batch=batches[0]),
            ],
            frozenset({INVALID}),
        ),
        (
            "unicode column names",
            lambda n: [
                header(n, lat_column="緯度", lon_column="λ"),
                data(schema=schema, record_batch=batches[0]),
            ],
            frozenset({INVALID}),
        ),
    ]

    def cases() -> Iterator[Case]:
        for label, make, accept in streams:
            name = fresh_name()
            yield Case(label, "Upload", make(name), accept, cleanup=name)

    run_cases(hostile, "upload protocol", cases())


# -- dataset names ----------------------------------------------------------------------------
BAD_NAMES = [
    "",
    ".",
    "..",
    "...",
    ".hidden",
    "_x",
    "_partitions",
    "manifest.json",
    "MANIFEST.JSON",
    "manifest.json.tmp",
    "Manifest.Json.TMP",
    "-dash",
    "a" * 129,
    "a" * 10_000,
    "a" * 100_000,
    "a/b",
    "../etc",
    "..\\..\\x",
    "a\\b",
    "a\x00b",
    " a",
    "a ",
    "a\nb",
    "a:b",
    "a*b",
    "%2e%2e",
    "données",
    "名前",
    "🛰",
    "ａ",  # a fullwidth letter
    "a\u200bb",
]
GOOD_NAMES = [
    "a" * 128,
    "A",
    "9",
    "a.b-c_d",
    "x..y",
    "CON",
    "nul",
    "a.",
    "z-",
    "manifest.json2",
    "partitions",
]


def test_dataset_names_never_become_paths(hostile: HostileServer) -> None:
    table = ha.coords_table(np.random.RandomState(404), 4)
    schema, batches = ha.schema_bytes(table), ha.batch_bytes(table)

    def short_message(server: HostileServer, code: Code) -> None:
        last = server.outcomes[-1]
        assert len(last.details) < 1000, f"a {len(last.details)}-character status message"

    def cases() -> Iterator[Case]:
        for name in BAD_NAMES + GOOD_NAMES:
            bad = name in BAD_NAMES
            label = repr(name[:40]) + (f" ({len(name)} chars)" if len(name) > 40 else "")
            accept = frozenset({INVALID}) if bad else frozenset({OK})
            yield Case(
                f"Upload {label}",
                "Upload",
                list(upload_requests(name, schema, batches)),
                accept,
                cleanup=None if bad else name,
                then=short_message,
            )
            missing = frozenset({INVALID}) if bad else frozenset({NOT_FOUND})
            points = pb.Points(lat=[1.0], lon=[2.0])
            for rpc, request in (
                ("GetDataset", pb.GetDatasetRequest(dataset=name)),
                ("DropDataset", pb.DropDatasetRequest(dataset=name)),
                ("DeleteRows", pb.DeleteRowsRequest(dataset=name, int_ids=[1])),
                ("Knn", pb.KnnRequest(dataset=name, queries=points, k=1)),
                ("KnnCompact", pb.KnnRequest(dataset=name, queries=points, k=1)),
                ("Radius", pb.RadiusRequest(dataset=name, queries=points, radius_m=10.0)),
                ("RadiusCompact", pb.RadiusRequest(dataset=name, queries=points, radius_m=10.0)),
                ("KMeans", pb.KMeansRequest(dataset=name, k=1)),
                ("DistanceMatrix", pb.DistanceMatrixRequest(dataset=name, queries=points)),
                ("Upload append", None),
            ):
                if request is None:
                    yield Case(
                        f"{rpc} {label}",
                        "Upload",
                        list(upload_requests(name, schema, batches, mode=pb.APPEND)),
                        missing,
                        then=short_message,
                    )
                else:
                    yield Case(f"{rpc} {label}", rpc, request, missing, then=short_message)
        for name in ("Ref", "REF", "rEf", "BIG"):
            yield Case(
                f"case twin {name!r}",
                "Upload",
                list(upload_requests(name, schema, batches)),
                frozenset({EXISTS}),
                cleanup=name,
            )

    run_cases(hostile, "dataset names", cases())
    names = {d.name for d in hostile.stub.ListDatasets(pb.ListDatasetsRequest()).datasets}
    assert names == {REF, BIG, SMALL}


# -- request fields --------------------------------------------------------------------------
class Oracle:
    """The statuses a query may end in: the union of those of the problems it has (the
    server reports whichever it checks first), or OK when it has none."""

    def __init__(self) -> None:
        ref = reference_table()
        small = small_table()
        big = ha.coords_table(np.random.RandomState(9), BIG_ROWS)
        self.tables = {REF: ref, SMALL: small, BIG: big}
        self.trees = {
            name: cKDTree(unit_vectors(t.column("lat").to_numpy(), t.column("lon").to_numpy()))
            for name, t in self.tables.items()
        }

    def radius_rows(self, name: str, points: pb.Points, radius_m: float) -> tuple[int, int]:
        """Fewest and most neighbours within ``radius_m`` of the points, counted at a
        chord a hair shorter and longer than the radius's."""
        lat, lon = np.asarray(points.lat, np.float64), np.asarray(points.lon, np.float64)
        angle = radius_m / EARTH_RADIUS_M
        if angle >= np.pi:
            every = lat.shape[0] * self.tables[name].num_rows
            return every, every
        chord = 2 * np.sin(angle / 2)
        q = unit_vectors(lat, lon)
        tree = self.trees[name]
        low = tree.query_ball_point(q, chord * (1 - 1e-9), return_length=True)
        high = tree.query_ball_point(q, chord * (1 + 1e-9) + 1e-15, return_length=True)
        return int(np.sum(low)), int(np.sum(high))

    def dataset(self, name: str, problems: set[Code]) -> pa.Table | None:
        if name in self.tables:
            return self.tables[name]
        problems.add(INVALID if name in BAD_NAMES or not name else NOT_FOUND)
        return None

    @staticmethod
    def points(points: pb.Points, problems: set[Code], limit: bool = True) -> int:
        lat, lon = np.asarray(points.lat, np.float64), np.asarray(points.lon, np.float64)
        if lat.shape != lon.shape:
            problems.add(INVALID)
            return 0
        if limit and lat.shape[0] > MAX_QUERY_POINTS:
            problems.add(EXHAUSTED)
        with np.errstate(invalid="ignore"):
            if not ((np.abs(lat) <= 90).all() and (np.abs(lon) <= 180).all()):  # NaN too
                problems.add(INVALID)
        return int(lat.shape[0])

    @staticmethod
    def columns(table: pa.Table | None, columns: Iterable[str], problems: set[Code]) -> None:
        for c in columns:
            if c in ("id", "lat", "lon", "query_index", "rank", "distance_m"):
                problems.add(INVALID)
            elif table is not None and c not in table.column_names:
                problems.add(NOT_FOUND)

    def knn(self, request: pb.KnnRequest, compact: bool) -> frozenset[Code]:
        problems: set[Code] = set()
        n = self.points(request.queries, problems)
        table = self.dataset(request.dataset, problems)
        if request.k < 1:
            problems.add(INVALID)
        elif request.k > MAX_K:
            problems.add(EXHAUSTED)
        if request.HasField("max_distance_m"):
            d = request.max_distance_m
            if not (np.isfinite(d) and d >= 0):
                problems.add(INVALID)
        self.columns(table, request.columns, problems)
        if compact and request.columns:
            problems.add(INVALID)
        if table is not None and not problems:
            rows = n * min(request.k, table.num_rows)
            if rows > MAX_RESULT_ROWS or (compact and rows > 65_536):
                problems.add(EXHAUSTED)
        return frozenset(problems or {OK})

    def radius(self, request: pb.RadiusRequest, compact: bool) -> frozenset[Code]:
        problems: set[Code] = set()
        self.points(request.queries, problems)
        table = self.dataset(request.dataset, problems)
        r = request.radius_m
        if not (np.isfinite(r) and r >= 0):
            problems.add(INVALID)
        self.columns(table, request.columns, problems)
        if compact and request.columns:
            problems.add(INVALID)
        if table is not None and not problems:
            low, high = self.radius_rows(request.dataset, request.queries, r)
            for cap in (MAX_RESULT_ROWS, 65_536 if compact else MAX_RESULT_ROWS):
                if low > cap:
                    problems.add(EXHAUSTED)
                elif high > cap:  # at the cap within rounding: either answer is right
                    problems |= {OK, EXHAUSTED}
        return frozenset(problems or {OK})

    def matrix(self, request: pb.DistanceMatrixRequest) -> frozenset[Code]:
        problems: set[Code] = set()
        rows = self.points(request.queries, problems)
        cols = 0
        if request.dtype not in (0, 1, 2):
            problems.add(INVALID)
        if not request.dataset:
            if request.HasField("ids") or not request.HasField("targets"):
                problems.add(INVALID)
            else:
                cols = self.points(request.targets, problems, limit=False)
        else:
            if request.HasField("targets"):
                problems.add(INVALID)
            ids = request.ids
            if ids.int_ids and ids.string_ids:
                problems.add(INVALID)
            table = self.dataset(request.dataset, problems)
            if table is not None:
                stored = table.column("id")
                if ids.int_ids or ids.string_ids:
                    wanted = list(ids.int_ids) or list(ids.string_ids)
                    is_int = pa.types.is_integer(stored.type)
                    wrong_kind = not (ids.int_ids if is_int else ids.string_ids)
                    if wrong_kind or not set(wanted) <= set(stored.to_pylist()):
                        problems.add(INVALID)
                    cols = len(wanted)
                else:
                    cols = table.num_rows
        if rows * cols > MAX_MATRIX_CELLS:
            problems.add(EXHAUSTED)
        return frozenset(problems or {OK})

    def kmeans(self, request: pb.KMeansRequest) -> frozenset[Code]:
        problems: set[Code] = set()
        table = self.dataset(request.dataset, problems)
        if request.k > MAX_K:
            problems.add(EXHAUSTED)
        if table is not None:
            if request.return_labels and table.num_rows > MAX_RESULT_ROWS:
                problems.add(EXHAUSTED)
            if not 1 <= request.k <= table.num_rows:
                problems.add(INVALID)
        n_init = request.n_init or 1
        tol = request.tol or 1e-6
        if n_init > 1000 or not (np.isfinite(tol) and tol >= 0):
            problems.add(INVALID)
        w = request.weight_column
        if w and table is not None:
            if w not in table.column_names or w in ("id", "lat", "lon"):
                problems.add(INVALID)
            else:
                col = table.column(w)
                numeric = pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
                if not numeric or col.null_count:
                    problems.add(INVALID)
                else:
                    values = col.to_numpy().astype(np.float64)
                    if not (np.isfinite(values).all() and (values >= 0).all() and values.sum() > 0):
                        problems.add(INVALID)
        return frozenset(problems or {OK})


def _field_cases(rng: np.random.RandomState, oracle: Oracle) -> Iterator[Case]:
    """Chosen and random values of every query field."""
    one = pb.Points(lat=[48.85], lon=[2.35])
    # k: the edges, and beyond the limit.
    for k in (0, 1, 2, 999, MAX_K, MAX_K + 1, 2**31 - 1, 2**31, 2**32 - 1):
        for rpc in ("Knn", "KnnCompact"):
            request = pb.KnnRequest(dataset=REF, queries=one, k=k)
            yield Case(f"{rpc} k={k}", rpc, request, oracle.knn(request, rpc == "KnnCompact"))
    # max_distance_m and radius_m: NaN, infinities, negatives, zero, huge, subnormal.
    odd = [float("nan"), float("inf"), float("-inf"), -1.0, -0.0, 0.0, 5e-324, 1e12, 1e308, 2.5e7]
    for value in odd:
        request = pb.KnnRequest(dataset=REF, queries=one, k=5, max_distance_m=value)
        yield Case(f"Knn max_distance_m={value}", "Knn", request, oracle.knn(request, False))
        for rpc in ("Radius", "RadiusCompact"):
            for queries in (one, pb.Points(lat=[0.0] * 11, lon=[0.0] * 11)):
                r = pb.RadiusRequest(dataset=REF, queries=queries, radius_m=value)
                yield Case(
                    f"{rpc} radius_m={value} x {len(queries.lat)}",
                    rpc,
                    r,
                    oracle.radius(r, rpc == "RadiusCompact"),
                )
    # Attribute columns: unknown, reserved, empty, repeated, long, many.
    column_sets = [
        ["nope"],
        ["id"],
        ["distance_m"],
        ["query_index"],
        [""],
        ["name", "name"],
        ["name", "score", "tag"],
        ["n" * 100_000],
        ["名前"],
        ["name"] * 1000,
        [f"c{i}" for i in range(500)],
        ["score"],
        ["NAME"],
    ]
    for columns in column_sets:
        for rpc in ("Knn", "Radius", "KnnCompact"):
            shown = f"{columns[0][:20]!r} x {len(columns)}"
            if rpc == "Radius":
                r = pb.RadiusRequest(dataset=REF, queries=one, radius_m=2e6, columns=columns)
                yield Case(f"{rpc} columns {shown}", rpc, r, oracle.radius(r, False))
            else:
                request = pb.KnnRequest(dataset=REF, queries=one, k=3, columns=columns)
                yield Case(
                    f"{rpc} columns {shown}", rpc, request, oracle.knn(request, rpc == "KnnCompact")
                )
    # Query sets: empty, mismatched, at and beyond max_query_points and the message limit.
    sizes = [0, 1, MAX_QUERY_POINTS - 1, MAX_QUERY_POINTS, MAX_QUERY_POINTS + 1, 300_000, 600_000]
    for n in sizes:
        lat, lon = rng.uniform(-90, 90, n), rng.uniform(-180, 180, n)
        points = pb.Points(lat=lat.tolist(), lon=lon.tolist())
        over_message = n * 18 > MAX_MESSAGE_BYTES
        for rpc in ("Knn", "KnnCompact", "Radius"):
            if rpc == "Radius":
                request = pb.RadiusRequest(dataset=REF, queries=points, radius_m=1.0)
                accept = oracle.radius(request, False)
            else:
                request = pb.KnnRequest(dataset=REF, queries=points, k=1)
                accept = oracle.knn(request, rpc == "KnnCompact")
            if over_message:
                accept = frozenset({EXHAUSTED})
            yield Case(f"{rpc} {n} query points", rpc, request, accept)
        request = pb.DistanceMatrixRequest(queries=points, dataset=SMALL)
        yield Case(
            f"DistanceMatrix {n} x {SMALL_ROWS}",
            "DistanceMatrix",
            request,
            frozenset({EXHAUSTED}) if over_message else oracle.matrix(request),
        )
    mismatched = pb.Points(lat=[1.0, 2.0], lon=[1.0])
    yield Case(
        "Knn lat and lon of different lengths",
        "Knn",
        pb.KnnRequest(dataset=REF, queries=mismatched, k=1),
        frozenset({INVALID}),
    )
    # Random mixes of the fields above.
    coords = [
        0.0,
        45.0,
        -90.0,
        90.0,
        180.0,
        -180.0,
        90.5,
        -181.0,
        float("nan"),
        float("inf"),
        -0.0,
        1e-300,
    ]
    for i in range(400):
        n = int(rng.choice([0, 1, 2, 5, 40]))
        lat = rng.choice(coords, n) if rng.rand() < 0.3 else rng.uniform(-90, 90, n)
        lon = rng.choice(coords, n) if rng.rand() < 0.3 else rng.uniform(-180, 180, n)
        if rng.rand() < 0.05:
            lon = lon[:-1]
        points = pb.Points(lat=list(lat), lon=list(lon))
        dataset = str(rng.choice([REF, REF, SMALL, BIG, "missing", "..", "_x", ""]))
        columns = [
            str(c)
            for c in rng.choice(
                ["name", "score", "tag", "label", "id", "nope", "weight"], int(rng.randint(0, 3))
            )
        ]
        kind = i % 4
        if kind == 0:
            k = int(rng.choice([0, 1, 3, 10, 500, MAX_K, MAX_K + 1, 2**32 - 1]))
            request = pb.KnnRequest(dataset=dataset, queries=points, k=k, columns=columns)
            if rng.rand() < 0.4:
                request.max_distance_m = float(rng.choice(odd))
            rpc = "KnnCompact" if rng.rand() < 0.4 else "Knn"
            yield Case(f"random {rpc} {i}", rpc, request, oracle.knn(request, rpc == "KnnCompact"))
        elif kind == 1:
            radius = float(rng.choice([*odd, 10_000.0, 500_000.0]))
            request = pb.RadiusRequest(
                dataset=dataset, queries=points, radius_m=radius, columns=columns
            )
            rpc = "RadiusCompact" if rng.rand() < 0.4 else "Radius"
            yield Case(
                f"random {rpc} {i}", rpc, request, oracle.radius(request, rpc == "RadiusCompact")
            )
        elif kind == 2:
            request = pb.DistanceMatrixRequest(
                queries=points, dtype=int(rng.choice([0, 1, 2, 3, 99]))
            )
            choice = rng.randint(4)
            if choice == 0:
                request.targets.CopyFrom(pb.Points(lat=list(lon[: len(lat)] / 2), lon=list(lat)))
            else:
                request.dataset = dataset
                if choice >= 2:
                    request.ids.int_ids.extend(
                        int(v) for v in rng.choice([1, 4, 7, 2, -1, 2**62], int(rng.randint(0, 4)))
                    )
                if choice == 3:
                    request.ids.string_ids.extend(
                        str(v) for v in rng.choice(["s1", "s2", "x", ""], int(rng.randint(0, 3)))
                    )
            yield Case(
                f"random DistanceMatrix {i}", "DistanceMatrix", request, oracle.matrix(request)
            )
        else:
            request = pb.KMeansRequest(
                dataset=str(rng.choice([REF, SMALL, SMALL, BIG, "missing", "..."])),
                k=int(rng.choice([0, 1, 2, 8, 50, SMALL_ROWS + 1, MAX_K + 1, 2**32 - 1])),
                seed=int(rng.randint(0, 2**31)),
                n_init=int(rng.choice([0, 1, 3, 1001, 2**32 - 1])),
                max_iter=int(rng.choice([0, 1, 5, 2**32 - 1])),
                tol=float(rng.choice([0.0, 1e-3, -1.0, float("nan"), float("inf"), 1e300])),
                weight_column=str(
                    rng.choice(
                        [
                            "",
                            "",
                            "weight",
                            "negative",
                            "zero",
                            "nulls",
                            "infinite",
                            "label",
                            "count",
                            "id",
                            "nope",
                        ]
                    )
                ),
                return_labels=bool(rng.rand() < 0.5),
            )
            yield Case(f"random KMeans {i}", "KMeans", request, oracle.kmeans(request))


def _matrix_and_kmeans_cases(oracle: Oracle) -> Iterator[Case]:
    one = pb.Points(lat=[1.0], lon=[2.0])
    ids_cases = [
        ("both id kinds", REF, pb.IdList(int_ids=[1, 4], string_ids=["1"])),
        ("both id kinds, string dataset", SMALL, pb.IdList(int_ids=[1], string_ids=["s1"])),
        ("int ids of a string-id dataset", SMALL, pb.IdList(int_ids=[1])),
        ("string ids of an int-id dataset", REF, pb.IdList(string_ids=["1"])),
        ("ids not stored", REF, pb.IdList(int_ids=[2, 3])),
        ("ids stored", REF, pb.IdList(int_ids=[1, 4, 7, 1])),
        ("string ids stored", SMALL, pb.IdList(string_ids=["s1", "s0"])),
        ("empty id list", REF, pb.IdList()),
        ("int64 extremes", REF, pb.IdList(int_ids=[-(2**63), 2**63 - 1])),
    ]
    for label, dataset, ids in ids_cases:
        for dtype in (0, 2):
            request = pb.DistanceMatrixRequest(queries=one, dataset=dataset, ids=ids, dtype=dtype)
            yield Case(
                f"DistanceMatrix {label} dtype {dtype}",
                "DistanceMatrix",
                request,
                oracle.matrix(request),
            )
    shapes = [
        ("no columns at all", pb.DistanceMatrixRequest(queries=one)),
        ("dataset and targets", pb.DistanceMatrixRequest(queries=one, dataset=REF, targets=one)),
        (
            "ids without a dataset",
            pb.DistanceMatrixRequest(queries=one, ids=pb.IdList(int_ids=[1]), targets=one),
        ),
        ("dtype 3", pb.DistanceMatrixRequest(queries=one, targets=one, dtype=3)),
        ("dtype -1", pb.DistanceMatrixRequest(queries=one, targets=one, dtype=-1)),
        (
            "NaN target",
            pb.DistanceMatrixRequest(queries=one, targets=pb.Points(lat=[float("nan")], lon=[0.0])),
        ),
        ("no query points", pb.DistanceMatrixRequest(queries=pb.Points(), targets=one)),
        ("no targets", pb.DistanceMatrixRequest(queries=one, targets=pb.Points())),
        (
            "cells at the limit",
            pb.DistanceMatrixRequest(
                queries=pb.Points(lat=[0.0] * 500, lon=[0.0] * 500), dataset=REF
            ),
        ),
        (
            "cells beyond the limit",
            pb.DistanceMatrixRequest(
                queries=pb.Points(lat=[0.0] * 501, lon=[0.0] * 501), dataset=REF
            ),
        ),
        (
            "a big dataset",
            pb.DistanceMatrixRequest(
                queries=pb.Points(lat=[0.0] * 41, lon=[0.0] * 41), dataset=BIG
            ),
        ),
    ]
    for label, request in shapes:
        yield Case(f"DistanceMatrix {label}", "DistanceMatrix", request, oracle.matrix(request))
    kmeans: list[dict[str, Any]] = [
        dict(k=0),
        dict(k=1),
        dict(k=REF_ROWS),
        dict(k=REF_ROWS + 1),
        dict(k=MAX_K + 1),
        dict(k=2**32 - 1),
        dict(k=3, n_init=0),
        dict(k=3, n_init=1000, dataset=SMALL),
        dict(k=3, n_init=1001),
        dict(k=3, n_init=2**32 - 1),
        dict(k=3, max_iter=0),
        dict(k=3, max_iter=2**32 - 1),
        dict(k=3, max_iter=2**32 - 1, tol=1e-300),
        dict(k=3, tol=float("nan")),
        dict(k=3, tol=float("inf")),
        dict(k=3, tol=-1e-9),
        dict(k=3, tol=1e300),
        dict(k=3, seed=2**64 - 1),
        dict(k=3, return_labels=True),
        dict(k=3, return_labels=True, dataset=BIG),
        dict(k=3, dataset=BIG),
        dict(k=MAX_K, dataset=SMALL),
    ]
    weights = ["weight", "negative", "zero", "nulls", "infinite", "label", "count", "id"]
    for w in [*weights, "lat", "nope", "w" * 100_000]:
        kmeans.append(dict(k=3, dataset=SMALL, weight_column=w, return_labels=True))
    for fields in kmeans:
        fields = {"dataset": REF, **fields}
        request = pb.KMeansRequest(**fields)
        shown = ", ".join(f"{k}={str(v)[:20]}" for k, v in fields.items())
        yield Case(f"KMeans {shown}", "KMeans", request, oracle.kmeans(request))


def test_hostile_request_fields_end_in_documented_statuses(hostile: HostileServer) -> None:
    oracle = Oracle()
    rng = np.random.RandomState(505)
    run_cases(
        hostile, "request fields", [*_field_cases(rng, oracle), *_matrix_and_kmeans_cases(oracle)]
    )


# -- bytes that are not the request message ----------------------------------------------------
RPCS = {
    "Upload": False,
    "DeleteRows": False,
    "ListDatasets": False,
    "GetDataset": False,
    "DropDataset": False,
    "Knn": True,
    "Radius": True,
    "KnnCompact": False,
    "RadiusCompact": False,
    "DistanceMatrix": True,
    "KMeans": True,
    "ServerInfo": False,
    "CountWithin": True,
    "KnnJoin": True,
    "RadiusJoin": True,
    "Dbscan": True,
    "Within": True,
}


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_undecodable_request_messages_are_refused(hostile: HostileServer) -> None:
    """Bytes that are not a protobuf message of the RPC's request type: INVALID_ARGUMENT
    (an unknown method is gRPC's UNIMPLEMENTED). Decodable bytes with odd values
    (uint32 k sent as a negative 64-bit varint, unknown fields) get the usual statuses."""
    rng = np.random.RandomState(606)
    kind = "raw request bytes"
    garbage = [
        b"\xff\xff\xff",
        b"\x0a\x05ab",
        b"\x0a",
        b"\x12\xff\xff\xff\xff\x0f",
        b"\x08",
        rng.bytes(64),
        rng.bytes(1000),
    ]
    for rpc, streaming in RPCS.items():
        for data in garbage:
            code, details = hostile.raw(rpc, data, streaming)
            accept = {INVALID} if rpc not in ("ListDatasets", "ServerInfo") else {OK, INVALID}
            hostile.record(kind, f"{rpc} {data[:8]!r} ({len(data)} bytes)", code, details, accept)
    knn = pb.KnnRequest(dataset=REF, queries=pb.Points(lat=[1.0], lon=[2.0])).SerializeToString()
    for k in (-1, -(2**31), 2**32, 2**40, 2**63):
        code, details = hostile.raw("Knn", knn + b"\x18" + _varint(k), True)
        hostile.record(kind, f"Knn k as varint {k}", code, details, {OK, INVALID, EXHAUSTED})
    unknown = knn + b"\x18\x01" + b"\xa2\x06\x03abc" + b"\xf8\xff\xff\xff\x0f\x01"
    code, details = hostile.raw("Knn", unknown, True)
    hostile.record(kind, "Knn with unknown fields", code, details, {OK})
    code, details = hostile.raw("NoSuchMethod", b"", False)
    hostile.record(kind, "an unknown method", code, details, {Code.UNIMPLEMENTED})
    hostile.check()
    failed = [o for o in hostile.outcomes if o.kind == kind and o.failed]
    assert not failed, "\n".join(f"  {o.label}: {o.code.name} {o.details[:120]!r}" for o in failed)


# -- uploads that hold a slot --------------------------------------------------------------------
def _held_upload(
    name: str, release: threading.Event, heartbeat_s: float | None
) -> Iterator[pb.UploadRequest]:
    """An upload that sends its header and schema, then (with a heartbeat) empty
    messages until ``release``, or (without) nothing."""
    table = ha.coords_table(np.random.RandomState(7), 3)
    yield pb.UploadRequest(
        header=pb.UploadHeader(dataset=name), data=pb.ArrowData(schema=ha.schema_bytes(table))
    )
    while not release.wait(heartbeat_s if heartbeat_s else 30):
        if heartbeat_s:
            yield pb.UploadRequest()
    for batch in ha.batch_bytes(table):
        yield pb.UploadRequest(data=pb.ArrowData(record_batch=batch))


def test_an_idle_upload_is_ended_and_stores_nothing(hostile: HostileServer) -> None:
    release = threading.Event()
    name = fresh_name("idle")
    try:
        code, details, _ = hostile.call("Upload", _held_upload(name, release, None))
    finally:
        release.set()
    hostile.record(
        "upload idle timeout",
        "header and schema, then silence",
        code,
        details,
        {Code.DEADLINE_EXCEEDED},
    )
    code, details, _ = hostile.call("GetDataset", pb.GetDatasetRequest(dataset=name))
    hostile.record("upload idle timeout", "nothing stored", code, details, {NOT_FOUND})
    failed = [o for o in hostile.outcomes if o.kind == "upload idle timeout" and o.failed]
    assert not failed, failed


def test_open_uploads_leave_room_for_queries(hostile: HostileServer) -> None:
    """Uploads held open take at most their share of the call slots: one more upload is
    refused RESOURCE_EXHAUSTED, queries are still answered, and once the held uploads
    end, an upload is admitted again."""
    kind = "upload fairness"
    release = threading.Event()
    held: dict[str, tuple[Code, str] | None] = {}
    threads: list[threading.Thread] = []

    def hold() -> None:
        name = fresh_name("held")
        held[name] = None

        def run() -> None:
            held[name] = hostile.call("Upload", _held_upload(name, release, 0.1))[:2]

        threads.append(threading.Thread(target=run))
        threads[-1].start()

    table = ha.coords_table(np.random.RandomState(8), 3)
    for _ in range(MAX_CONCURRENT_UPLOADS):
        hold()
    refused = None
    try:
        # The held uploads are admitted as the server gets to them: until it has, a
        # probe is admitted too (and dropped), or a held one refused (and held again).
        for _ in range(200):
            for name, result in list(held.items()):
                if result is not None and result[0] == EXHAUSTED:
                    del held[name]
                    hold()
            probe = fresh_name("probe")
            requests = upload_requests(probe, ha.schema_bytes(table), ha.batch_bytes(table))
            code, details, _ = hostile.call("Upload", requests)
            if code == OK:
                hostile.drop(probe)
                time.sleep(0.05)
                continue
            refused = (code, details)
            break
        assert refused is not None, "one upload beyond the held ones was never refused"
        hostile.record(kind, "one upload beyond the share", *refused, {EXHAUSTED})
        one = pb.Points(lat=[1.0], lon=[1.0])
        for rpc, request in (
            ("Knn", pb.KnnRequest(dataset=REF, queries=one, k=2)),
            ("KnnCompact", pb.KnnRequest(dataset=REF, queries=one, k=2)),
            ("Radius", pb.RadiusRequest(dataset=REF, queries=one, radius_m=1e6)),
            ("ListDatasets", pb.ListDatasetsRequest()),
        ):
            code, details, _ = hostile.call(rpc, request)
            hostile.record(kind, f"{rpc} while uploads are held", code, details, {OK})
    finally:
        release.set()
        for t in threads:
            t.join(CALL_TIMEOUT_S)
    for name, result in held.items():
        assert result is not None
        hostile.record(kind, "a held upload completes", *result, {OK, EXHAUSTED})
        if result[0] == OK:
            hostile.drop(name)
    probe = fresh_name("probe")
    requests = upload_requests(probe, ha.schema_bytes(table), ha.batch_bytes(table))
    code, details, _ = hostile.call("Upload", requests)
    hostile.record(kind, "an upload after the held ones ended", code, details, {OK})
    if code == OK:
        hostile.drop(probe)
    failed = [o for o in hostile.outcomes if o.kind == kind and o.failed]
    assert not failed, "\n".join(f"  {o.label}: {o.code.name} {o.details[:160]!r}" for o in failed)


def test_concurrent_appends_without_ids_get_distinct_ids(hostile: HostileServer) -> None:
    """Appends of rows without ids, at once: each is stored or refused for the upload
    share, never refused for ids it did not send."""
    kind = "concurrent appends"
    rng = np.random.RandomState(909)
    name = fresh_name("appends")
    hostile.upload_table(name, ha.rowid_table(rng, 10))
    for round_ in range(3):
        parts = [ha.rowid_table(rng, 50) for _ in range(MAX_CONCURRENT_UPLOADS)]
        barrier = threading.Barrier(len(parts))
        codes: list[tuple[Code, str]] = []

        def append(
            table: pa.Table, barrier: threading.Barrier = barrier, codes: list = codes
        ) -> None:
            requests = list(
                upload_requests(name, ha.schema_bytes(table), ha.batch_bytes(table), mode=pb.APPEND)
            )
            barrier.wait()
            codes.append(hostile.call("Upload", requests)[:2])

        threads = [threading.Thread(target=append, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT_S)
        for i, (code, details) in enumerate(codes):
            hostile.record(kind, f"round {round_} append {i}", code, details, {OK, EXHAUSTED})
    stored = hostile.version(name)[1]
    appended = sum(1 for o in hostile.outcomes if o.kind == kind and o.code == OK)
    hostile.drop(name)
    failed = [o for o in hostile.outcomes if o.kind == kind and o.failed]
    assert not failed, "\n".join(f"  {o.label}: {o.code.name} {o.details[:160]!r}" for o in failed)
    assert stored == 10 + 50 * appended


# -- at the end -------------------------------------------------------------------------------
def test_the_server_survived_with_the_reference_intact(hostile: HostileServer) -> None:
    """Last: the process is alive, its memory stayed bounded, the reference dataset is
    the version uploaded first and answers the known KNN exactly; every case so far
    counted."""
    hostile.check()
    assert hostile.version(REF) == (1, REF_ROWS)
    assert_known_knn(hostile, reference_table())
    names = {d.name for d in hostile.stub.ListDatasets(pb.ListDatasetsRequest()).datasets}
    assert names == {REF, BIG, SMALL}, f"datasets left behind: {names - {REF, BIG, SMALL}}"
    assert len(hostile.outcomes) >= 1000, f"only {len(hostile.outcomes)} cases ran"
    print(
        f"\nserver peak RSS {hostile.peak_hwm_kb / 1024:.0f} MiB (VmHWM) after "
        f"{len(hostile.outcomes)} cases"
    )
