"""The one k-means driver: its argument checks, and stops that end a run within an iteration.

Every engine runs k-means through ``spherical_kmeans.spherical_kmeans``, which checks the
caller's stop before each Lloyd iteration (cuML, which runs its own loop, before each
initialisation). The driver logs every iteration and initialisation on
``geonear.kmeans``; the tests count those records, never the clock.

Through a real server, a KMeans of n_init=1000 initialisations of up to 10,000 iterations
each (minutes of work) is cancelled, or runs past its deadline, while the server's
k-means thread is held at the end of an iteration until the stop reaches it. The call
must end with CANCELLED or DEADLINE_EXCEEDED, the server must run no further iteration,
and the next call must be served: the server runs one call at a time
(max_concurrent_rpcs=1), so it is served only once the stopped one has let go.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest
from conftest import RunningServer, start_server

from geonear.clients.client import Client
from geonear.geometry import EARTH_RADIUS_M, unit_vectors, unit_vectors_to_latlon
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import (
    Engine,
    EngineUnavailable,
    create_engine,
    gpu_available,
)
from geonear.service.engines.spherical_kmeans import (
    ArrayKMeans,
    KMeansStopped,
    check_stop,
    kmeans_plus_plus,
    spherical_kmeans,
    stopping_when,
)
from geonear.service.settings import Limits
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}"),
]


def _served_engine(name: str, gpu: bool = False, **settings: Any) -> Any:
    return pytest.param((name, settings), id=name, marks=_GPU if gpu else [])


#: Every engine, as a server runs it: (name, server settings).
SERVED_ENGINES = [
    _served_engine("numpy-brute", engine="numpy-brute"),
    _served_engine("sklearn", engine="sklearn"),
    _served_engine("cpu", backend="cpu"),
    _served_engine("dask", backend="cpu", dask_local_workers=1),
    _served_engine("gpu", gpu=True, backend="gpu"),
    _served_engine("cuml", gpu=True, engine="cuml"),
    _served_engine("cupy-broadcast", gpu=True, engine="cupy-broadcast"),
    _served_engine("dask-gpu", gpu=True, backend="gpu", dask_local_workers=1),
]
#: The single-process engines, for the driver's own checks.
ENGINES = [
    pytest.param(n, id=n, marks=_GPU if n in ("gpu", "cuml", "cupy-broadcast") else [])
    for n in ("numpy-brute", "sklearn", "cpu", "gpu", "cuml", "cupy-broadcast")
]
#: A KMeans that would run for minutes: 1000 initialisations of up to 10,000 iterations.
LONG = {"k": 64, "n_init": 1000, "max_iter": 10_000, "tol": 1e-300}
#: Most seconds any wait below may last before the test fails instead of hanging.
HANG_GUARD_S = 120.0


# -- counting what the driver does ------------------------------------------------------
class KMeansSteps(logging.Handler):
    """Counts the driver's records of one ``step`` ("iteration" or "initialisation").

    With ``hold_at``, the thread that logs that step's ``hold_at``-th record is held there,
    at the end of the step, until its own stop check says stop (``check_stop``): the
    moment the cancellation or deadline has reached the k-means.
    """

    def __init__(self, step: str, hold_at: int | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.step = step
        self.hold_at = hold_at
        self.count = 0
        self.held = threading.Event()
        self.stopped = threading.Event()
        self.stop_reached_held_thread = False

    def handle(self, record: logging.LogRecord) -> bool:
        # Not emit(): the held thread must not keep the handler's lock.
        kind = getattr(record, "kmeans_step", None)
        if kind == "stopped":
            self.stopped.set()
        elif kind == self.step:
            self.count += 1
            if self.count == self.hold_at:
                self.held.set()
                self.stop_reached_held_thread = _wait_for_stop()
        return True

    def emit(self, record: logging.LogRecord) -> None:
        """Unused: ``handle`` does the counting."""


def _wait_for_stop() -> bool:
    """Whether this thread's k-means stop check turned True within HANG_GUARD_S."""
    give_up = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < give_up:
        try:
            check_stop()
        except KMeansStopped:
            return True
        time.sleep(0.01)
    return False


@contextlib.contextmanager
def counting(step: str, hold_at: int | None = None) -> Iterator[KMeansSteps]:
    logger = logging.getLogger("geonear.kmeans")
    steps = KMeansSteps(step, hold_at)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(steps)
    try:
        yield steps
    finally:
        logger.removeHandler(steps)
        logger.setLevel(level)


# -- the driver ---------------------------------------------------------------------------
POINTS = clustered_points(3000, seed=11, n_clusters=40, spread_m=20_000.0)


def _backend(weights: Any = None) -> ArrayKMeans:
    return ArrayKMeans(unit_vectors(*POINTS), weights, EARTH_RADIUS_M)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"k": 0}, r"k must be between 1 and the number of points \(3000\), got 0"),
        ({"k": 3001}, r"k must be between 1 and the number of points \(3000\), got 3001"),
        ({"n_init": 0}, "n_init must be at least 1, got 0"),
        ({"max_iter": 0}, "max_iter must be at least 1, got 0"),
        ({"tol": float("nan")}, "tol must be a number"),
    ],
)
def test_driver_refuses_arguments_out_of_range(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spherical_kmeans(_backend(), **{"k": 4, **arguments})


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.ones(10), r"one value a point, shape \(3000,\)"),
        (np.full(3000, -1.0), "finite, >= 0, and not all 0"),
        (np.zeros(3000), "finite, >= 0, and not all 0"),
        (np.full(3000, np.nan), "finite, >= 0, and not all 0"),
    ],
)
def test_driver_refuses_unusable_weights(weights: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _backend(weights)


def test_negative_tol_runs_every_iteration() -> None:
    assert spherical_kmeans(_backend(), 5, max_iter=7, tol=-1.0).n_iter == 7


def test_the_first_initialisation_starts_from_the_first_child_seed() -> None:
    rng = np.random.default_rng(np.random.SeedSequence(9).spawn(1)[0])
    start = kmeans_plus_plus(_backend(), 12, rng)
    first = spherical_kmeans(_backend(), 12, seed=9, max_iter=1, tol=-1.0)
    # One iteration from the same start, by hand: the first result's centroids.
    backend = _backend()
    moved, _ = backend.update(start, backend.cluster_sums(start))
    lat, lon = unit_vectors_to_latlon(moved)
    np.testing.assert_array_equal(first.centroid_lat, lat)
    np.testing.assert_array_equal(first.centroid_lon, lon)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    try:
        return create_engine(request.param)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))


def _step_of(engine_name: str) -> str:
    # cuML runs every iteration of an initialisation inside its own fit.
    return "initialisation" if engine_name == "cuml" else "iteration"


def test_a_stop_ends_the_run_before_its_next_step(engine: Engine) -> None:
    index = engine.build_index(*POINTS)
    step = _step_of(engine.name)
    with counting(step) as steps:
        with stopping_when(lambda: steps.count >= 3), pytest.raises(KMeansStopped):
            index.kmeans(16, n_init=50, max_iter=10_000, tol=-1.0)
        assert steps.count == 3
        assert steps.stopped.is_set()


def test_a_stop_before_the_start_runs_nothing(engine: Engine) -> None:
    index = engine.build_index(*POINTS)
    with counting(_step_of(engine.name)) as steps:
        with stopping_when(lambda: True), pytest.raises(KMeansStopped):
            index.kmeans(16, max_iter=10_000)
        assert steps.count == 0


def test_a_stop_reaches_the_seeding() -> None:
    checks = 0

    def stop_at_the_second_check() -> bool:
        nonlocal checks
        checks += 1
        return checks > 1  # asked every 16 draws: after 16 (go on), after 32 (stop)

    with pytest.raises(KMeansStopped):
        kmeans_plus_plus(_backend(), 2000, np.random.default_rng(0), stop_at_the_second_check)
    assert checks == 2


# -- through a server -----------------------------------------------------------------------
@dataclass
class Served:
    name: str
    server: RunningServer
    stub: pb_grpc.GeoNearStub


@pytest.fixture(scope="module", params=SERVED_ENGINES)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    name, settings = request.param
    if name.startswith("dask"):
        pytest.importorskip("distributed")
    try:
        # One call at a time: the next call is admitted only once the last has let go.
        server = start_server(None, limits=Limits(max_concurrent_rpcs=1), **settings)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    lat, lon = uniform_points(50_000, seed=3)
    table = pa.table({"id": np.arange(lat.shape[0]), "lat": lat, "lon": lon})
    channel = grpc.insecure_channel(server.target)
    try:
        with Client(server.target, timeout_s=HANG_GUARD_S) as client:
            client.upload("points", table)
        served = Served(name, server, pb_grpc.GeoNearStub(channel))
        # One-off costs (CuPy compiling its kernels, cuML's first fit) come before any
        # deadline does.
        _next_call_is_served(served)
        yield served
    finally:
        channel.close()
        server.stop()


def _long_kmeans(served: Served, timeout_s: float) -> Any:
    request = pb.KMeansRequest(dataset="points", seed=1, **LONG)
    return served.stub.KMeans(request, timeout=timeout_s)


def _next_call_is_served(served: Served) -> None:
    """A small k-means succeeds. Until the stopped call has let go of the one slot it is
    refused with RESOURCE_EXHAUSTED, retried as the refusal says."""
    request = pb.KMeansRequest(dataset="points", k=3, max_iter=2)
    give_up = time.monotonic() + HANG_GUARD_S
    while True:
        try:
            (summary,) = [m.summary for m in served.stub.KMeans(request, timeout=HANG_GUARD_S)]
            assert summary.n_iter >= 1
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > give_up:
                raise
            time.sleep(0.02)


def _hold_at(served: Served) -> int:
    return 1 if served.name == "cuml" else 2


def test_cancelled_kmeans_stops_within_an_iteration(served: Served) -> None:
    with counting(_step_of(served.name), hold_at=_hold_at(served)) as steps:
        call = _long_kmeans(served, timeout_s=HANG_GUARD_S)
        assert steps.held.wait(HANG_GUARD_S), "the k-means never reached the step it is held at"
        call.cancel()
        with pytest.raises(grpc.RpcError) as raised:
            next(call)
        assert raised.value.code() == grpc.StatusCode.CANCELLED
        assert steps.stopped.wait(HANG_GUARD_S), "the server's k-means did not stop"
        assert steps.stop_reached_held_thread
        assert steps.count == _hold_at(served)  # not one step more
    _next_call_is_served(served)


def test_kmeans_past_its_deadline_stops_within_an_iteration(served: Served) -> None:
    with counting(_step_of(served.name), hold_at=_hold_at(served)) as steps:
        # Long enough to reach the held step first (it is held until the deadline).
        call = _long_kmeans(served, timeout_s=3.0)
        with pytest.raises(grpc.RpcError) as raised:
            next(call)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert steps.stopped.wait(HANG_GUARD_S), "the server's k-means did not stop"
        assert steps.held.is_set(), "the deadline passed before the k-means reached its step"
        assert steps.stop_reached_held_thread
        assert steps.count == _hold_at(served)
    _next_call_is_served(served)
