"""Soak: a real server under concurrent mixed queries and changes, for a bounded time.

``geonear serve`` runs as a separate process for ``GEONEAR_SOAK_S`` seconds (default 90)
while query threads send KNN (compact and streamed), radius, distance-matrix, k-means
and info calls, and writer threads create, append to, replace, delete from and drop
their own datasets. Two datasets are never changed; the queries also hit the changing
ones, so NOT_FOUND for one that was just dropped is the only error expected. Every other
error, and every answer of the wrong size, counts as unexpected, and there must be none.

Memory: the server's resident set (VmRSS) is sampled four times a second. It grows in
the first third of the run (allocator arenas, caches, the datasets themselves) and must
then stop growing: over the last two thirds, the least-squares slope of RSS against
requests served must stay below ``LEAK_BYTES_PER_REQUEST``. A leak of 1 KiB per request
would show as a slope of 1024 bytes per request or more, a leak per change (a dataset
version never freed) as far more; allocator fragmentation on this workload measures
about 100-250 bytes per request, settling slowly. The growth of each third (lowest
sample to lowest sample) is printed beside it.

Run with ``pytest -s tests/test_soak.py`` to see the figures.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from server_process import resident_bytes, start_server

from geonear.clients.client import Client
from geonear.clients.errors import GeoNearError
from geonear.loaders.synthetic import clustered_points, uniform_points

SOAK_S = float(os.environ.get("GEONEAR_SOAK_S", "90"))
QUERY_THREADS = 4
WRITER_THREADS = 2
DATASETS_PER_WRITER = 2
SAMPLE_S = 0.25
#: Most resident growth per request served after the first third (see the docstring).
LEAK_BYTES_PER_REQUEST = 512
#: Writers keep their datasets between these sizes, so the data itself stops growing.
MIN_ROWS, MAX_ROWS = 500, 6000
STABLE = {"stable-ints": 20_000, "stable-strings": 4_000}
CHURN = [f"churn-{w}-{j}" for w in range(WRITER_THREADS) for j in range(DATASETS_PER_WRITER)]
#: Share of each kind of query: mostly the small calls that make up real traffic.
QUERY_MIX = {
    "knn": 0.35,
    "info": 0.2,
    "radius": 0.15,
    "knn-columns": 0.1,
    "matrix": 0.1,
    "kmeans": 0.1,
}

pytestmark = pytest.mark.slow


# -- bookkeeping ---------------------------------------------------------------------------
@dataclass
class Tally:
    """Calls answered, expected errors by code and unexpected ones, from every thread."""

    ok: collections.Counter[str] = field(default_factory=collections.Counter)
    expected: collections.Counter[str] = field(default_factory=collections.Counter)
    unexpected: collections.Counter[str] = field(default_factory=collections.Counter)
    examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def requests(self) -> int:
        return sum(self.ok.values()) + sum(self.expected.values()) + sum(self.unexpected.values())

    def record(self, rpc: str, dataset: str, exc: BaseException | None) -> None:
        with self.lock:
            if exc is None:
                self.ok[rpc] += 1
            elif isinstance(exc, GeoNearError) and _expected(exc, dataset):
                self.expected[f"{rpc} {exc.code.name}"] += 1
            else:
                kind = exc.code.name if isinstance(exc, GeoNearError) else type(exc).__name__
                self.unexpected[f"{rpc} {kind}"] += 1
                if len(self.examples) < 10:
                    self.examples.append(f"{rpc} on {dataset}: {exc!r}")


def _expected(exc: GeoNearError, dataset: str) -> bool:
    """A query may find a changing dataset dropped; nothing else is expected."""
    return exc.code.name == "NOT_FOUND" and dataset in CHURN


def _call(tally: Tally, rpc: str, dataset: str, fn) -> object:
    try:
        result = fn()
    except Exception as exc:
        tally.record(rpc, dataset, exc)
        return None
    tally.record(rpc, dataset, None)
    return result


@dataclass
class Sample:
    t: float
    rss_bytes: int
    requests: int


# -- the server process ------------------------------------------------------------------
def _start_server(data_dir: Path, workdir: Path) -> tuple[subprocess.Popen, str]:
    args = ["-m", "geonear", "serve", "--port", "0", "--data-dir", str(data_dir)]
    return start_server([*args, "--backend", "cpu"], workdir / "server.log", workdir)


# -- the clients ---------------------------------------------------------------------------
def _points(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.uniform(-80.0, 80.0, n), rng.uniform(-179.0, 179.0, n)


def _query_once(client: Client, rng: np.random.Generator, tally: Tally) -> None:
    name = str(rng.choice([*STABLE, *CHURN]))
    kind = rng.choice(list(QUERY_MIX), p=list(QUERY_MIX.values()))
    n = int(rng.integers(1, 40))
    lat, lon = _points(rng, n)
    if kind == "knn":
        k = int(rng.integers(1, 20))
        found = _call(tally, "Knn", name, lambda: client.knn(name, lat, lon, k, as_arrow=True))
        if found is not None and name in STABLE:
            _check(tally, "Knn", name, found.num_rows == n * k, f"{found.num_rows} != {n}x{k}")
    elif kind == "knn-columns":
        # Attribute columns make the client stream the answer (Knn, not KnnCompact).
        column = "population" if name in STABLE else "weight"
        found = _call(
            tally,
            "KnnStream",
            name,
            lambda: client.knn(name, lat, lon, 3, columns=[column], as_arrow=True),
        )
        if found is not None:
            _check(tally, "KnnStream", name, column in found.column_names, "column missing")
    elif kind == "radius":
        radius_m = float(rng.uniform(1e4, 5e5))
        _call(tally, "Radius", name, lambda: client.radius(name, lat, lon, radius_m, as_arrow=True))
    elif kind == "matrix":
        if rng.random() < 0.5:
            lat2, lon2 = _points(rng, int(rng.integers(1, 500)))
            values = _call(
                tally,
                "DistanceMatrix",
                "",
                lambda: client.distance_matrix(lat, lon, None, lat2, lon2),
            )
            if values is not None:
                _check(tally, "DistanceMatrix", "", values.shape == (n, lat2.shape[0]), "shape")
        elif name != "stable-ints":  # its 20 000 columns would make most calls matrices
            rows = slice(0, 10)
            _call(
                tally,
                "DistanceMatrix",
                name,
                lambda: client.distance_matrix(lat[rows], lon[rows], name),
            )
    elif kind == "kmeans":
        k = int(rng.integers(2, 8))
        labels = bool(rng.random() < 0.2)
        outcome = _call(
            tally,
            "KMeans",
            name,
            lambda: client.kmeans(name, k, seed=int(rng.integers(1000)), max_iter=10,
                                  return_labels=labels),
        )  # fmt: skip
        if outcome is not None:
            _check(tally, "KMeans", name, len(outcome.centroids) == k, "centroid count")
    else:
        which = rng.integers(3)
        if which == 0:
            _call(tally, "ServerInfo", "", client.server_info)
        elif which == 1:
            _call(tally, "ListDatasets", "", client.datasets)
        else:
            _call(tally, "GetDataset", name, lambda: client.info(name))


def _check(tally: Tally, rpc: str, dataset: str, ok: bool, what: str) -> None:
    if not ok:
        tally.record(rpc, dataset, AssertionError(f"wrong answer: {what}"))


def _churn_table(rng: np.random.Generator, first_id: int, n: int) -> pa.Table:
    lat, lon = _points(rng, n)
    return pa.table(
        {
            "id": np.arange(first_id, first_id + n, dtype=np.int64),
            "lat": lat,
            "lon": lon,
            "weight": rng.uniform(0.0, 1.0, n),
        }
    )


def _change_once(
    client: Client, rng: np.random.Generator, tally: Tally, state: dict[str, list[int]]
) -> None:
    """One change to one of this writer's datasets; ``state`` holds each one's live ids."""
    name = str(rng.choice(list(state)))
    ids = state[name]
    next_id = (max(ids) + 1) if ids else 0
    if not ids:
        n = int(rng.integers(MIN_ROWS, MAX_ROWS // 2))
        table = _churn_table(rng, next_id, n)
        if _call(tally, "Upload create", name, lambda: client.upload(name, table)) is not None:
            state[name] = list(range(next_id, next_id + n))
        return
    action = rng.choice(["append", "replace", "delete", "drop"], p=[0.35, 0.3, 0.25, 0.1])
    if action == "append" and len(ids) < MAX_ROWS - 1500:
        n = int(rng.integers(100, 1500))
        table = _churn_table(rng, next_id, n)
        done = _call(
            tally, "Upload append", name, lambda: client.upload(name, table, mode="append")
        )
        if done is not None:
            ids.extend(range(next_id, next_id + n))
    elif action in ("append", "replace"):
        n = int(rng.integers(MIN_ROWS, MAX_ROWS // 2))
        table = _churn_table(rng, next_id, n)
        done = _call(
            tally, "Upload replace", name, lambda: client.upload(name, table, mode="replace")
        )
        if done is not None:
            state[name] = list(range(next_id, next_id + n))
    elif action == "delete" and len(ids) > 2 * MIN_ROWS:
        gone = [int(i) for i in rng.choice(ids, size=len(ids) // 10, replace=False)]
        done = _call(tally, "DeleteRows", name, lambda: client.delete(name, gone))
        if done is not None:
            dropped = set(gone)
            state[name] = [i for i in ids if i not in dropped]
    elif _call(tally, "DropDataset", name, lambda: client.drop(name)) is not None:
        state[name] = []


# -- the test ------------------------------------------------------------------------------
def test_soak_mixed_load_has_no_unexpected_errors_and_memory_stops_growing(tmp_path) -> None:
    proc, target = _start_server(tmp_path / "data", tmp_path)
    tally = Tally()
    samples: list[Sample] = []
    stop = threading.Event()
    try:
        with Client(target, timeout_s=60) as client:
            lat, lon = uniform_points(STABLE["stable-ints"], seed=11)
            population = np.random.default_rng(1).integers(0, 10**6, lat.shape[0])
            table = pa.table({"lat": lat, "lon": lon, "population": population})
            client.upload("stable-ints", table)
            lat, lon = clustered_points(STABLE["stable-strings"], seed=12)
            ids = [f"s{i}" for i in range(lat.shape[0])]
            client.upload(
                "stable-strings",
                pa.table({"id": ids, "lat": lat, "lon": lon, "population": np.ones(lat.shape[0])}),
            )
        rss_before = resident_bytes(proc.pid)

        def query_loop(seed: int) -> None:
            rng = np.random.default_rng(seed)
            with Client(target, timeout_s=60) as client:
                while not stop.is_set():
                    _query_once(client, rng, tally)

        def writer_loop(w: int) -> None:
            rng = np.random.default_rng(1000 + w)
            state: dict[str, list[int]] = {f"churn-{w}-{j}": [] for j in range(DATASETS_PER_WRITER)}
            with Client(target, timeout_s=60) as client:
                while not stop.is_set():
                    _change_once(client, rng, tally, state)

        threads = [
            threading.Thread(target=query_loop, args=(q,), name=f"soak-query-{q}")
            for q in range(QUERY_THREADS)
        ] + [
            threading.Thread(target=writer_loop, args=(w,), name=f"soak-writer-{w}")
            for w in range(WRITER_THREADS)
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        while time.monotonic() - start < SOAK_S:
            assert proc.poll() is None, "the server exited during the soak"
            samples.append(
                Sample(time.monotonic() - start, resident_bytes(proc.pid), tally.requests)
            )
            time.sleep(SAMPLE_S)
        stop.set()
        for thread in threads:
            thread.join(120)
        rss_after = resident_bytes(proc.pid)
        with Client(target, timeout_s=60) as client:
            rows = {d.name: d.rows for d in client.datasets() if d.name in STABLE}
        assert rows == STABLE
    finally:
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0

    thirds = _thirds(samples)
    growth_first = thirds[1].floor - rss_before
    growth_last = thirds[2].floor - thirds[1].floor
    settled = [s for s in samples if s.t >= samples[-1].t / 3]
    slope, _ = np.polyfit([s.requests for s in settled], [s.rss_bytes for s in settled], 1)
    mib = 2**20
    print(
        f"\nsoak: {SOAK_S:.0f} s, {QUERY_THREADS} query and {WRITER_THREADS} writer threads\n"
        f"  requests served: {tally.requests} ({tally.requests / SOAK_S:.0f}/s)\n"
        f"  answered: {dict(sorted(tally.ok.items()))}\n"
        f"  expected errors: {dict(sorted(tally.expected.items()))}\n"
        f"  unexpected errors: {dict(sorted(tally.unexpected.items()))}\n"
        f"  server RSS: before {rss_before / mib:.1f} MiB, after {rss_after / mib:.1f} MiB; "
        f"lowest by third {', '.join(f'{t.floor / mib:.1f}' for t in thirds)} MiB, "
        f"highest {', '.join(f'{t.peak / mib:.1f}' for t in thirds)} MiB\n"
        f"  lowest by tenth: {' '.join(f'{f / mib:.1f}' for f in _floors(samples, 10))} MiB\n"
        f"  growth: first third {growth_first / mib:+.1f} MiB over {thirds[0].requests} "
        f"requests, last third {growth_last / mib:+.1f} MiB over {thirds[2].requests}; "
        f"slope after the first third {slope:+.0f} B/request "
        f"(limit {LEAK_BYTES_PER_REQUEST})"
    )
    assert not tally.unexpected, tally.examples
    assert set(code.split()[-1] for code in tally.expected) <= {"NOT_FOUND"}
    # Every kind of call was made and answered, changes included.
    kinds = ["Knn", "KnnStream", "Radius", "DistanceMatrix", "KMeans", "GetDataset"]
    kinds += ["Upload create", "Upload append", "Upload replace", "DeleteRows", "DropDataset"]
    for rpc in kinds:
        assert tally.ok[rpc] > 0, rpc
    assert thirds[2].requests > 0
    assert slope < LEAK_BYTES_PER_REQUEST, (
        f"resident memory still growing after the first third: {slope:.0f} bytes per request"
    )


@dataclass(frozen=True)
class Third:
    """RSS of a third of the run: lowest (at rest) and highest sample; requests served."""

    floor: int
    peak: int
    requests: int


def _thirds(samples: list[Sample]) -> list[Third]:
    """Lowest and highest RSS and requests served in each third of the run, by time."""
    assert len(samples) >= 6, "too few memory samples; raise GEONEAR_SOAK_S"
    end = samples[-1].t
    out = []
    served_before = samples[0].requests
    for i in range(3):
        part = [s for s in samples if i * end / 3 <= s.t <= (i + 1) * end / 3]
        rss = [s.rss_bytes for s in part]
        out.append(Third(min(rss), max(rss), part[-1].requests - served_before))
        served_before = part[-1].requests
    return out


def _floors(samples: list[Sample], parts: int) -> list[int]:
    """Lowest RSS in each of ``parts`` equal spans of the run."""
    end = samples[-1].t
    return [
        min(s.rss_bytes for s in samples if i * end / parts <= s.t <= (i + 1) * end / parts)
        for i in range(parts)
    ]
