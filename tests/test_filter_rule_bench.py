"""benchmarks/filter_rule.py: the masked search it times against the temporary index
finds the same rows at every selectivity. No test asserts a duration."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import benchmark_scripts
import pytest


@pytest.fixture(scope="module")
def filter_rule() -> ModuleType:
    return benchmark_scripts.load("filter_rule")


@pytest.mark.parametrize("engine", ["cpu", "numpy-brute"])
def test_both_ways_find_the_same_rows(filter_rule: ModuleType, engine: str, tmp_path: Path) -> None:
    out = tmp_path / "rule.json"
    argv = ["--n", "3000", "--queries", "400", "-k", "7", "--engine", engine, "--json", str(out)]
    report = filter_rule.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [r["fraction"] for r in report["results"]] == list(filter_rule.FRACTIONS)
    for r in report["results"]:
        assert r["same_rows"], r
        assert r["masked_calls"] >= 1 and 0 < r["selected"] < 3000
