"""A filtered KNN two ways: a temporary index of the selected points, or the dataset's
own index searched for more neighbours and masked.

``python benchmarks/filter_rule.py --n 1000000 --queries 100000 -k 10 --engine cpu``

The service answers a filtered query with a temporary index of the selected points
(``geonear/service/queries/filters.py``); the other way needs no build but searches the
full index for ``k' = ceil(k / s x 1.25) + 8`` neighbours (s the selected fraction),
keeps the selected ones in their order, and searches again with four times k' for the
queries left with fewer than k. Both are exact; this script checks that they return the
same rows and times each at several selectivities, in one process, on one engine:

- temporary: ``engine.build_index(lat[rows], lon[rows])``, then its KNN (both timed);
- masked: the full index's KNN, widened until every query has k selected neighbours.

It decides the rule: where the build costs less than the wider search, the temporary
index wins at that selectivity. Prints a table; ``--json PATH`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from geonear.loaders import uniform_points
from geonear.service.engines import PointIndex, create_engine

FRACTIONS = (0.9, 0.5, 0.25, 0.1)


def masked_knn(
    index: PointIndex, mask: np.ndarray, lat: np.ndarray, lon: np.ndarray, k: int
) -> tuple[np.ndarray, int]:
    """Dataset rows of the k nearest selected points of each query (the masked way), and
    the engine calls it took."""
    total = index.n_points
    selected = int(mask.sum())
    want = min(k, selected)
    rows = np.full((lat.shape[0], want), -1, dtype=np.int64)
    if want == 0:
        return rows, 0
    ask = min(total, int(np.ceil(want / (selected / total) * 1.25)) + 8)
    todo = np.arange(lat.shape[0])
    calls = 0
    while todo.size:
        found = index.knn(lat[todo], lon[todo], ask)
        calls += 1
        keep = (found.indices >= 0) & mask[np.maximum(found.indices, 0)]
        done = (keep.sum(axis=1) >= want) | (ask >= total)
        first = np.argsort(~keep[done], axis=1, kind="stable")[:, :want]
        rows[todo[done]] = np.take_along_axis(found.indices[done], first, axis=1)
        todo = todo[~done]
        ask = min(total, ask * 4)
    return rows, calls


def run(n: int, n_queries: int, k: int, engine_name: str, fractions: Sequence[float]) -> dict:
    lat, lon = uniform_points(n, seed=0)
    q_lat, q_lon = uniform_points(n_queries, seed=1)
    engine = create_engine(engine_name)
    engine.warm_up()
    full = engine.build_index(lat, lon)
    start = time.perf_counter()
    full.knn(q_lat, q_lon, k)
    unfiltered_s = time.perf_counter() - start
    draw = np.random.default_rng(2).random(n)
    results: list[dict[str, Any]] = []
    for fraction in fractions:
        mask = draw < fraction
        selected = np.flatnonzero(mask)
        start = time.perf_counter()
        temporary = engine.build_index(lat[selected], lon[selected])
        build_s = time.perf_counter() - start
        found = temporary.knn(q_lat, q_lon, k)
        search_s = time.perf_counter() - start - build_s
        start = time.perf_counter()
        masked, calls = masked_knn(full, mask, q_lat, q_lon, k)
        masked_s = time.perf_counter() - start
        expected = np.where(found.indices >= 0, selected[np.maximum(found.indices, 0)], -1)
        results.append(
            {
                "fraction": fraction,
                "selected": int(selected.shape[0]),
                "build_s": build_s,
                "search_s": search_s,
                "temporary_s": build_s + search_s,
                "masked_s": masked_s,
                "masked_calls": calls,
                "same_rows": bool(np.array_equal(masked, expected)),
            }
        )
    return {
        "command": f"python benchmarks/filter_rule.py --n {n} --queries {n_queries} -k {k} "
        f"--engine {engine_name}",
        "engine": engine_name,
        "device": engine.describe_device(),
        "unfiltered_s": unfiltered_s,
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=100_000)
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--engine", default="cpu")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    report = run(args.n, args.queries, args.k, args.engine, FRACTIONS)
    print(report["command"])
    print(f"{report['device']}; unfiltered KNN {report['unfiltered_s'] * 1e3:.1f} ms\n")
    print("| selected | build ms | search ms | temporary ms | masked ms | calls | same rows |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in report["results"]:
        print(
            f"| {r['fraction']:.0%} | {r['build_s'] * 1e3:.1f} | {r['search_s'] * 1e3:.1f} "
            f"| {r['temporary_s'] * 1e3:.1f} | {r['masked_s'] * 1e3:.1f} "
            f"| {r['masked_calls']} | {'yes' if r['same_rows'] else 'NO'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
