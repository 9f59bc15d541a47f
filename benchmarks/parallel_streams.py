"""How fast one answer's bytes cross loopback gRPC over one stream, or split over several.

``python benchmarks/parallel_streams.py --mib 88 --repeat 3 [--json out.json]``

The transport's ceiling for a big answer: ``--mib`` MiB (88 MiB is a little more than the
88 MB of a 1M x 1M KNN join's answer at k=5 in the per-query layout) go from server
processes to this one as
224 KiB raw-bytes messages (the size of geonear's answer batches when it was recorded;
512 KiB since). Each server is a
grpc.aio process of its own (one event loop, as ``geonear serve``) holding the payload;
a request ``"i/P"`` streams part i of P. The client takes P parts at once, each stream
on a channel of its own from a thread of its own, with every stream served by one
process (``servers`` 1) or each by a process of its own (``servers`` = P, round robin).
A transfer is timed from the first request to the last byte received; ``--repeat``
transfers a row after one untimed warm-up; the table gives the fastest and median ms
and GB/s at the fastest, and every transfer's byte count is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

MESSAGE_BYTES = 224 << 10
STREAMS = (1, 2, 4, 8)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
METHOD = "/geonear.bench.Streams/Part"


def payload_bytes(mib: float) -> int:
    return int(mib * (1 << 20))


def part_bounds(size: int, part: int, parts: int) -> tuple[int, int]:
    """Bytes [lo, hi) of part ``part`` of ``parts`` of a payload of ``size`` bytes."""
    return size * part // parts, size * (part + 1) // parts


def serve(size: int) -> None:
    """One server process: answers ``"i/P"`` with part i of P of the payload."""
    payload = memoryview(bytes(range(256)) * (size // 256 + 1))[:size]

    async def part(request: bytes, context: Any) -> Any:
        i, parts = map(int, request.decode().split("/"))
        lo, hi = part_bounds(size, i, parts)
        for at in range(lo, hi, MESSAGE_BYTES):
            yield bytes(payload[at : min(at + MESSAGE_BYTES, hi)])

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        service, method = METHOD.strip("/").split("/")
        handler = grpc.unary_stream_rpc_method_handler(part)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"ready {port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def start_server(size: int) -> tuple[subprocess.Popen[str], int]:
    command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(size)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("ready "):
        process.kill()
        raise RuntimeError(f"server did not start (exit {process.poll()}): {line!r}")
    return process, int(line.split()[1])


def transfer(calls: list[Any]) -> tuple[float, int]:
    """All parts at once, one thread a stream: (seconds, bytes received)."""
    parts = len(calls)
    received = [0] * parts

    def take(i: int) -> None:
        received[i] = sum(len(data) for data in calls[i](f"{i}/{parts}".encode()))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(parts)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, sum(received)


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = payload_bytes(args.mib)
    servers = [start_server(size) for _ in range(max(STREAMS))]
    rows = []
    try:
        for spread in (False, True):
            for parts in STREAMS:
                ports = [servers[i if spread else 0][1] for i in range(parts)]
                channels = [
                    grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
                    for port in ports
                ]
                calls = [channel.unary_stream(METHOD) for channel in channels]
                try:
                    transfer(calls)  # warm-up: connections made, pages touched
                    times = []
                    for _ in range(args.repeat):
                        seconds, received = transfer(calls)
                        if received != size:
                            raise RuntimeError(f"received {received} bytes of {size}")
                        times.append(seconds)
                finally:
                    for channel in channels:
                        channel.close()
                fastest = min(times)
                rows.append(
                    {
                        "servers": parts if spread else 1,
                        "streams": parts,
                        "fastest_ms": fastest * 1e3,
                        "median_ms": statistics.median(times) * 1e3,
                        "gb_per_s": size / fastest / 1e9,
                    }
                )
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()
    return {"mib": args.mib, "repeat": args.repeat, "grpcio": grpc.__version__, "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['mib']:g} MiB, {report['repeat']} transfers a row (grpcio {report['grpcio']})")
    print("| servers | streams | fastest ms | median ms | GB/s |")
    print("|---:|---:|---:|---:|---:|")
    for row in report["rows"]:
        print(
            f"| {row['servers']} | {row['streams']} | {row['fastest_ms']:.1f} "
            f"| {row['median_ms']:.1f} | {row['gb_per_s']:.2f} |"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=88.0, help="answer size, MiB")
    parser.add_argument("--repeat", type=int, default=3, help="timed transfers a row")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # a server process
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return {}
    report = run(args)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
