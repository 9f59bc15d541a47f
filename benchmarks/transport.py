"""The transport alone: geonear's ArrowData stream over grpcio, variants of it, Arrow Flight.

``python benchmarks/transport.py --rows 1000000 --repeat 5 [--json out.json] [--markdown]``

Whether to keep the transport is a measurement: a result-shaped Arrow table (the Knn
answer without the search) goes from a server process to this one over loopback, by
each variant side by side, in both of the answer's layouts:

- rows: query_index int64, rank int32, id int64, distance_m float64 (28 bytes a row);
- per_query: id fixed_size_list<int64, k>, distance_m fixed_size_list<float64, k>
  (16 bytes a neighbour).

``--rows`` counts neighbours (1,000,000 = 100,000 queries x k = 10). Variants:

- geonear-arrowdata: the product's path minus the search, with protobuf objects (as the
  server wrote its answers before ``wire.tables_to_encoded``). A grpc.aio server (as
  ``geonear serve``) whose server-streaming handler yields
  ``geonear.wire.table_to_messages(table)`` (pb.ArrowData, 1 MiB batches, serialized by
  ``ArrowData.SerializeToString``); the sync grpc client (as ``geonear.connect``)
  deserializes with ``ArrowData.FromString`` and decodes with
  ``geonear.wire.messages_to_table``.
- arrowdata-preencoded: the same bytes on the wire, written without protobuf objects,
  as the server now writes its answers (``wire.tables_to_encoded``: tag, varint length,
  the ``batch.serialize()`` buffer, row_count, one ``b"".join``), yielded to an
  identity serializer; the client takes raw bytes and reads them as the Python client
  now does (``geonear.wire.messages_to_table`` of bytes: the fields found by slicing,
  the record batch handed to pyarrow without a copy, the same checks). What skipping
  the protobuf copies gains.
- grpc-raw-bytes: the table's Arrow IPC stream, written once when the server starts,
  sent in 1 MiB chunks through identity serializers; the client joins them and reads
  the stream (``geonear.wire.read_ipc_stream``). The floor of grpcio's transport.
- flight-do_get: a pyarrow.flight server (``do_get`` returns
  ``flight.RecordBatchStream(table)``, batches of 1 MiB) and ``do_get(...).read_all()``.
- ipc-in-process, arrowdata-in-process: no transport; an IPC stream written to a buffer
  and read back, and geonear's codec (table_to_messages, SerializeToString, FromString,
  messages_to_table) in one process: the cost of the serialisation alone.

Each served variant has a server process of its own on 127.0.0.1, port 0, started once
and warmed by one transfer, whose answer is compared with the table sent. Then the
variants take turns, one transfer each, ``--repeat`` rounds: a transfer is timed from
the request sent to the whole table received and decoded into a pyarrow Table. The table
gives the fastest and median ms, MB/s of the table's bytes at the fastest, ``x`` (the
geonear-arrowdata fastest over this variant's: above 1 is faster), and the CPU time per
transfer of the server process (its ``time.process_time()``, asked between transfers)
and of this process (the client, its gRPC threads included).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa

from geonear import wire
from geonear.v1 import geonear_pb2 as pb

try:
    from pyarrow import flight
except ImportError as exc:  # pyarrow built without Flight
    flight = None
    FLIGHT_MISSING = f"pyarrow.flight is not importable: {exc}"
else:
    FLIGHT_MISSING = ""

LAYOUTS = ("rows", "per_query")
SERVED = ("geonear-arrowdata", "arrowdata-preencoded", "grpc-raw-bytes", "flight-do_get")
IN_PROCESS = ("ipc-in-process", "arrowdata-in-process")
VARIANTS = SERVED + IN_PROCESS
BASELINE = "geonear-arrowdata"
#: Generous on both ends: a 1 MiB batch and its header never come near it.
MAX_MESSAGE = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
SERVICE = "geonear.bench.Transport"
METHODS = {
    "geonear-arrowdata": "ArrowData",
    "arrowdata-preencoded": "Preencoded",
    "grpc-raw-bytes": "RawBytes",
}


# -- the payload ---------------------------------------------------------------------------
def build_table(layout: str, rows: int, k: int, seed: int = 0) -> pa.Table:
    """A Knn answer of ``rows`` neighbours (rows // k queries, k each) in ``layout``, with
    the column types and schema metadata the server streams; the same for the same
    arguments, so the server and the client build equal tables."""
    queries = rows // k
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1 << 40, queries * k, dtype=np.int64)
    distances = np.cumsum(rng.random((queries, k)) * 1000.0, axis=1).ravel()
    if layout == "per_query":
        data = {
            "id": pa.FixedSizeListArray.from_arrays(pa.array(ids), k),
            "distance_m": pa.FixedSizeListArray.from_arrays(pa.array(distances), k),
        }
    else:
        data = {
            "query_index": pa.array(np.repeat(np.arange(queries, dtype=np.int64), k)),
            "rank": pa.array(np.tile(np.arange(k, dtype=np.int32), queries)),
            "id": pa.array(ids),
            "distance_m": pa.array(distances),
        }
    metadata = {
        "geonear.dataset": "bench",
        "geonear.version": "1",
        "geonear.earth_radius_m": repr(6371008.8),
        "geonear.layout": layout,
    }
    return pa.table(data).replace_schema_metadata(metadata)


def wire_batches(table: pa.Table, batch_bytes: int = wire.BATCH_BYTES) -> list[pa.RecordBatch]:
    """The table's record batches as ``wire.table_to_messages`` cuts them."""
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    batches = table.to_batches(max_chunksize=max(1, batch_bytes // row_bytes))
    return [b for b in batches if b.num_rows]


# -- ArrowData written and read by hand ----------------------------------------------------
def preencoded_messages(table: pa.Table, batch_bytes: int = wire.BATCH_BYTES) -> Iterator[bytes]:
    """The serialized ArrowData messages of ``wire.table_to_messages``, written without
    protobuf objects as the server writes its answers (``wire.tables_to_encoded``: one
    ``b"".join`` of the tags, lengths and the Arrow buffers a message)."""
    return (message.data for message in wire.tables_to_encoded([table], batch_bytes))


def check_preencoded(table: pa.Table, batch_bytes: int = wire.BATCH_BYTES) -> dict[str, Any]:
    """Assert that the hand-written messages parse (``ArrowData.FromString``) to the
    messages ``wire.table_to_messages`` gives; says whether the bytes are identical too."""
    expected = list(wire.table_to_messages(table, batch_bytes))
    written = list(preencoded_messages(table, batch_bytes))
    assert len(written) == len(expected), f"{len(written)} messages, expected {len(expected)}"
    identical = True
    for i, (data, message) in enumerate(zip(written, expected, strict=True)):
        assert pb.ArrowData.FromString(data) == message, f"message {i} differs"
        identical = identical and data == message.SerializeToString()
    return {"messages": len(expected), "bytes_identical": identical}


# -- servers (each in a process of its own: ``--serve VARIANT``) ----------------------------
def _tables(args: argparse.Namespace) -> dict[str, pa.Table]:
    return {layout: build_table(layout, args.rows, args.k) for layout in LAYOUTS}


def serve_grpc(variant: str, args: argparse.Namespace) -> None:
    tables = _tables(args)
    chunks = {}
    for layout, table in tables.items():
        stream = wire.ipc_stream_bytes(pa.Table.from_batches(wire_batches(table, args.batch_bytes)))
        step = args.batch_bytes
        chunks[layout] = [stream[i : i + step] for i in range(0, len(stream), step)]

    async def arrowdata(request: bytes, context: Any) -> Any:
        for message in wire.table_to_messages(tables[request.decode()], args.batch_bytes):
            yield message

    async def preencoded(request: bytes, context: Any) -> Any:
        for data in preencoded_messages(tables[request.decode()], args.batch_bytes):
            yield data

    async def raw_bytes(request: bytes, context: Any) -> Any:
        for chunk in chunks[request.decode()]:
            yield chunk

    handlers = {
        "geonear-arrowdata": grpc.unary_stream_rpc_method_handler(
            arrowdata, response_serializer=pb.ArrowData.SerializeToString
        ),
        "arrowdata-preencoded": grpc.unary_stream_rpc_method_handler(preencoded),
        "grpc-raw-bytes": grpc.unary_stream_rpc_method_handler(raw_bytes),
    }

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {METHODS[variant]: handlers[variant]}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"ready {port}", flush=True)
        report_cpu_on_request()
        await server.wait_for_termination()

    asyncio.run(main())


def serve_flight(args: argparse.Namespace) -> None:
    assert flight is not None, FLIGHT_MISSING
    tables = {
        layout: pa.Table.from_batches(wire_batches(table, args.batch_bytes), schema=table.schema)
        for layout, table in _tables(args).items()
    }

    class Server(flight.FlightServerBase):
        def do_get(self, context: Any, ticket: Any) -> Any:
            return flight.RecordBatchStream(tables[ticket.ticket.decode()])

    server = Server("grpc://127.0.0.1:0")
    print(f"ready {server.port}", flush=True)
    report_cpu_on_request()
    server.serve()


def report_cpu_on_request() -> None:
    """Answer each line on stdin with this process's CPU seconds so far (all threads,
    those ended included), from a daemon thread: the parent's probe, read outside the
    timed transfers."""

    def answer() -> None:
        for _ in sys.stdin:
            print(f"cpu {time.process_time()!r}", flush=True)

    threading.Thread(target=answer, name="cpu-probe", daemon=True).start()


class ServerProcess:
    """A ``--serve VARIANT`` child of this script; ``cpu_s()`` is its CPU time so far."""

    def __init__(self, variant: str, args: argparse.Namespace) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", variant]
        command += ["--rows", str(args.rows), "-k", str(args.k)]
        command += ["--batch-bytes", str(args.batch_bytes)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.port = 0

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline()

    def ready(self) -> int:
        line = self._line()
        if not line.startswith("ready "):
            raise RuntimeError(f"server did not start (exit {self.process.poll()}): {line!r}")
        self.port = int(line.split()[1])
        return self.port

    def cpu_s(self) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write("cpu\n")
        self.process.stdin.flush()
        line = self._line()
        if not line.startswith("cpu "):
            raise RuntimeError(f"server stopped answering (exit {self.process.poll()}): {line!r}")
        return float(line.split()[1])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


# -- clients: each a function layout -> (received table, wire bytes) -----------------------
Transfer = Callable[[str], tuple[pa.Table, int]]


def grpc_client(variant: str, port: int) -> tuple[Transfer, Callable[[], None]]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    method = f"/{SERVICE}/{METHODS[variant]}"
    if variant == "geonear-arrowdata":
        call = channel.unary_stream(method, response_deserializer=pb.ArrowData.FromString)

        def transfer(layout: str) -> tuple[pa.Table, int]:
            return wire.messages_to_table(call(layout.encode())), 0

    elif variant == "arrowdata-preencoded":
        call = channel.unary_stream(method)

        def transfer(layout: str) -> tuple[pa.Table, int]:
            return wire.messages_to_table(call(layout.encode())), 0

    else:
        call = channel.unary_stream(method)

        def transfer(layout: str) -> tuple[pa.Table, int]:
            data = b"".join(call(layout.encode()))
            return wire.read_ipc_stream(data), len(data)

    return transfer, channel.close


def wire_size(variant: str, port: int, layout: str) -> int | None:
    """Bytes of the messages a gRPC variant sends (protobuf framing included)."""
    if variant not in METHODS:
        return None
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
        call = channel.unary_stream(f"/{SERVICE}/{METHODS[variant]}")
        return sum(len(data) for data in call(layout.encode()))


def flight_client(port: int) -> tuple[Transfer, Callable[[], None]]:
    assert flight is not None
    client = flight.FlightClient(f"grpc://127.0.0.1:{port}")

    def transfer(layout: str) -> tuple[pa.Table, int]:
        return client.do_get(flight.Ticket(layout.encode())).read_all(), 0

    return transfer, client.close


def in_process(variant: str, tables: dict[str, pa.Table], batch_bytes: int) -> Transfer:
    batched = {
        layout: pa.Table.from_batches(wire_batches(table, batch_bytes), schema=table.schema)
        for layout, table in tables.items()
    }

    def ipc(layout: str) -> tuple[pa.Table, int]:
        sink = pa.BufferOutputStream()
        table = batched[layout]
        with pa.ipc.new_stream(sink, table.schema, options=wire.WRITE_OPTIONS) as writer:
            writer.write_table(table)
        buffer = sink.getvalue()
        return pa.ipc.open_stream(buffer).read_all(), buffer.size

    def arrowdata(layout: str) -> tuple[pa.Table, int]:
        sent = [m.SerializeToString() for m in wire.table_to_messages(tables[layout], batch_bytes)]
        table = wire.messages_to_table(pb.ArrowData.FromString(data) for data in sent)
        return table, sum(map(len, sent))

    return ipc if variant == "ipc-in-process" else arrowdata


# -- the run ------------------------------------------------------------------------------
def host_info() -> dict[str, Any]:
    from google.protobuf import __version__ as protobuf_version
    from google.protobuf.internal import api_implementation

    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(affinity(0)) if affinity else os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "pyarrow_flight": not FLIGHT_MISSING,
        "grpcio": grpc.__version__,
        "protobuf": f"{protobuf_version} ({api_implementation.Type()})",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _summary(result: dict[str, Any], payload_bytes: int) -> None:
    times = result.pop("_times")
    if not times:
        return
    fastest = min(times)
    result["times_ms"] = [round(1e3 * t, 3) for t in times]
    result["fastest_ms"] = 1e3 * fastest
    result["median_ms"] = 1e3 * statistics.median(times)
    result["mb_per_s"] = payload_bytes / 1e6 / fastest
    for side in ("server", "client"):
        cpu = result.pop(f"_{side}_cpu")
        result[f"{side}_cpu_ms"] = 1e3 * sum(cpu) / len(cpu) if cpu else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    tables = _tables(args)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for layout in LAYOUTS:
        results[layout] = {
            v: {"status": "ok", "_times": [], "_server_cpu": [], "_client_cpu": []}
            for v in VARIANTS
        }
    compatibility = {layout: check_preencoded(t, args.batch_bytes) for layout, t in tables.items()}

    servers: dict[str, ServerProcess] = {}
    transfers: dict[str, Transfer] = {}
    closers: list[Callable[[], None]] = []
    try:
        for variant in SERVED:
            if variant == "flight-do_get" and FLIGHT_MISSING:
                for layout in LAYOUTS:
                    results[layout][variant].update(status="skipped", reason=FLIGHT_MISSING)
                continue
            servers[variant] = ServerProcess(variant, args)  # all start at once
        for variant, server in servers.items():
            try:
                port = server.ready()
                is_flight = variant == "flight-do_get"
                transfer, close = flight_client(port) if is_flight else grpc_client(variant, port)
            except Exception as exc:
                for layout in LAYOUTS:
                    results[layout][variant].update(status="failed", reason=repr(exc))
                continue
            transfers[variant] = transfer
            closers.append(close)
        for variant in IN_PROCESS:
            transfers[variant] = in_process(variant, tables, args.batch_bytes)

        for layout in LAYOUTS:  # warm each variant and check what it delivers
            for variant, transfer in list(transfers.items()):
                entry = results[layout][variant]
                try:
                    received, size = transfer(layout)
                    entry["equal"] = bool(received.equals(tables[layout], check_metadata=True))
                    proc = servers.get(variant)
                    entry["wire_bytes"] = size or (proc and wire_size(variant, proc.port, layout))
                except Exception as exc:
                    entry.update(status="failed", reason=repr(exc))
                    continue
                if not entry["equal"]:
                    entry.update(status="failed", reason="the table received differs from the sent")

        for _ in range(args.repeat):  # the variants take turns, one transfer each
            for layout in LAYOUTS:
                for variant, transfer in transfers.items():
                    entry = results[layout][variant]
                    if entry["status"] != "ok":
                        continue
                    proc = servers.get(variant)
                    gc.collect()
                    cpu0, server0 = time.process_time(), proc.cpu_s() if proc else 0.0
                    start = time.perf_counter()
                    received, _ = transfer(layout)
                    elapsed = time.perf_counter() - start
                    cpu1, server1 = time.process_time(), proc.cpu_s() if proc else 0.0
                    del received
                    entry["_times"].append(elapsed)
                    entry["_client_cpu"].append(cpu1 - cpu0)
                    if proc is not None:
                        entry["_server_cpu"].append(server1 - server0)
    finally:
        for close in closers:
            close()
        for server in servers.values():
            server.stop()

    layouts: dict[str, Any] = {}
    for layout, by_variant in results.items():
        payload = tables[layout].nbytes
        for entry in by_variant.values():
            _summary(entry, payload)
        base = by_variant[BASELINE].get("fastest_ms")
        for entry in by_variant.values():
            if base and entry.get("fastest_ms"):
                entry["x_vs_geonear_arrowdata"] = base / entry["fastest_ms"]
        layouts[layout] = {
            "payload_bytes": payload,
            "rows": tables[layout].num_rows,
            "bytes_per_neighbour": payload / args.rows,
            "messages": compatibility[layout]["messages"],
            "preencoded_bytes_identical": compatibility[layout]["bytes_identical"],
            "variants": by_variant,
        }
    return {
        "command": command_line(args.argv),
        "config": {
            "rows": args.rows,
            "k": args.k,
            "queries": args.rows // args.k,
            "repeat": args.repeat,
            "batch_bytes": args.batch_bytes,
            "server": "grpc.aio (Flight: its C++ server)",
            "client": "sync grpc channel (Flight: FlightClient)",
        },
        "host": host_info(),
        "layouts": layouts,
    }


def command_line(argv: list[str]) -> str:
    return shlex.join(["python", "benchmarks/transport.py", *argv])


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def rows_of(layout: dict[str, Any]) -> list[list[str]]:
    out = []
    for variant, e in layout["variants"].items():
        if e["status"] != "ok":
            out.append([variant, e["status"], "", "", "", "", "", e.get("reason", "")])
            continue
        out.append(
            [
                variant,
                _cell(e["fastest_ms"]),
                _cell(e["median_ms"]),
                _cell(e["mb_per_s"], 0),
                _cell(e.get("x_vs_geonear_arrowdata"), 2),
                _cell(e["server_cpu_ms"], 0) if variant in SERVED else "",
                _cell(e["client_cpu_ms"], 0),
                "equal" if e.get("equal") else "",
            ]
        )
    return out


HEADER = ["variant", "fastest ms", "median ms", "MB/s", "x", "server CPU ms", "client CPU ms"]


def _title(name: str, layout: dict[str, Any], config: dict[str, Any]) -> str:
    return (
        f"{name} layout: {config['rows']:,} neighbours ({config['queries']:,} queries x k = "
        f"{config['k']}, {layout['rows']:,} rows), {layout['payload_bytes'] / 1e6:.1f} MB "
        f"({layout['bytes_per_neighbour']:.0f} bytes a neighbour), {layout['messages']} "
        f"messages, fastest of {config['repeat']}"
    )


def print_table(report: dict[str, Any]) -> None:
    host = report["host"]
    print(
        f"{host['cpus_usable']} CPUs, python {host['python']}, pyarrow {host['pyarrow']}, "
        f"grpcio {host['grpcio']}, protobuf {host['protobuf']}"
    )
    for name, layout in report["layouts"].items():
        print(f"\n{_title(name, layout, report['config'])}")
        lines = [[*HEADER, "check"], *rows_of(layout)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER) + 1)]
        for line in lines:
            cells = [line[0].ljust(widths[0])]
            cells += [c.rjust(w) for c, w in zip(line[1:-1], widths[1:-1], strict=True)]
            print("  ".join([*cells, line[-1]]).rstrip())


def print_markdown(report: dict[str, Any]) -> None:
    print(f"\n```\n{report['command']}\n```")
    for name, layout in report["layouts"].items():
        print(f"\n{_title(name, layout, report['config'])}\n")
        print("| " + " | ".join(HEADER) + " |")
        print("|---|" + "---:|" * (len(HEADER) - 1))
        for line in rows_of(layout):
            cells = line[:-1] if line[1] not in ("skipped", "failed") else [*line[:2], line[-1]]
            print("| " + " | ".join(cells) + " |")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="neighbours (queries x k)")
    parser.add_argument("-k", "--k", type=int, default=10, help="neighbours a query")
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers a variant")
    parser.add_argument("--batch-bytes", type=int, default=wire.BATCH_BYTES)
    parser.add_argument("--json", type=Path, help="write the report (and host info) here")
    parser.add_argument("--markdown", action="store_true", help="also print markdown tables")
    parser.add_argument("--serve", choices=SERVED, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.k < 1 or args.rows < args.k or args.repeat < 1:
        parser.error("need --k >= 1, --rows >= k and --repeat >= 1")
    args.rows -= args.rows % args.k
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve == "flight-do_get":
        serve_flight(args)
        return {}
    if args.serve:
        serve_grpc(args.serve, args)
        return {}
    report = run(args)
    print_table(report)
    if args.markdown:
        print_markdown(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
