"""``geonear loadtest`` against real servers on port 0, through the command line.

Each run lasts one or two seconds with real worker processes and real gRPC; the tests
check what the JSON, HTML and PNG say (counts that add up, ordered percentiles, error
codes, plots present), never how long anything took. The one latency comparison is
relative: against a server slowed on purpose, the open loop must show the queueing that
the closed loop hides.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.loaders.synthetic import uniform_points
from geonear.loadtest import add_loadtest_arguments, run_loadtest
from geonear.loadtest.results import check_consistent, decode_histograms
from geonear.service.engines.cpu import CPUEngine, KDTreeIndex
from geonear.service.server import EventLoopThread, LoopServer, create_server
from geonear.service.servicer import GeoNearServicer
from geonear.service.settings import ServerSettings
from geonear.service.store import DatasetStore
from geonear.v1 import geonear_pb2_grpc as pb_grpc

DATASET = "points"
N_POINTS = 20_000


def _points_table(n: int, seed: int) -> pa.Table:
    lat, lon = uniform_points(n, seed=seed)
    return pa.table({"id": np.arange(n, dtype=np.int64), "lat": lat, "lon": lon})


@pytest.fixture(scope="module")
def lt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real CPU server holding DATASET; yields its address."""
    settings = ServerSettings(
        host="127.0.0.1", port=0, backend="cpu", data_dir=tmp_path_factory.mktemp("loadtest-data")
    )
    server, port, _ = create_server(settings)
    server.start()
    address = f"127.0.0.1:{port}"
    with Client(address) as client:
        client.upload(DATASET, _points_table(N_POINTS, seed=1))
    yield address
    server.stop(grace=None).wait()


class _SlowIndex(KDTreeIndex):
    def knn(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.020)
        return super().knn(*args, **kwargs)


class _SlowEngine(CPUEngine):
    """The CPU engine with 20 ms added to every KNN: a server that cannot keep up."""

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> KDTreeIndex:
        return _SlowIndex(lat, lon, self.earth_radius_m, self.workers)


class _AuthorizationLog(grpc.aio.ServerInterceptor):
    """Keeps the authorization metadata of every call the server receives."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.seen.update(v for k, v in details.invocation_metadata if k == "authorization")
        return await continuation(details)


@dataclass
class _SlowServer:
    address: str
    authorization: _AuthorizationLog


@pytest.fixture(scope="module")
def lt_slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_SlowServer]:
    """A server on one RPC thread whose KNN takes 20 ms: at most ~50 KNN/s."""
    settings = ServerSettings(
        host="127.0.0.1",
        port=0,
        backend="cpu",
        batching=False,  # one request per engine call: the 20 ms cannot be shared
        data_dir=tmp_path_factory.mktemp("loadtest-slow"),
    )
    store = DatasetStore(_SlowEngine(), settings.data_dir)
    store.upload(DATASET, "create", _points_table(2_000, seed=2))
    log = _AuthorizationLog()
    loop = EventLoopThread()
    pool = futures.ThreadPoolExecutor(max_workers=1)
    loop.loop.set_default_executor(pool)

    async def make() -> grpc.aio.Server:
        return grpc.aio.server(migration_thread_pool=pool, interceptors=[log])

    server = LoopServer(loop, loop.run(make()), pool)
    pb_grpc.add_GeoNearServicer_to_server(GeoNearServicer(store, settings, "cpu"), server.aio)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server.aio)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield _SlowServer(f"127.0.0.1:{port}", log)
    server.stop(grace=None).wait()


def _loadtest(*args: str) -> int:
    return main(["loadtest", *args, "--quiet"])


def _runs(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    assert doc["format"] == "geonear-loadtest/1"
    return doc["runs"]


def _assert_consistent(run: dict[str, Any]) -> None:
    assert run["requests"] == run["successes"] + sum(run["errors"].values())
    lat = run["latency_ms"]
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"]
    assert check_consistent(run) == []


# -- closed and open loop, one and two processes ---------------------------------------
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("mode", ["closed", "open"])
def test_knn_run_holds_consistent_counts(
    lt_server: str, tmp_path: Path, mode: str, processes: int
) -> None:
    out = tmp_path / "run.json"
    load = ["--concurrency", "8"] if mode == "closed" else ["--rate", "100"]
    rc = _loadtest(
        "--target",
        lt_server,
        "--scenario",
        "knn",
        "--dataset",
        DATASET,
        "-k",
        "5",
        *load,
        "--duration",
        "2",
        "--warmup",
        "0.5",
        "--processes",
        str(processes),
        "--channels",
        "2",
        "--json",
        str(out),
    )
    assert rc == 0
    (run,) = _runs(out)
    _assert_consistent(run)
    assert run["mode"] == mode
    assert run["config"]["processes"] == processes
    assert run["errors"] == {}
    assert run["successes"] > 0
    assert run["throughput_rps"] > 0
    # Every query of a 20k-point dataset has its 5 neighbours.
    assert run["rows"] == 5 * run["successes"]
    assert decode_histograms([run["histogram"]]).get_total_count() == run["successes"]
    assert run["server"]["backend"] == "cpu"
    assert run["dataset"]["rows"] == N_POINTS
    if mode == "open":
        # The schedule, not the server, sets the count: 100/s for 2 s, each worker's
        # share rounded, and every scheduled request awaited to its answer.
        assert abs(run["requests"] - 200) <= processes


def test_unknown_dataset_counts_not_found_errors(
    lt_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing.json"
    rc = _loadtest(
        "--target",
        lt_server,
        "--scenario",
        "knn",
        "--dataset",
        "no-such-set",
        "--concurrency",
        "4",
        "--duration",
        "0.5",
        "--warmup",
        "0",
        "--json",
        str(out),
    )
    assert rc == 1  # every request failed
    err = capsys.readouterr().err
    assert "does not exist" in err and "no-such-set" in err
    (run,) = _runs(out)
    _assert_consistent(run)
    assert run["successes"] == 0
    assert run["requests"] > 0
    assert run["errors"] == {"NOT_FOUND": run["requests"]}
    (first,) = run["error_messages"]
    assert first["code"] == "NOT_FOUND" and first["count"] == run["requests"]
    assert "no-such-set" in first["message"]
    assert sum(run["timeline"]["errors"]) == run["requests"]


def test_create_dataset_uploads_uniform_points_first(lt_server: str, tmp_path: Path) -> None:
    out = tmp_path / "created.json"
    rc = _loadtest(
        "--target",
        lt_server,
        "--scenario",
        "radius",
        "--dataset",
        "fresh",
        "--create-dataset",
        "5000",
        "--radius-m",
        "500000",
        "--concurrency",
        "2",
        "--duration",
        "0.5",
        "--warmup",
        "0",
        "--json",
        str(out),
    )
    assert rc == 0
    with Client(lt_server) as client:
        assert client.info("fresh").rows == 5000
    (run,) = _runs(out)
    _assert_consistent(run)
    assert run["errors"] == {}
    # 500 km circles over 5000 uniform points hold about 30 points each.
    assert run["rows"] > run["successes"]


@pytest.mark.parametrize(
    "scenario, extra",
    [
        ("matrix", ["--matrix-targets", "50", "--batch", "3"]),
        ("kmeans", ["-k", "3"]),
        ("mixed", ["--matrix-targets", "20"]),
        ("upload", ["--batch", "100"]),
    ],
)
def test_other_scenarios_answer_without_errors(
    lt_server: str, tmp_path: Path, scenario: str, extra: list[str]
) -> None:
    out = tmp_path / f"{scenario}.json"
    rc = _loadtest(
        "--target",
        lt_server,
        "--scenario",
        scenario,
        "--dataset",
        DATASET,
        *extra,
        "--concurrency",
        "2",
        "--duration",
        "0.5",
        "--warmup",
        "0",
        "--json",
        str(out),
    )
    assert rc == 0
    (run,) = _runs(out)
    _assert_consistent(run)
    assert run["errors"] == {}
    assert run["successes"] > 0
    if scenario == "matrix":
        assert run["rows"] == 3 * 50 * run["successes"]
    elif scenario == "kmeans":
        assert run["rows"] == 3 * run["successes"]
    elif scenario == "upload":
        assert run["rows"] == 100 * run["successes"]
        with Client(lt_server) as client:
            names = {d.name for d in client.datasets()}
        assert not any(n.startswith(f"{DATASET}-upload") for n in names)


# -- coordinated omission --------------------------------------------------------------
def test_open_loop_shows_the_queueing_the_closed_loop_hides(
    lt_slow_server: _SlowServer, tmp_path: Path
) -> None:
    common = [
        "--target",
        lt_slow_server.address,
        "--scenario",
        "knn",
        "--dataset",
        DATASET,
        "--duration",
        "2",
        "--warmup",
        "0",
    ]
    closed, opened = tmp_path / "closed.json", tmp_path / "open.json"
    # One request at a time: the server looks as fast as one KNN.
    assert _loadtest(*common, "--concurrency", "1", "--json", str(closed)) == 0
    # Twice what the server can answer: requests queue, and latency counted from the
    # schedule grows with the queue.
    assert _loadtest(*common, "--rate", "100", "--json", str(opened)) == 0
    (c,), (o,) = _runs(closed), _runs(opened)
    _assert_consistent(c)
    _assert_consistent(o)
    assert c["errors"] == {} and o["errors"] == {}
    assert o["latency_ms"]["p50"] > 3 * c["latency_ms"]["p50"]
    assert o["latency_ms"]["p99"] > 3 * c["latency_ms"]["p99"]


# -- reports ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lt_compare_run(lt_server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --compare run of two named targets (the same server twice), JSON, HTML and PNG."""
    out = tmp_path_factory.mktemp("compare")
    rc = _loadtest(
        "--compare",
        f"first={lt_server}",
        f"second={lt_server}",
        "--scenario",
        "ping",
        "--concurrency",
        "4",
        "--duration",
        "0.5",
        "--warmup",
        "0",
        "--json",
        str(out / "compare.json"),
        "--html",
        str(out / "compare.html"),
        "--png",
        str(out / "compare.png"),
    )
    assert rc == 0
    return out


def _images(page: str) -> list[bytes]:
    return [
        base64.b64decode(m)
        for m in re.findall(r"<img[^>]+src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    ]


def test_compare_run_reports_each_target_with_plots(lt_compare_run: Path) -> None:
    runs = _runs(lt_compare_run / "compare.json")
    assert [r["name"] for r in runs] == ["first", "second"]
    for run in runs:
        _assert_consistent(run)
        assert run["scenario"] == "ping"
        assert run["successes"] > 0
        assert run["rows"] == 0
    page = (lt_compare_run / "compare.html").read_text()
    images = _images(page)
    assert len(images) == 4
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in images)
    assert "first" in page and "second" in page
    assert (lt_compare_run / "compare.png").read_bytes().startswith(b"\x89PNG")


def test_report_combines_saved_runs(lt_compare_run: Path, lt_server: str, tmp_path: Path) -> None:
    single = tmp_path / "single.json"
    assert (
        _loadtest(
            "--target",
            lt_server,
            "--scenario",
            "ping",
            "--concurrency",
            "2",
            "--duration",
            "0.5",
            "--warmup",
            "0",
            "--json",
            str(single),
        )
        == 0
    )
    page, combined = tmp_path / "both.html", tmp_path / "both.json"
    rc = main(
        [
            "loadtest",
            "report",
            str(lt_compare_run / "compare.json"),
            str(single),
            "--html",
            str(page),
            "--json",
            str(combined),
        ]
    )
    assert rc == 0
    runs = _runs(combined)
    assert [r["name"] for r in runs] == ["first", "second", lt_server]
    text = page.read_text()
    assert len(_images(text)) == 4
    assert lt_server in text


def test_report_merge_adds_up_parallel_generators(lt_compare_run: Path, tmp_path: Path) -> None:
    source = lt_compare_run / "compare.json"
    merged = tmp_path / "merged.json"
    assert (
        main(["loadtest", "report", str(source), str(source), "--merge", "--json", str(merged)])
        == 0
    )
    before = {r["name"]: r for r in _runs(source)}
    for run in _runs(merged):
        _assert_consistent(run)
        assert run["successes"] == 2 * before[run["name"]]["successes"]
        assert run["throughput_rps"] == pytest.approx(2 * before[run["name"]]["throughput_rps"])


def test_token_travels_as_bearer_metadata(lt_slow_server: _SlowServer, tmp_path: Path) -> None:
    out = tmp_path / "token.json"
    assert (
        _loadtest(
            "--target",
            lt_slow_server.address,
            "--scenario",
            "ping",
            "--token",
            "s3cret",
            "--concurrency",
            "1",
            "--duration",
            "0.5",
            "--warmup",
            "0",
            "--json",
            str(out),
        )
        == 0
    )
    assert "Bearer s3cret" in lt_slow_server.authorization.seen
    (run,) = _runs(out)
    assert run["successes"] > 0


def test_mutual_tls_needs_both_certificate_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("not used: the options are refused first")
    assert main(["loadtest", "--target", "localhost:1", "--tls-cert", str(cert)]) == 2
    assert "--tls-key" in capsys.readouterr().err


def test_a_run_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", "--scenario", "ping"]) == 2
    assert "--target" in capsys.readouterr().err


def test_exports_are_the_command_line_hooks() -> None:
    import geonear.loadtest as loadtest

    assert loadtest.__all__ == ["add_loadtest_arguments", "run_loadtest"]
    assert callable(add_loadtest_arguments) and callable(run_loadtest)
