"""Lifecycle: a fatal device error ends the server so that a supervisor restarts it.

The failing engine is the CPU engine with an index that raises ``DeviceLost`` on one
particular query (k = ``FATAL_K``), as the GPU engine does on a sticky CUDA error. The
server runs as a separate process through ``serve``, exactly as ``geonear serve`` runs
it; its restart is a plain ``geonear serve`` on the same data directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_process import start_server

from geonear.clients.client import Client
from geonear.loaders.synthetic import uniform_points
from geonear.service.calls import CallScope, in_thread
from geonear.service.engines import ENGINES, gpu_memory, register_engine
from geonear.service.engines.base import DeviceLost, Neighbours
from geonear.service.engines.cpu import CPUEngine, KDTreeIndex
from geonear.service.lifecycle import EXIT_DEVICE_LOST
from geonear.service.server import SERVICE_NAME, build_server
from geonear.service.settings import ServerSettings
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

#: The k whose KNN query loses the device.
FATAL_K = 13
#: The text CuPy gives a sticky error, as the GPU engine would wrap it.
CUDA_TEXT = "cudaErrorIllegalAddress: an illegal memory access was encountered"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DeviceLostIndex(KDTreeIndex):
    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        if k == FATAL_K:
            raise DeviceLost(f"the GPU failed during a KNN query: {CUDA_TEXT}")
        return super().knn(lat, lon, k, max_distance_m)


class DeviceLostEngine(CPUEngine):
    """The CPU engine, except that a KNN query with k = FATAL_K loses the device."""

    name = "device-lost"

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> KDTreeIndex:
        return DeviceLostIndex(lat, lon, self.earth_radius_m, self.workers)


# Declared as the cpu engine is, under its own name.
register_engine(
    dataclasses.replace(
        ENGINES["cpu"], name="device-lost", target="test_lifecycle:DeviceLostEngine"
    )
)


#: Runs ``serve`` with the failing engine in a fresh interpreter (argv: tests dir, data dir).
SERVE_FAILING = """
import logging, sys
sys.path.insert(0, sys.argv[1])
from test_lifecycle import DeviceLostEngine
from geonear.service.server import serve
from geonear.service.settings import ServerSettings
logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
serve(ServerSettings(port=0, data_dir=sys.argv[2], backend="cpu"), engine=DeviceLostEngine())
"""


def _datasets(rng: np.random.Generator) -> dict[str, pa.Table]:
    tables = {}
    for name, n in (("ports", 300), ("shops", 1200), ("trees", 50)):
        lat, lon = uniform_points(n, seed=int(rng.integers(1 << 30)))
        tables[name] = pa.table({"id": np.arange(n, dtype=np.int64) * 7, "lat": lat, "lon": lon})
    return tables


def test_device_lost_answers_unavailable_reports_not_serving_exits_and_restarts(
    tmp_path,
) -> None:
    data_dir = tmp_path / "data"
    tables = _datasets(np.random.default_rng(6))
    tests_dir = str(Path(__file__).parent)
    proc, target = start_server(
        ["-c", SERVE_FAILING, tests_dir, str(data_dir)], tmp_path / "failing.log", tmp_path
    )
    try:
        with Client(target, timeout_s=30) as client:
            for name, table in tables.items():
                client.upload(name, table)
            assert len(client.knn("ports", 0.0, 0.0, k=3)) == 3
        channel = grpc.insecure_channel(target)
        stub = pb_grpc.GeoNearStub(channel)
        # A watch sees every status change, however soon the server stops after it.
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60
        )
        statuses: list[int] = []
        watcher = threading.Thread(target=lambda: _collect(watch, statuses))
        watcher.start()
        while not statuses:
            time.sleep(0.01)
        request = pb.KnnRequest(dataset="shops", k=FATAL_K, queries=pb.Points(lat=[1.0], lon=[2.0]))
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.Knn(request, timeout=30))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lost its device" in failed.value.details()
        assert "cudaErrorIllegalAddress" in failed.value.details()
        assert proc.wait(60) == EXIT_DEVICE_LOST
        watcher.join(60)
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert statuses[0] == SERVING and NOT_SERVING in statuses
    text = (tmp_path / "failing.log").read_text()
    assert "unrecoverable device error" in text and "cudaErrorIllegalAddress" in text
    assert "rpc=Knn dataset=shops rows=0" in text and "status=UNAVAILABLE" in text

    # The supervisor's restart: geonear serve on the same data directory.
    proc, target = start_server(
        ["-m", "geonear", "serve", "--port", "0", "--data-dir", str(data_dir),
         "--backend", "cpu"],
        tmp_path / "restarted.log", tmp_path,
    )  # fmt: skip
    try:
        with Client(target, timeout_s=30) as client:
            found = {d.name: d.rows for d in client.datasets()}
            assert found == {name: t.num_rows for name, t in tables.items()}
            for name, table in tables.items():
                got = client.knn(name, 1.0, 2.0, k=FATAL_K)
                assert len(got) == min(FATAL_K, table.num_rows)
                assert set(got["id"]) <= set(table.column("id").to_pylist())
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == SERVING
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def _collect(watch, statuses: list[int]) -> None:
    try:
        for response in watch:
            statuses.append(response.status)
    except grpc.RpcError:
        pass  # the server stopped


def test_after_device_lost_every_call_is_refused_and_health_says_not_serving(tmp_path) -> None:
    settings = ServerSettings(host="127.0.0.1", port=0, data_dir=tmp_path / "data")
    parts = build_server(settings, engine=DeviceLostEngine())
    parts.server.start()
    target = f"127.0.0.1:{parts.port}"
    try:
        with Client(target, timeout_s=30) as client:
            client.upload("pts", pa.table({"lat": [0.0, 1.0], "lon": [0.0, 1.0]}))
            channel = grpc.insecure_channel(target)
            stub = pb_grpc.GeoNearStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            points = pb.Points(lat=[0.0], lon=[0.0])
            with pytest.raises(grpc.RpcError) as failed:
                stub.KnnCompact(pb.KnnRequest(dataset="pts", k=FATAL_K, queries=points))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert parts.lifecycle.stop_requested.is_set()
            assert parts.lifecycle.exit_code == EXIT_DEVICE_LOST
            for name in ("", SERVICE_NAME):
                check = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
                assert check.status == NOT_SERVING
            # Calls that would not touch the device are refused too: the process is ending.
            with pytest.raises(grpc.RpcError) as refused:
                stub.KnnCompact(pb.KnnRequest(dataset="pts", k=1, queries=points))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "restarting" in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListDatasets(pb.ListDatasetsRequest())
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            channel.close()
    finally:
        parts.stop(None)


def test_a_graceful_stop_keeps_exit_status_zero(tmp_path) -> None:
    parts = build_server(ServerSettings(host="127.0.0.1", port=0, data_dir=None))
    parts.lifecycle.request_stop()
    assert parts.lifecycle.stop_requested.is_set()
    assert parts.lifecycle.exit_code == 0
    assert parts.lifecycle.grace_s(7.0) == 7.0
    parts.stop(None)


@pytest.mark.parametrize(
    "text",
    [
        CUDA_TEXT,
        "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure",
        "CUDA error at: rmm/cuda_stream.cpp:1: cudaErrorECCUncorrectable uncorrectable ECC",
    ],
)
def test_sticky_cuda_errors_become_device_lost(text: str) -> None:
    with (
        pytest.raises(DeviceLost, match="during a KNN query") as lost,
        gpu_memory.translate_out_of_memory("a KNN query"),
    ):
        raise RuntimeError(text)
    assert isinstance(lost.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "text",
    [
        "cudaErrorMemoryAllocation: out of memory",
        "cudaErrorInvalidValue: invalid argument",
        "std::bad_alloc: out_of_memory: RMM failure",
    ],
)
def test_errors_a_later_call_survives_are_not_device_lost(text: str) -> None:
    assert not gpu_memory.is_device_lost(RuntimeError(text))


def test_a_thread_pool_call_closed_at_shutdown_ends_without_an_error() -> None:
    """A cancelled call still waiting for its thread, closed when the loop goes away,
    ends quietly (it used to raise its CancelledError from close: "Exception ignored")."""
    scope = CallScope(types.SimpleNamespace(time_remaining=lambda: None))  # type: ignore[arg-type]
    release = threading.Event()
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(in_thread(scope, release.wait))
        loop.run_until_complete(asyncio.sleep(0.05))
        task.cancel()
        loop.run_until_complete(asyncio.sleep(0.05))
        assert not scope.is_active()  # the handler's work was told the call is over
        assert not task.done()  # and the call waits for its thread to let go
        task.get_coro().close()  # what a closing loop's garbage collection does
    finally:
        release.set()
        loop.close()
