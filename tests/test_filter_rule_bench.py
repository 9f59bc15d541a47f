"""benchmarks/filter_rule.py: the masked search it times against the temporary index
finds the same rows at every selectivity. No test asserts a duration."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "filter_rule.py"


@pytest.fixture(scope="module")
def filter_rule() -> ModuleType:
    spec = importlib.util.spec_from_file_location("filter_rule_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
