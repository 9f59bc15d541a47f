"""Shared fixtures: a real server on port 0, clients and raw stubs for it, small real data.

Nothing here is faked: the server is the one ``geonear serve`` runs, bound to a free
loopback port, persisting to a per-test data directory; data sets are the seeded
synthetic generators and the bundled airports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.loaders.bundled import airports
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import gpu_available, gpu_memory
from geonear.service.server import create_server
from geonear.service.settings import ServerSettings
from geonear.service.store import DatasetStore
from geonear.v1 import geonear_pb2_grpc as pb_grpc


@dataclass
class RunningServer:
    """A started server: its port, store and settings; ``stop()`` is idempotent."""

    server: grpc.Server
    port: int
    store: DatasetStore
    settings: ServerSettings
    _stopped: bool = field(default=False, repr=False)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if not self._stopped:
            self.server.stop(grace=None).wait()
            self._stopped = True


def start_server(data_dir: Path | None, **settings: Any) -> RunningServer:
    """Start a CPU server on a free loopback port with ``settings`` overriding defaults."""
    settings.setdefault("backend", "cpu")
    config = ServerSettings(host="127.0.0.1", port=0, data_dir=data_dir, **settings)
    server, port, store = create_server(config)
    server.start()
    return RunningServer(server=server, port=port, store=store, settings=config)


_DEFAULT = object()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Start servers; all stop at teardown.

    ``data_dir`` defaults to this test's ``tmp_path/data``; ``data_dir=None`` keeps the
    datasets in memory only.
    """
    started: list[RunningServer] = []

    def make(data_dir: Any = _DEFAULT, **settings: Any) -> RunningServer:
        directory = tmp_path / "data" if data_dir is _DEFAULT else data_dir
        assert directory is None or isinstance(directory, Path)
        running = start_server(directory, **settings)
        started.append(running)
        return running

    yield make
    for running in started:
        running.stop()


@pytest.fixture
def server(server_factory: Callable[..., RunningServer]) -> RunningServer:
    return server_factory()


@pytest.fixture
def client(server: RunningServer) -> Iterator[Client]:
    with Client(server.target, timeout_s=60) as c:
        yield c


@pytest.fixture
def stub(server: RunningServer) -> Iterator[pb_grpc.GeoNearStub]:
    """A raw stub, for requests the client would never send."""
    channel = grpc.insecure_channel(server.target)
    try:
        yield pb_grpc.GeoNearStub(channel)
    finally:
        channel.close()


@pytest.fixture(autouse=True)
def _gpu_pool_as_a_server_sets_it_up(request: pytest.FixtureRequest) -> None:
    """Before the first GPU test, the process's one device pool is set up as a default
    ``geonear serve`` sets it up (no size, no managed memory), so that no test's engine
    options decide the pool of every test after it (the bench's in-process engine asks
    for a capped 1 GiB pool: first in a run, it failed the large-k KNN tests after it)."""
    if request.node.get_closest_marker("gpu") is None or not gpu_available()[0]:
        return
    gpu_memory.initialise_pool()


# -- data -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def uniform() -> tuple[np.ndarray, np.ndarray]:
    """2000 points uniform on the sphere, (lat, lon) degrees."""
    return uniform_points(2000, seed=7)


@pytest.fixture(scope="session")
def clustered() -> tuple[np.ndarray, np.ndarray]:
    """3000 points in tight clusters of unequal sizes, (lat, lon) degrees."""
    return clustered_points(3000, seed=11, n_clusters=40, spread_m=20_000.0)


@pytest.fixture(scope="session")
def airports_table() -> pa.Table:
    """The bundled airports (about 28k; string ICAO ids, name, country, ... attributes)."""
    return airports()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """An engine that raises NotImplementedError for a query kind skips that test.

    Comparison engines (cuML) state what they cannot do by raising it (STYLE.md); the
    parity suite then reports the gap as a skip with the engine's reason.
    """
    outcome = yield
    report = outcome.get_result()
    if (
        report.when == "call"
        and call.excinfo is not None
        and call.excinfo.errisinstance(NotImplementedError)
    ):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")
