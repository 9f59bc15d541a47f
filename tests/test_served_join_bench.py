"""benchmarks/served_join.py: every variant's server starts, answers and is checked.
No test asserts a duration."""

from __future__ import annotations

import json
from pathlib import Path

import benchmark_scripts
import numpy as np
import pyarrow as pa
import pytest


def test_each_variant_is_served_and_measured(tmp_path: Path) -> None:
    bench = benchmark_scripts.load("served_join")
    out = tmp_path / "join.json"
    args = ["--engine", "cpu", "--points", "2000", "--calls", "2"]
    report = bench.main([*args, "--variants", "base,small,switch", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert [run["variant"] for run in report["runs"]] == ["base", "small", "switch"]
    for run in report["runs"]:
        assert 0 < run["fastest_ms"] <= run["median_ms"]
        assert run["server_cpu_ms"] >= 0 and run["client_cpu_ms"] > 0


def test_an_unknown_variant_is_refused() -> None:
    bench = benchmark_scripts.load("served_join")
    with pytest.raises(SystemExit):
        bench.main(["--variants", "base,fast"])
    with pytest.raises(ValueError, match="unknown variant"):
        bench.apply_variant("fast")


def test_an_answer_out_of_order_is_caught() -> None:
    bench = benchmark_scripts.load("served_join")
    ids = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(10)), 5)
    near = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(10.0)), 5)
    good = pa.table({"left_id": [0, 1], "right_id": ids, "distance_m": near})
    bench.check_answer(good, 2)
    far_first = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(10.0)[::-1].copy()), 5)
    with pytest.raises(AssertionError, match="nearest first"):
        bench.check_answer(good.set_column(2, "distance_m", far_first), 2)
