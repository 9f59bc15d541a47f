"""benchmarks/parallel_streams.py: every layout of streams delivers the whole payload.
No test asserts a duration."""

from __future__ import annotations

import json
from pathlib import Path

import benchmark_scripts


def test_every_row_receives_the_whole_payload(tmp_path: Path) -> None:
    streams = benchmark_scripts.load("parallel_streams")
    assert [streams.part_bounds(10, i, 3) for i in range(3)] == [(0, 3), (3, 6), (6, 10)]
    out = tmp_path / "streams.json"
    report = streams.main(["--mib", "0.5", "--repeat", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    rows = [(row["servers"], row["streams"]) for row in report["rows"]]
    assert rows == [(1, 1), (1, 2), (1, 4), (1, 8), (1, 1), (2, 2), (4, 4), (8, 8)]
    for row in report["rows"]:
        assert row["fastest_ms"] > 0 and row["median_ms"] >= row["fastest_ms"]
        assert row["gb_per_s"] > 0
