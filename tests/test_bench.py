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

from geonear.bench import command as bench
from geonear.bench import report as bench_report
from geonear.bench.command import BenchConfig, run_benchmark
from geonear.service.engines import ENGINES, EngineSpec, gpu_available
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
    code = "import sys, geonear.bench; print('cupy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_a_100_column_terminal_gets_a_table_that_fits_with_the_details_below() -> None:
    import io

    from rich.console import Console

    from geonear.bench import report as bench_report

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


# -- the analytics ops: each engine through a server of its own, peers beside ----------

ANALYTICS_ROWS = {
    "knn-join": ["cpu", "cpu per_query", "sklearn-balltree", "geopandas-sjoin"],
    "count-within": ["cpu", "sklearn-balltree"],
    "filtered-knn": ["cpu", "cpu where 10%", "cpu where 1%"],
    "dbscan": ["cpu", "sklearn-dbscan", "cuml-dbscan"],
    "within": ["cpu"],
}
ANALYTICS_SIZES = {"knn-join": 500, "count-within": 500, "filtered-knn": 500, "dbscan": 500}


def _analytics(op: str, **values: Any) -> dict[str, Any]:
    values = {"n": ANALYTICS_SIZES.get(op, 3000), "repeat": 1, "engines": ("cpu",), **values}
    if op == "filtered-knn":
        values.setdefault("queries", 300)
    return run_benchmark(BenchConfig.for_op(op, **values))


@pytest.mark.parametrize("op", list(ANALYTICS_ROWS))
def test_analytics_ops_serve_the_cpu_engine_exactly_beside_their_peers(op: str) -> None:
    doc = _analytics(op)
    rows = _rows(doc)
    assert list(rows) == ANALYTICS_ROWS[op]
    engine_rows = [name for name in rows if name.startswith("cpu")]
    for name in engine_rows:
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert row["exact"] is True, row["exactness"]
        assert row["device"].startswith("cpu")
        assert row["cold_s"] > 0 and row["warm_min_s"] <= row["warm_median_s"]
        assert row["throughput"] > 0 and row["repeats"] == 1
    assert rows["cpu"]["build_s"] > 0  # the upload of the searched dataset
    staged = {"knn-join": ["cpu", "cpu per_query"], "count-within": ["cpu"]}.get(op, [])
    for name in staged:  # the server's stages of one more call, a row each
        [stages] = [note for note in rows[name]["notes"] if note.startswith("one more call")]
        assert "server decode" in stages and "search" in stages and "client receive" in stages
    assert rows["cpu"]["speedup_vs_cpu"] == pytest.approx(1.0)
    n, exactness, data = doc["data"]["n_points"], rows["cpu"]["exactness"], doc["data"]
    if op == "knn-join":
        assert exactness["queries_checked"] == n and exactness["result_rows"] == n * 5
        per_query = rows["cpu per_query"]["exactness"]
        assert per_query["in_left_order"] and per_query["result_rows"] == n
        assert rows["sklearn-balltree"]["exact"] is True
        assert rows["cpu"]["speedup_vs_sklearn"] > 0
        sjoin = rows["geopandas-sjoin"]
        assert sjoin["status"] == "ok" and sjoin["exact"] is None
        assert any("not exact, planar" in note for note in sjoin["notes"])
        assert 0.5 < sjoin["exactness"]["planar_nearest_is_nearest"] < 1.0
    if op == "count-within":
        assert 5 < exactness["mean_count"] < 15  # the radius is meant to give about 10
        assert exactness["wrong_counts"] == 0 and exactness["queries_checked"] == n
        assert rows["sklearn-balltree"]["exact"] is True
        assert data["radius_m"] > 0 and f"{data['radius_m']:,.0f} m" in bench_report.title(doc)
    if op == "filtered-knn":
        ten, one = rows["cpu where 10%"]["exactness"], rows["cpu where 1%"]["exactness"]
        assert 0.05 < ten["selected_share"] < 0.15 and 0 < one["selected_share"] < 0.03
        for filtered in (ten, one):
            assert filtered["recall"] == 1.0 and filtered["selected_build_s"] > 0
            assert (
                filtered["bound_ratio"] > 0 and filtered["bound_s"] > filtered["selected_build_s"]
            )
        assert rows["cpu where 1%"]["speedup_vs_cpu"] == pytest.approx(1.0)  # against itself
    if op == "dbscan":
        assert data["description"].startswith("clustered")  # dbscan's own default
        assert 18 < data["mean_neighbours"] < 22 and data["eps_m"] > 0
        check = exactness["check"]
        assert check["points_checked"] == n and check["label_agreement"] == 1.0
        assert check["noise_differs"] == 0 and check["n_clusters"] >= 1
        assert rows["sklearn-dbscan"]["status"] == "ok" and rows["sklearn-dbscan"]["exact"] is None
        assert rows["cpu"]["speedup_vs_sklearn"] > 0
        if rows["cuml-dbscan"]["status"] == "skipped":
            assert "GPU" in rows["cuml-dbscan"]["reason"] or "cuML" in rows["cuml-dbscan"]["reason"]
    if op == "within":
        assert exactness["points_checked"] == n and exactness["in_row_order"]
        assert exactness["wrong_points"] == 0 and exactness["n_inside"] > 5
        assert exactness["n_inside"] == exactness["reference_inside"]


@pytest.mark.parametrize(
    "op, peer", [("knn-join", "sklearn-balltree"), ("dbscan", "sklearn-dbscan")]
)
def test_slow_peers_run_on_a_subset_and_are_scaled(op: str, peer: str) -> None:
    doc = _analytics(op, n=900, peer_points=300)
    rows = _rows(doc)
    assert rows[peer]["status"] == "ok"
    assert rows[peer]["queries_run"] == 300 and rows[peer]["scale"] == pytest.approx(3.0)
    assert any("times scaled x3" in note for note in rows[peer]["notes"])
    assert "--peer-points 300" in doc["command"]
    if op == "knn-join":
        assert rows[peer]["exact"] is True
        assert rows[peer]["exactness"]["queries_checked"] == 300
    else:  # the cpu engine answered the same 300 points (where) at the subset's eps
        check = rows["cpu"]["exactness"]["check"]
        assert check["points_checked"] == 300 and rows["cpu"]["exact"] is True
        assert doc["data"]["subset_eps_m"] > doc["data"]["eps_m"]  # sparser points, wider eps


def test_analytics_ops_default_to_their_targets_sizes_and_the_two_backends() -> None:
    assert BenchConfig.for_op("knn") == BenchConfig()
    assert BenchConfig.for_op("knn-join").k == 5
    filtered = BenchConfig.for_op("filtered-knn")
    assert (filtered.n, filtered.queries, filtered.k) == (1_000_000, 100_000, 10)
    assert filtered.engines == ("cpu", "gpu")
    assert BenchConfig.for_op("dbscan").data == "clustered"
    assert BenchConfig.for_op("dbscan", data="uniform").data == "uniform"
    assert BenchConfig.for_op("within").n in (1_000_000, 10_000_000)
    assert BenchConfig.for_op("count-within", radius_m=None).radius_m is None
    assert BenchConfig(op="radius").radius_m == 20_000.0


@pytest.mark.parametrize("op", list(ANALYTICS_ROWS))
def test_an_analytics_command_line_parses_back_to_its_config(op: str) -> None:
    config = BenchConfig.for_op(op, n=1234, engines=("cpu",), seed=2, peer_points=99)
    command = config.command()
    assert command.startswith(f"geonear bench --op {op} ")
    assert bench.config_from_args(_parse(command.removeprefix("geonear bench "))) == config


def test_an_unknown_engine_of_an_analytics_op_fails_with_the_valid_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown engine\(s\) sklearn-balltree.*cpu"):
        run_benchmark(BenchConfig.for_op("within", n=100, engines=("sklearn-balltree",)))


def test_geonear_bench_runs_an_analytics_op_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from geonear.clients.cli import main

    out = tmp_path / "within.json"
    argv = ["bench", "--op", "within", "--n", "2000", "--engines", "cpu,gpu", "--repeat", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "geonear-bench/1" and doc["throughput_unit"] == "points/s"
    assert [r["engine"] for r in doc["results"]] == ["cpu", "gpu"]
    assert doc["results"][0]["exact"] is True
    if doc["results"][1]["status"] == "skipped":  # a host without a GPU says why, in one line
        assert doc["results"][1]["reason"].startswith("needs a GPU")
    printed = capsys.readouterr().out
    assert "within · uniform, seed 0 · 2,000 points" in printed
    assert "points within 1e-8 rad of an edge" in printed  # the op's notes under the table


# -- the analytics checks catch wrong answers ------------------------------------------


def _join_rows(answer: Neighbours) -> tuple[np.ndarray, ...]:
    n, k = answer.indices.shape
    return (
        np.repeat(np.arange(n), k),
        np.tile(np.arange(k), n),
        answer.indices.ravel(),
        answer.distances_m.ravel(),
    )


def test_the_join_check_catches_wrong_missing_and_misplaced_rows() -> None:
    from geonear.bench.exactness import knn_exactness, neighbours_from_rows
    from geonear.loaders.synthetic import uniform_points

    lat, lon = uniform_points(400, seed=1)
    q_lat, q_lon = uniform_points(50, seed=2)
    data = bench.BenchData(lat, lon, q_lat, q_lon, "test")
    reference = CPUEngine().build_index(lat, lon).knn(q_lat, q_lon, 4)
    left, rank, right, distance = _join_rows(reference)

    def check(*rows: np.ndarray) -> bool:
        return knn_exactness(neighbours_from_rows(*rows, (50, 4)), reference, data=data)[1]

    assert check(left, rank, right, distance)
    shuffled = np.random.default_rng(0).permutation(left.size)  # row order is free
    assert check(left[shuffled], rank[shuffled], right[shuffled], distance[shuffled])
    assert not check(left, rank, (right + 1) % 400, distance)
    assert not check(left[1:], rank[1:], right[1:], distance[1:])
    assert not check((left + 1) % 50, rank, right, distance)


def test_the_count_check_allows_the_boundary_millimetre_only() -> None:
    from geonear.bench.exactness import count_exactness

    low, high = np.array([3, 5, 0]), np.array([3, 6, 0])
    assert count_exactness(np.array([3, 6, 0]), low, high, 3)[1] is True
    metrics, exact = count_exactness(np.array([3, 7, 0]), low, high, 3)
    assert not exact and metrics["wrong_counts"] == 1
    assert count_exactness(np.array([3, 5]), low, high, 3)[1] is False  # a point unanswered


def test_the_within_reference_matches_the_polygon_and_catches_wrong_points() -> None:
    from geonear.bench.analytics import WITHIN_POLYGON
    from geonear.bench.exactness import within_exactness
    from geonear.loaders.synthetic import uniform_points

    lat, lon = uniform_points(20_000, seed=3)
    data = bench.BenchData(lat, lon, lat[:0], lon[:0], "test")
    inside = np.flatnonzero(WITHIN_POLYGON.inside(lat, lon))
    assert 50 < inside.size < 300  # about 0.7% of the sphere
    # Near the centre is in (the centre itself is a vertex of every triangle: on edges),
    # near an outer tip too, between two tips beyond the inner radius not, the far side not.
    ring = np.array(WITHIN_POLYGON.geojson()["coordinates"][0])
    assert ring.shape == (65, 2) and (ring[0] == ring[-1]).all()
    tip_lon, tip_lat = ring[0]  # bearing 0: due north of the centre, 12 degrees away
    probe_lat = np.array([30.3, tip_lat - 0.5, 30.0 + 10.0 * np.cos(np.radians(360 / 64)), -30.0])
    probe_lon = np.array([15.2, tip_lon + 0.05, 15.0 + 1.2, -165.0])
    assert WITHIN_POLYGON.inside(probe_lat, probe_lon).tolist() == [True, True, False, False]
    assert within_exactness(inside, WITHIN_POLYGON, data, 20_000)[1] is True
    outside = np.setdiff1d(np.arange(20_000), inside)[0]
    for wrong in (inside[1:], np.sort(np.r_[inside, outside]), inside[::-1], np.r_[inside, inside]):
        assert within_exactness(wrong, WITHIN_POLYGON, data, 20_000)[1] is False


def test_the_dbscan_check_takes_relabelled_clusters_and_catches_merged_ones() -> None:
    from geonear.bench.exactness import dbscan_exactness, label_agreement

    reference = np.array([0, 0, 0, 1, 1, 1, -1, 2, 2])
    core = np.array([True, True, False, True, True, False, False, True, True])
    relabelled = np.array([2, 2, 2, 0, 0, 0, -1, 1, 1])
    assert dbscan_exactness(relabelled, reference, core)[1] is True
    assert label_agreement(relabelled, reference) == 1.0
    border_elsewhere = np.array([2, 2, 0, 0, 0, 0, -1, 1, 1])  # a border point, other cluster
    assert dbscan_exactness(border_elsewhere, reference, core)[1] is True
    merged = np.array([0, 0, 0, 0, 0, 0, -1, 1, 1])
    metrics, exact = dbscan_exactness(merged, reference, core)
    assert not exact and metrics["core_groups_differ"] == 1
    assert label_agreement(merged, reference) == pytest.approx(6 / 9)
    noise_taken = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])
    assert dbscan_exactness(noise_taken, reference, core)[1] is False


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}")
@pytest.mark.parametrize("op", list(ANALYTICS_ROWS))
def test_analytics_ops_serve_the_gpu_engine_exactly(op: str) -> None:
    doc = _analytics(op, n=3000, engines=("cpu", "gpu"))
    rows = _rows(doc)
    for name, row in rows.items():
        if name.startswith("gpu"):
            assert row["status"] == "ok", row["reason"]
            assert row["exact"] is True, row["exactness"]
            assert row["device"].startswith("gpu")
    if op == "dbscan" and rows["cuml-dbscan"]["status"] == "ok":
        assert rows["cuml-dbscan"]["exactness"]["label_agreement"] > 0.9
