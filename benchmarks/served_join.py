"""A per-query knn-join through a real server, with variants of the server side by side.

``python benchmarks/served_join.py [--engine gpu] [--points 1000000] [--calls 7]
[--variants base,small,base,small] [--json out.json]``

Each variant runs in a ``geonear serve --memory-only`` process of its own, started
through this script, which applies the variant before the server starts; the Python client
uploads ``--points`` uniform left and right points and calls ``knn_join(left, right,
k=5, layout="per_query", as_arrow=True)`` ``--calls`` times, the first untimed. Listing a
variant more than once alternates them, so that a host's drift shows. Variants:

- ``base``: the server as built.
- ``switch``: the server's thread switch interval at 0.5 ms (``sys.setswitchinterval``)
  instead of 5 ms, so that the event loop's thread takes the GIL back sooner from the
  thread that makes the answer.
- ``small``: the build before answer messages grew: messages of 512 KiB
  (``ANSWER_BATCH_BYTES``, 2 MiB as built) under a 768 KiB glibc mmap threshold in the
  server (8 MiB as built), four times as many messages for the same bytes.

For each run: the fastest and the median call (ms) and the server's and the client's
CPU time a call (ms, Linux). Every answer is checked: one row a left point, k ids and
distances each, nearest first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import geonear
from geonear.bench.served import served_process
from geonear.loaders.synthetic import uniform_points

K = 5
VARIANTS = ("base", "small", "switch")


def apply_variant(variant: str) -> None:
    """Make this process's server the ``variant`` (before the server is imported)."""
    from geonear.service import servicer

    if variant == "switch":
        sys.setswitchinterval(0.0005)
    elif variant == "small":
        servicer.ANSWER_BATCH_BYTES = 512 << 10
    elif variant != "base":
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def server_env(variant: str) -> dict[str, str]:
    """The environment ``variant`` adds to its server's."""
    if variant != "small":
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(768 << 10), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}


def check_answer(table: pa.Table, n: int) -> None:
    """One row a left point, in order, with K ids and K distances, nearest first."""
    assert table.num_rows == n, f"{table.num_rows} rows for {n} left points"
    assert np.array_equal(table.column("left_id").to_numpy(), np.arange(n)), "left order"
    ids = pc.list_flatten(table.column("right_id")).to_numpy()
    distances = pc.list_flatten(table.column("distance_m")).to_numpy().reshape(n, K)
    assert ids.shape == (n * K,) and (ids >= 0).all(), "k ids a left point"
    assert (np.diff(distances, axis=1) >= 0).all(), "nearest first"


def time_variant(variant: str, engine: str, points: int, calls: int) -> dict[str, Any]:
    tables = {}
    for name, seed in (("left", 0), ("right", 1)):
        lat, lon = uniform_points(points, seed)
        tables[name] = pa.table({"id": np.arange(points), "lat": lat, "lon": lon})
    cli = (sys.executable, __file__, "--serve", variant)
    with served_process(engine, settings=server_env(variant), cli=cli) as server:
        client = geonear.connect(server.target)
        for name, table in tables.items():
            client.upload(name, table)
        walls, server_cpu, client_cpu = [], [], []
        for i in range(calls):
            server_before, client_before = server.cpu_s() or 0.0, time.process_time()
            start = time.perf_counter()
            table = client.knn_join("left", "right", K, layout="per_query", as_arrow=True)
            if i:
                walls.append(time.perf_counter() - start)
                server_cpu.append((server.cpu_s() or 0.0) - server_before)
                client_cpu.append(time.process_time() - client_before)
            check_answer(table, points)
        client.close()
    return {
        "variant": variant,
        "fastest_ms": 1e3 * min(walls),
        "median_ms": 1e3 * statistics.median(walls),
        "server_cpu_ms": 1e3 * statistics.median(server_cpu),
        "client_cpu_ms": 1e3 * statistics.median(client_cpu),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="gpu", help="the servers' engine")
    parser.add_argument("--points", type=int, default=1_000_000, help="left and right points")
    parser.add_argument("--calls", type=int, default=7, help="calls a run, the first untimed")
    parser.add_argument("--variants", default="base,small,base,small")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    runs = []
    for variant in variants:
        run = time_variant(variant, args.engine, args.points, max(2, args.calls))
        runs.append(run)
        print(
            f"{variant:7s} fastest {run['fastest_ms']:.1f} ms, median {run['median_ms']:.1f} "
            f"ms; CPU a call: server {run['server_cpu_ms']:.0f} ms, client "
            f"{run['client_cpu_ms']:.0f} ms",
            flush=True,
        )
    report = {"engine": args.engine, "points": args.points, "k": K, "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def serve(variant: str, argv: list[str]) -> int:
    """This script as a variant's server: the variant applied, then ``geonear serve``."""
    apply_variant(variant)
    from geonear.clients.cli import main as geonear_main

    return geonear_main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        raise SystemExit(serve(sys.argv[2], sys.argv[3:]))
    main()
