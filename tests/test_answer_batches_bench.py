"""benchmarks/answer_batches.py: the join's answers are checked and the upload measured.
No test asserts a duration."""

from __future__ import annotations

import json
from pathlib import Path

import benchmark_scripts
import pyarrow as pa
import pytest


def test_the_join_and_the_upload_are_measured(tmp_path: Path) -> None:
    bench = benchmark_scripts.load("answer_batches")
    out = tmp_path / "batches.json"
    args = ["--points", "3000", "--repeat", "1", "--upload-points", "20000"]
    report = bench.main([*args, "--mmap-threshold", str(768 << 10), "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [row["layout"] for row in report["join"]] == ["per_query", "rows"]
    for row in report["join"]:
        assert 0 < row["fastest_ms"] <= row["median_ms"]
    assert report["upload"]["points"] == 20000 and report["upload"]["bytes_per_point"] > 0


def test_a_join_answer_missing_a_neighbour_is_caught() -> None:
    bench = benchmark_scripts.load("answer_batches")
    good = pa.table({"right_id": pa.array([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])})
    bench.check_join(good, "per_query", 2)
    bad = pa.table({"right_id": pa.array([[0, 1, 2, 3, 3]])})
    with pytest.raises(AssertionError, match="all 5 ids"):
        bench.check_join(bad, "per_query", 1)
