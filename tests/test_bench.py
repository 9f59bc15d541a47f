"""geonear bench: real engines at small sizes, its JSON and markdown, and wrong engines caught.

Every wrong engine here is a real engine subclass that corrupts one answer (shifted rows,
a biased matrix, a worse k-means seed); the bench must flag it through its exactness
columns. No test asserts a duration.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geonear.clients import bench
from geonear.clients.bench import BenchConfig, run_benchmark
from geonear.service.engines import ENGINES, EngineSpec
from geonear.service.engines.base import Neighbours, RadiusNeighbours
from geonear.service.engines.cpu import CPUEngine, KDTreeIndex

CPU_ENGINES = ("cpu", "sklearn", "numpy-brute")
SMALL = {"n": 5000, "queries": 200, "repeat": 1}


class ShiftedIndex(KDTreeIndex):
    """Right distances, wrong rows: every neighbour's row number moved by one."""

    def knn(self, lat: Any, lon: Any, k: int, max_distance_m: float | None = None) -> Neighbours:
        right = super().knn(lat, lon, k, max_distance_m)
        return Neighbours(right.distances_m, (right.indices + 1) % self.n_points)

    def radius(self, lat: Any, lon: Any, radius_m: float) -> RadiusNeighbours:
        right = super().radius(lat, lon, radius_m)
        return RadiusNeighbours(
            right.offsets, (right.indices + 1) % self.n_points, right.distances_m
        )

    def kmeans(self, k: int, **kwargs: Any) -> Any:
        return super().kmeans(k, **{**kwargs, "seed": kwargs.get("seed", 0) + 1})


class RenamedCPUEngine(CPUEngine):
    """The cpu engine under a name of its own: its spec (device kind, capabilities) is cpu's."""

    @property
    def spec(self) -> EngineSpec:
        return ENGINES["cpu"]


class WrongEngine(RenamedCPUEngine):
    """The cpu engine with shifted neighbours, k-means from another seed, matrices 10 m long."""

    name = "wrong"

    def build_index(self, lat: Any, lon: Any) -> ShiftedIndex:
        return ShiftedIndex(lat, lon, self.earth_radius_m, self.workers)

    def distance_matrix(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return super().distance_matrix(*args, **kwargs) + 10.0


class UnfinishedEngine(RenamedCPUEngine):
    """An engine that cannot build an index yet."""

    name = "unfinished"

    def build_index(self, lat: Any, lon: Any) -> KDTreeIndex:
        raise NotImplementedError("this engine has no index yet")


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["engine"]: row for row in doc["results"]}


def _parse(command: str, *more: str) -> argparse.Namespace:
    """Arguments parsed by bench's own parser from a command line (plus ``more`` words)."""
    parser = argparse.ArgumentParser(prog="geonear bench")
    bench.add_arguments(parser)
    return parser.parse_args([*shlex.split(command), *more])


@pytest.mark.parametrize(
    "op, options",
    [
        ("knn", {"k": 8}),
        ("radius", {"data": "clustered", "radius_m": 100_000.0}),
        ("matrix", {}),
        ("matrix", {"dtype": "float32"}),
        ("kmeans", {"k": 16, "max_iter": 10}),
        ("build", {}),
    ],
)
def test_cpu_engines_are_exact_and_timed(op: str, options: dict[str, Any]) -> None:
    doc = run_benchmark(BenchConfig(op=op, engines=CPU_ENGINES, **SMALL, **options))
    rows = _rows(doc)
    expected = [*CPU_ENGINES, *(["sklearn-kmeans"] if op == "kmeans" else [])]
    assert list(rows) == expected
    for name in expected:
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert row["build_s"] > 0 and row["cold_s"] > 0 and row["throughput"] > 0
        assert row["warm_min_s"] <= row["warm_median_s"]
        assert row["repeats"] == 1
    assert rows["cpu"]["speedup_vs_cpu"] == pytest.approx(1.0)
    baseline = "sklearn-kmeans" if op == "kmeans" else "sklearn"
    assert rows[baseline]["speedup_vs_sklearn"] == pytest.approx(1.0)
    for name in ("cpu", "sklearn"):
        exactness = rows[name]["exactness"]
        if op in ("knn", "radius"):
            assert exactness["queries_checked"] == SMALL["queries"]
            assert exactness["recall"] == 1.0 and exactness["order_agreement"] == 1.0
            assert exactness["wrong_rows"] == 0
            assert exactness["max_distance_error_m"] <= 1e-3
        if op == "matrix":
            assert exactness["max_abs_error_m"] <= exactness["tolerance_m"]
        if op == "kmeans":
            assert exactness["inertia_rel_diff"] <= 1e-9
            assert exactness["label_agreement"] == 1.0
        assert rows[name]["exact"] is (None if op == "build" else True)
    if op == "radius":  # the check is only worth something if queries have neighbours
        assert rows["cpu"]["exactness"]["mean_neighbours"] > 2
    if op == "build":
        assert rows["cpu"]["exactness"]["host_mib"] > 0
    if op == "kmeans":
        assert rows["sklearn-kmeans"]["exact"] is None  # Euclidean: compared, not judged
        assert rows["sklearn-kmeans"]["exactness"]["inertia_rel_diff"] < 0.05


@pytest.mark.parametrize(
    "op, options, column",
    [
        ("knn", {"k": 5}, "recall"),
        ("radius", {"data": "clustered", "radius_m": 100_000.0}, "recall"),
        ("matrix", {}, "max_abs_error_m"),
        ("kmeans", {"k": 16, "max_iter": 10}, "inertia_rel_diff"),
    ],
)
def test_a_wrong_engine_is_flagged(op: str, options: dict[str, Any], column: str) -> None:
    doc = run_benchmark(
        BenchConfig(op=op, engines=("cpu",), **SMALL, **options),
        extra_engines={"wrong": WrongEngine()},
    )
    rows = _rows(doc)
    assert rows["cpu"]["exact"] is True
    wrong = rows["wrong"]
    assert wrong["status"] == "ok"
    assert wrong["exact"] is False
    value = wrong["exactness"][column]
    if column == "recall":
        assert value < 0.5
        assert wrong["exactness"]["order_agreement"] < 0.5
        assert wrong["exactness"]["wrong_rows"] > 0
    elif column == "max_abs_error_m":
        assert value == pytest.approx(10.0)
    else:
        assert value > 1e-6


def test_brute_force_engines_run_on_a_subset_and_are_scaled() -> None:
    doc = run_benchmark(
        BenchConfig(op="knn", engines=("cpu", "numpy-brute"), brute_pairs=250_000, **SMALL)
    )
    brute = _rows(doc)["numpy-brute"]
    assert brute["queries_run"] == 50  # 250,000 pairs / 5,000 points
    assert brute["scale"] == pytest.approx(4.0)
    assert brute["exactness"]["queries_checked"] == 50
    assert brute["exact"] is True
    assert any("scaled" in note for note in brute["notes"])
    assert _rows(doc)["cpu"]["queries_run"] == SMALL["queries"]
    assert "--brute-pairs 250000" in doc["command"]


def test_unavailable_engines_are_skipped_with_their_reason() -> None:
    doc = run_benchmark(
        BenchConfig(op="knn", engines=("cpu", "sklearn-kmeans"), **SMALL),
        extra_engines={"unfinished": UnfinishedEngine()},
    )
    rows = _rows(doc)
    assert rows["cpu"]["status"] == "ok"
    assert rows["unfinished"]["status"] == "skipped"
    assert "no index yet" in rows["unfinished"]["reason"]
    assert rows["sklearn-kmeans"]["status"] == "skipped"
    assert "--op kmeans" in rows["sklearn-kmeans"]["reason"]


def test_unknown_engine_names_fail_with_the_valid_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown engine\(s\) cpuu.*numpy-brute"):
        run_benchmark(BenchConfig(op="knn", engines=("cpuu",), **SMALL))


def test_bad_settings_fail_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="op must be one of knn, radius, matrix, kmeans, build"):
        BenchConfig(op="nearest")
    with pytest.raises(ValueError, match="queries must be at least 1"):
        BenchConfig(queries=0)


def test_run_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "bench.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\n")
    argv = "--op knn --n 3000 --queries 100 -k 4 --data airports --engines cpu,sklearn"
    args = _parse(argv, "--repeat", "2", "--json", str(out), "--markdown", str(md))
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "geonear-bench/1"
    assert set(doc["versions"]) >= {"python", "numpy", "scipy", "scikit-learn", "cupy"}
    assert doc["machine"]["cpus"] >= 1
    assert doc["data"]["n_points"] == 3000 and doc["data"]["n_queries"] == 100
    assert doc["command"].startswith("geonear bench --op knn --data airports --n 3000")
    assert [r["engine"] for r in doc["results"]] == ["cpu", "sklearn"]
    assert all(r["exact"] is True and r["repeats"] == 2 for r in doc["results"])
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\n### knn · airports")  # appended, not overwritten
    assert doc["command"] in text
    assert "| cpu |" in text and "| sklearn |" in text
    assert "knn · airports" in capsys.readouterr().out  # the table on the terminal


def test_markdown_without_a_path_goes_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("--op build --n 2000 --engines cpu --repeat 1 --markdown")
    assert bench.run(args) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("### build · uniform")
    assert "geonear bench --op build --data uniform --n 2000" in captured.out
    assert "┃" in captured.err  # the table moved to stderr, out of the way of a redirect


def test_the_command_line_of_a_config_parses_back_to_it() -> None:
    config = BenchConfig(
        op="radius",
        n=1234,
        queries=56,
        radius_m=7500.0,
        data="clustered",
        engines=("cpu", "sklearn"),
        seed=3,
        repeat=2,
        ref_queries=9,
    )
    command = config.command()
    assert command.startswith("geonear bench ")
    assert bench.config_from_args(_parse(command.removeprefix("geonear bench "))) == config


def test_geonear_bench_runs_from_the_command_line(tmp_path: Path) -> None:
    from geonear.clients.cli import main

    out = tmp_path / "cities.json"
    argv = "bench --op radius --data cities --n 4000 --queries 50 --radius-m 50000 --engines cpu"
    argv = [*shlex.split(argv), "--repeat", "1", "--json", str(out)]
    assert main(argv) == 0
    [row] = json.loads(out.read_text())["results"]
    assert row["engine"] == "cpu" and row["exact"] is True
    # The installed entry point runs the same command in a fresh process.
    result = subprocess.run(
        [sys.executable, "-m", "geonear", *argv[:-1], str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "radius · cities" in result.stdout


def test_importing_bench_does_not_import_cupy() -> None:
    code = "import sys, geonear.clients.bench; print('cupy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_a_100_column_terminal_gets_a_table_that_fits_with_the_details_below() -> None:
    import io

    from rich.console import Console

    from geonear.clients import bench_report

    doc = run_benchmark(
        BenchConfig(op="knn", n=500, queries=50, engines=("cpu", "sklearn", "numpy-brute"))
    )
    out = io.StringIO()
    bench_report.print_table(doc, Console(file=out, width=100, color_system=None))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 100
    for engine in ("cpu", "sklearn", "numpy-brute"):
        assert any(line.strip().startswith(f"{engine}: recall 1.0000") for line in lines)
    wide = io.StringIO()
    bench_report.print_table(doc, Console(file=wide, width=200, color_system=None))
    assert "warm med s" in wide.getvalue() and "warm med s" not in out.getvalue()
