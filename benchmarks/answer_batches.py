"""What a big answer's transfer and an upload's memory cost, through a real server.

``python benchmarks/answer_batches.py [--points 1000000] [--repeat 5] [--upload-points
10000000] [--mmap-threshold BYTES] [--json out.json]``

Two measures that the server's allocation policy (``geonear.allocator``) and its answer
batch size (``wire.ANSWER_BATCH_BYTES``) trade against each other, each with a ``geonear
serve --engine cpu --memory-only`` process of its own:

- **join**: ``knn_join(left, right, k=5)`` of ``--points`` left points with a right
  dataset of 5 points, through the Python client, in the per-query and the rows layout.
  Every left point's neighbours are all 5 right points, so the search is cheap and the
  call is mostly the answer's assembly, encoding, transfer and decoding (a 1M-point
  per-query answer: about 1M x 5 neighbours in 1M rows). Timed from the call to the
  decoded Arrow table; the fastest and the median of ``--repeat`` calls after one
  untimed call; every answer is checked (rows, and each left point's 5 distinct ids).
- **upload**: the server's resident memory (VmRSS, Linux) grown by uploading
  ``--upload-points`` uniform points (int64 ids), in bytes a point, one second after
  the upload is acknowledged: what an upload's transient buffers leave behind.

``--mmap-threshold`` starts the servers with glibc's ``MALLOC_MMAP_THRESHOLD_`` (and a
64 MiB ``MALLOC_TRIM_THRESHOLD_``), which replaces the server policy's own threshold:
the way to compare thresholds on one build. Comparing batch sizes means comparing builds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import geonear
from geonear.bench.served import served_process
from geonear.loaders.synthetic import uniform_points
from geonear.wire import ANSWER_BATCH_BYTES

K = 5


def point_table(n: int, seed: int) -> pa.Table:
    """``n`` points uniform on the sphere, ids 0 to n - 1."""
    lat, lon = uniform_points(n, seed)
    return pa.table({"id": np.arange(n, dtype=np.int64), "lat": lat, "lon": lon})


def server_env(mmap_threshold: int | None) -> dict[str, str]:
    if mmap_threshold is None:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}


def check_join(table: pa.Table, layout: str, n: int) -> None:
    """Each left point once (per_query) or K times (rows), with K distinct right ids."""
    if layout == "per_query":
        assert table.num_rows == n, f"{table.num_rows} rows for {n} left points"
        ids = table.column("right_id").combine_chunks().flatten().to_numpy().reshape(n, K)
    else:
        assert table.num_rows == n * K, f"{table.num_rows} rows for {n} x {K}"
        ids = table.column("right_id").to_numpy().reshape(n, K)
    assert (np.sort(ids, axis=1) == np.arange(K)).all(), "a left point without all 5 ids"


def time_join(points: int, repeat: int, env: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    with served_process("cpu", settings=env) as server:
        client = geonear.connect(server.target)
        client.upload("left", point_table(points, 0))
        client.upload("right", point_table(K, 1))
        for layout in ("per_query", "rows"):
            times = []
            for i in range(repeat + 1):
                start = time.perf_counter()
                table = client.knn_join("left", "right", k=K, layout=layout, as_arrow=True)
                if i:
                    times.append(time.perf_counter() - start)
                check_join(table, layout, points)
            rows.append(
                {
                    "layout": layout,
                    "fastest_ms": min(times) * 1e3,
                    "median_ms": statistics.median(times) * 1e3,
                }
            )
        client.close()
    return rows


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def upload_growth(points: int, env: dict[str, str]) -> dict[str, Any]:
    table = point_table(points, 2)
    with served_process("cpu", settings=env) as server:
        client = geonear.connect(server.target)
        before = resident_bytes(server.pid)
        start = time.perf_counter()
        client.upload("points", table)
        seconds = time.perf_counter() - start
        time.sleep(1.0)
        grown = resident_bytes(server.pid) - before
        client.close()
    return {"points": points, "upload_s": seconds, "bytes_per_point": grown / points}


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = server_env(args.mmap_threshold)
    return {
        "points": args.points,
        "repeat": args.repeat,
        "mmap_threshold": args.mmap_threshold,
        "answer_batch_bytes": ANSWER_BATCH_BYTES,
        "join": time_join(args.points, args.repeat, env),
        "upload": upload_growth(args.upload_points, env) if args.upload_points else None,
    }


def print_report(report: dict[str, Any]) -> None:
    threshold = report["mmap_threshold"]
    print(
        f"answer batches {report['answer_batch_bytes'] >> 10} KiB, mmap threshold "
        f"{'the server policy' if threshold is None else f'{threshold} bytes'}"
    )
    for row in report["join"]:
        print(
            f"knn_join {report['points']:,} x {K}, {row['layout']}: fastest "
            f"{row['fastest_ms']:.1f} ms, median {row['median_ms']:.1f} ms"
        )
    upload = report["upload"]
    if upload:
        print(
            f"upload {upload['points']:,} points: {upload['upload_s']:.1f} s, server RSS "
            f"+{upload['bytes_per_point']:.1f} bytes a point"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1_000_000, help="left points")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls a layout")
    parser.add_argument("--upload-points", type=int, default=10_000_000, help="0: skip")
    parser.add_argument("--mmap-threshold", type=int, help="glibc's, for the servers")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
