"""Several worker processes on one port (``geonear serve --processes 2``)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.clients.errors import FailedPrecondition
from geonear.loaders.synthetic import uniform_points
from geonear.service.server import build_server
from geonear.service.settings import ServerSettings


def _populate(data_dir: Path) -> pa.Table:
    lat, lon = uniform_points(3_000, seed=5)
    table = pa.table({"id": np.arange(3_000), "lat": lat, "lon": lon})
    parts = build_server(ServerSettings(host="127.0.0.1", port=0, data_dir=data_dir, backend="cpu"))
    parts.server.start()
    try:
        with Client(f"127.0.0.1:{parts.port}", timeout_s=30) as client:
            client.upload("pts", table)
    finally:
        parts.stop(None)
    return table


@pytest.mark.slow
def test_two_worker_processes_share_a_port_and_serve_the_same_answers(tmp_path: Path) -> None:
    _populate(tmp_path / "data")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "geonear",
            "serve",
            "--port",
            "0",
            "--processes",
            "2",
            "--data-dir",
            str(tmp_path / "data"),
            "--backend",
            "cpu",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        port = None
        deadline = time.monotonic() + 120
        assert server.stderr is not None
        while port is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            match = re.search(r"listening on [\d.]+:(\d+) \(2 worker processes\)", line)
            port = int(match.group(1)) if match else None
        assert port is not None, "the server never announced its port"
        q_lat, q_lon = uniform_points(20, seed=9)
        seen: dict[int, object] = {}
        for _ in range(60):  # each new channel is a new connection the kernel places
            with Client(f"127.0.0.1:{port}", timeout_s=30) as client:
                info = client.server_info()
                assert info.worker_processes == 2
                seen.setdefault(info.worker_index, client.knn("pts", q_lat, q_lon, k=5))
            if len(seen) == 2:
                break
        assert set(seen) == {0, 1}
        assert seen[0].equals(seen[1])
        with Client(f"127.0.0.1:{port}", timeout_s=30) as client:
            assert client.info("pts").rows == 3_000
            with pytest.raises(FailedPrecondition, match="worker processes"):
                client.drop("pts")
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    assert (tmp_path / "data" / "pts").is_dir()  # nothing was dropped
