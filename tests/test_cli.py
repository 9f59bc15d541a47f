"""The ``geonear`` command line: a real ``geonear serve`` process and client commands.

The server runs as a subprocess started the way a user starts it; client commands run
both as subprocesses (exit codes, stdout/stderr as a shell sees them) and in-process
through ``geonear.clients.cli.main`` (faster, same code).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.cli import main
from geonear.clients.client import Client
from geonear.geometry import EARTH_RADIUS_M

LISTENING = re.compile(r"listening on (\S+):(\d+)")
#: Wide enough that rich never wraps or truncates a table cell.
ENV = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}


class ServeProcess:
    def __init__(self, data_dir: Path, cwd: Path) -> None:
        self.cwd = cwd
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "geonear",
                "serve",
                "--port",
                "0",
                "--data-dir",
                str(data_dir),
                "--demo",
            ],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                self.log.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=120)
            except queue.Empty:
                self.stop()
                raise AssertionError("no 'listening on' line:\n" + "".join(self.log)) from None
            if line is None:
                raise AssertionError("geonear serve exited:\n" + "".join(self.log))
            match = LISTENING.search(line)
            if match:
                self.target = f"{match.group(1)}:{match.group(2)}"
                self.port = int(match.group(2))
                return

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("cli")
    running = ServeProcess(root / "data", cwd=root)
    try:
        yield running
    finally:
        running.stop()


def geonear(serve: ServeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``geonear ARGS --target ...`` as a subprocess, from a folder outside the repo."""
    command = [sys.executable, "-m", "geonear", *args, "--target", serve.target]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=serve.cwd,  # outside the repo, so its folders do not shadow the package
    )


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    from geonear.clients import cli

    monkeypatch.setattr(cli._console, "width", 250)


# -- serve -----------------------------------------------------------------------------
def test_serve_logs_its_address_and_backend(serve: ServeProcess) -> None:
    assert serve.target.startswith("127.0.0.1:") and serve.port > 0
    log = "".join(serve.log)
    assert "cpu" in log
    assert "Traceback" not in log


def test_serve_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    running = ServeProcess(tmp_path / "data", cwd=tmp_path)
    assert running.stop() == 0
    assert "shutting down" in "".join(running.log)
    assert (tmp_path / "data" / "manifest.json").exists()  # the demo data persisted


# -- client commands as subprocesses -----------------------------------------------------
def test_datasets_command(serve: ServeProcess) -> None:
    result = geonear(serve, "datasets")
    assert result.returncode == 0, result.stderr
    assert "airports" in result.stdout and "cities" in result.stdout
    assert "cpu" in result.stdout


def test_info_command(serve: ServeProcess) -> None:
    result = geonear(serve, "info", "airports")
    assert result.returncode == 0, result.stderr
    assert "airports version 1" in result.stdout
    assert "engine cpu" in result.stdout and "ids string" in result.stdout
    assert "iata (string)" in result.stdout


def test_knn_command_with_columns(serve: ServeProcess) -> None:
    result = geonear(
        serve,
        "knn",
        "airports",
        "--lat",
        "51.47",
        "--lon",
        "-0.4543",
        "-k",
        "3",
        "--columns",
        "iata,country",
    )
    assert result.returncode == 0, result.stderr
    first_row = next(line for line in result.stdout.splitlines() if "EGLL" in line)
    assert "LHR" in first_row and "GB" in first_row
    assert "3 nearest in airports" in result.stdout


def test_radius_command(serve: ServeProcess) -> None:
    result = geonear(
        serve, "radius", "airports", "--lat", "51.47", "--lon", "-0.4543", "--radius-m", "3000"
    )
    assert result.returncode == 0, result.stderr
    assert "EGLL" in result.stdout
    assert "within 3000.0 m in airports" in result.stdout


def test_matrix_command_writes_npy(serve: ServeProcess, tmp_path: Path) -> None:
    out = tmp_path / "m.npy"
    result = geonear(
        serve,
        "matrix",
        "--lat",
        "0,10",
        "--lon",
        "0,0",
        "--lat2",
        "0,90",
        "--lon2",
        "180,0",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "2 x 2 float64" in result.stdout
    m = np.load(out)
    assert m[0, 0] == pytest.approx(np.pi * EARTH_RADIUS_M, abs=1e-3)
    assert m[1, 1] == pytest.approx(np.radians(80) * EARTH_RADIUS_M, abs=1e-3)


def test_kmeans_command(serve: ServeProcess) -> None:
    result = geonear(serve, "kmeans", "cities", "-k", "4", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "4 clusters of cities" in result.stdout
    assert re.search(r"inertia \S+ m\^2 after \d+ iterations", result.stdout)


def test_server_info_command(serve: ServeProcess) -> None:
    result = geonear(serve, "server-info")
    assert result.returncode == 0, result.stderr
    assert "backend cpu" in result.stdout
    assert f"earth radius {EARTH_RADIUS_M} m" in result.stdout
    assert "max_k: 10000" in result.stdout
    assert re.search(r"^  cpu \(cpu\): .*knn.*radius", result.stdout, re.MULTILINE)


def test_unknown_dataset_prints_one_line_and_exits_non_zero(serve: ServeProcess) -> None:
    result = geonear(serve, "info", "no-such-dataset")
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("geonear: NOT_FOUND:") and "'no-such-dataset'" in lines[0]


def test_drop_command(serve: ServeProcess) -> None:
    # drop a scratch dataset so the other tests keep the demo data
    with Client(serve.target) as c:
        c.upload("scratch", pa.table({"lat": [1.0], "lon": [2.0]}))
    result = geonear(serve, "drop", "scratch")
    assert result.returncode == 0, result.stderr
    assert "dropped scratch (version 1)" in result.stdout
    again = geonear(serve, "drop", "scratch")
    assert again.returncode == 1 and "NOT_FOUND" in again.stderr


# -- client commands in-process --------------------------------------------------------
def test_main_knn_several_queries(serve: ServeProcess, capsys) -> None:
    code, out, err = run_main(
        capsys,
        "knn",
        "airports",
        "--lat",
        "51.47,40.6413",
        "--lon=-0.4543,-73.7781",
        "-k",
        "1",
        "--max-distance-m",
        "5000",
        "--target",
        serve.target,
    )
    assert code == 0, err
    assert "EGLL" in out and "KJFK" in out


def test_main_matrix_prints_a_table(serve: ServeProcess, capsys) -> None:
    code, out, err = run_main(
        capsys,
        "matrix",
        "--lat",
        "0",
        "--lon",
        "0",
        "--lat2",
        "0,0",
        "--lon2",
        "90,180",
        "--dtype",
        "float32",
        "--target",
        serve.target,
    )
    assert code == 0, err
    assert "col 0" in out and "col 1" in out
    assert "distance matrix, metres" in out


def test_main_matrix_against_a_dataset(serve: ServeProcess, capsys, tmp_path) -> None:
    out_file = tmp_path / "airports.npy"
    code, _, err = run_main(
        capsys,
        "matrix",
        "airports",
        "--lat",
        "0",
        "--lon",
        "0",
        "--out",
        str(out_file),
        "--target",
        serve.target,
    )
    assert code == 0, err
    assert np.load(out_file).shape[0] == 1 and np.load(out_file).shape[1] > 20_000


def test_main_kmeans_with_weights(serve: ServeProcess, capsys) -> None:
    code, out, err = run_main(
        capsys, "kmeans", "cities", "-k", "3", "--weights", "population", "--target", serve.target
    )
    assert code == 0, err
    assert "3 clusters of cities" in out


def test_main_errors_exit_non_zero_with_one_line(serve: ServeProcess, capsys) -> None:
    code, out, err = run_main(
        capsys, "knn", "airports", "--lat", "95", "--lon", "0", "--target", serve.target
    )
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("geonear: INVALID_ARGUMENT:")
    code, _, err = run_main(
        capsys,
        "knn",
        "airports",
        "--lat",
        "0",
        "--lon",
        "0",
        "--columns",
        "colour",
        "--target",
        serve.target,
    )
    assert code == 1 and "NOT_FOUND" in err and "'colour'" in err
    code, _, err = run_main(capsys, "matrix", "--lat", "0", "--lon", "0", "--target", serve.target)
    assert code == 2 and "give a dataset NAME or --lat2/--lon2" in err


def test_main_unreachable_server(capsys) -> None:
    code, _, err = run_main(capsys, "datasets", "--target", "127.0.0.1:9", "--timeout-s", "5")
    assert code == 1
    assert err.startswith("geonear: UNAVAILABLE:") and err.count("\n") == 1


def test_main_usage_errors_exit_two(capsys) -> None:
    try:
        code = main(["knn", "airports"])
    except SystemExit as exc:  # argparse's own usage errors exit
        code = exc.code
    assert code == 2
    assert "--lat" in capsys.readouterr().err
