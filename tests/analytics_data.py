"""Data and float64 reference answers for the filter, join and count tests.

Point sets carry attribute columns of every filterable kind; ids are row numbers, so a
result's ids are the rows the reference names. The reference is the ``numpy-brute``
engine (float64 brute force) run on exactly the points a filter selects, its row
numbers mapped back to the dataset's.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import (
    ENGINES,
    Neighbours,
    RadiusNeighbours,
    create_engine,
    gpu_available,
)
from geonear.service.server import build_server
from geonear.service.settings import ServerSettings

#: Poles (one point twice under two longitudes), the antimeridian from both sides and
#: exact duplicates.
EDGE_LAT = np.array([90.0, 90.0, -90.0, 0.0, 0.0, 10.0, 10.0, 10.0, 10.0, 10.0, -45.0])
EDGE_LON = np.array([0.0, 123.0, 0.0, 180.0, -180.0, 179.9999, -179.9999, 20.0, 20.0, 20.0, -179.5])
EDGE_QUERY_LAT = np.array([90.0, -90.0, 0.0, 0.0, 10.0, -10.0, 10.0])
EDGE_QUERY_LON = np.array([0.0, 45.0, 180.0, -179.99, 20.0, -170.0, -180.0])
START = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def points(kind: str, n: int = 2000, seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """``kind`` (uniform, clustered or edge) points, edge points always included."""
    if kind == "uniform":
        lat, lon = uniform_points(n, seed=seed)
    elif kind == "clustered":
        lat, lon = clustered_points(n, seed=seed, n_clusters=25, spread_m=15_000.0)
    else:
        lat, lon = uniform_points(n // 20, seed=seed)
        lat = np.concatenate([np.repeat(EDGE_LAT, 3), lat])
        lon = np.concatenate([np.repeat(EDGE_LON, 3), lon])
    return np.concatenate([lat, EDGE_LAT]), np.concatenate([lon, EDGE_LON])


def table(lat: np.ndarray, lon: np.ndarray, seed: int = 1) -> pa.Table:
    """The points with ids 0..n-1 and attribute columns of every filterable kind."""
    n = lat.shape[0]
    rows = np.arange(n)
    rng = np.random.default_rng(seed)
    maybe = pa.array(rows % 7, mask=rows % 5 == 0)  # a null every fifth row
    return pa.table(
        {
            "id": rows,
            "lat": lat,
            "lon": lon,
            "bucket": rows % 100,
            "kind": pa.array(np.array(["a", "b", "c", "d"])[rows % 4]),
            "score": rng.random(n),
            "flag": rows % 3 == 0,
            "when": pa.array(
                [START + dt.timedelta(minutes=int(r)) for r in rows], pa.timestamp("ms", tz="UTC")
            ),
            "maybe": maybe,
        }
    )


def queries(kind: str, n: int = 40, seed: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """Query points near the ``kind`` points, edge queries included."""
    if kind == "clustered":
        lat, lon = points("clustered", seed=5)
        lat, lon = np.clip(lat[:n] + 0.01, -90, 90), lon[:n]
    else:
        lat, lon = uniform_points(n, seed=seed)
    return np.concatenate([lat, EDGE_QUERY_LAT]), np.concatenate([lon, EDGE_QUERY_LON])


#: Radius per data kind, metres: a few points each around uniform queries, many in
#: clusters.
RADIUS_M = {"uniform": 700_000.0, "clustered": 25_000.0, "edge": 1_500_000.0}


# -- the reference ----------------------------------------------------------------------
#: The data kinds every join and count test runs on, their tables and their query points
#: kept as datasets of their own (the left sides).
DATA = ("uniform", "clustered", "edge")
TABLES = {kind: table(*points(kind)) for kind in DATA}
LEFT = {
    f"{kind}_q": pa.table(dict(zip(["lat", "lon"], queries(kind), strict=True))) for kind in DATA
}
#: Filters keeping every point, 1% of them, one, and none (``table`` fills ``bucket``
#: with the row number modulo 100).
FILTERS: dict[str, Any] = {
    "all": None,
    "one_percent": [("bucket", "==", 42)],
    "one": [("id", "==", 17)],
    "none": [("bucket", "<", 0)],
}


def selection_mask(t: pa.Table, kept: str) -> np.ndarray:
    """The rows of ``t`` that FILTERS[kept] selects."""
    rows = np.arange(t.num_rows)
    return {
        "all": np.ones(t.num_rows, bool),
        "one_percent": rows % 100 == 42,
        "one": rows == 17,
        "none": np.zeros(t.num_rows, bool),
    }[kept]


def reference_knn(
    lat: np.ndarray,
    lon: np.ndarray,
    mask: np.ndarray,
    q_lat: np.ndarray,
    q_lon: np.ndarray,
    k: int,
    max_distance_m: float | None = None,
) -> Neighbours:
    """The k nearest of the points ``mask`` selects, as dataset rows."""
    rows = np.flatnonzero(mask)
    if rows.shape[0] == 0:
        n = q_lat.shape[0]
        return Neighbours(np.empty((n, 0)), np.empty((n, 0), dtype=np.int64))
    found = create_engine("numpy-brute").build_index(lat[rows], lon[rows])
    got = found.knn(q_lat, q_lon, k, max_distance_m)
    return Neighbours(got.distances_m, np.where(got.indices >= 0, rows[got.indices], -1))


def reference_radius(
    lat: np.ndarray,
    lon: np.ndarray,
    mask: np.ndarray,
    q_lat: np.ndarray,
    q_lon: np.ndarray,
    radius_m: float,
) -> RadiusNeighbours:
    """The points ``mask`` selects within ``radius_m`` of each query, as dataset rows."""
    rows = np.flatnonzero(mask)
    if rows.shape[0] == 0:
        return RadiusNeighbours(
            np.zeros(q_lat.shape[0] + 1, dtype=np.int64), np.empty(0, np.int64), np.empty(0)
        )
    got = (
        create_engine("numpy-brute")
        .build_index(lat[rows], lon[rows])
        .radius(q_lat, q_lon, radius_m)
    )
    return RadiusNeighbours(got.offsets, rows[got.indices], got.distances_m)


def knn_from_rows(found: pa.Table, n_queries: int, width: int, query: str) -> Neighbours:
    """A rows-layout answer (``query`` column, rank, an int id column, distance_m) as
    (n, width) arrays padded with -1 and inf."""
    distances = np.full((n_queries, width), np.inf)
    indices = np.full((n_queries, width), -1, dtype=np.int64)
    q = found.column(query).to_numpy()
    rank = found.column("rank").to_numpy()
    id_column = "id" if "id" in found.column_names else "right_id"
    indices[q, rank] = found.column(id_column).to_numpy()
    distances[q, rank] = found.column("distance_m").to_numpy()
    return Neighbours(distances, indices)


def radius_from_rows(found: pa.Table, n_queries: int, query: str) -> RadiusNeighbours:
    q = found.column(query).to_numpy()
    assert np.all(np.diff(q) >= 0), "rows come in query order"
    counts = np.bincount(q, minlength=n_queries)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    id_column = "id" if "id" in found.column_names else "right_id"
    return RadiusNeighbours(
        offsets, found.column(id_column).to_numpy(), found.column("distance_m").to_numpy()
    )


def cpu_engine_params(with_dask: bool = True) -> list:
    """The engines the parity tests run on: the CPU engines, Dask on one local worker
    where distributed is installed, and the GPU engine (marked gpu)."""
    params = [pytest.param(name, id=name) for name in ("cpu", "sklearn", "numpy-brute")]
    if with_dask:
        params.append(pytest.param("dask", id="dask", marks=pytest.mark.slow))
    ok, why = gpu_available()
    params.append(
        pytest.param(
            "gpu",
            id="gpu",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not ok, reason=f"no usable GPU: {why}")],
        )
    )
    assert ENGINES["gpu"].device_kind == "gpu"
    return params


def engine_settings(name: str) -> dict:
    """Server settings that run engine ``name``."""
    if name == "dask":
        pytest.importorskip("distributed")
        return {"dask_local_workers": 1, "backend": "cpu"}
    if name == "gpu":
        return {"backend": "gpu"}
    return {"engine": name}


@contextlib.contextmanager
def engine_server(name: str, tables: dict[str, pa.Table]) -> Iterator[Client]:
    """A client of a server on engine ``name`` (memory only) with ``tables`` uploaded."""
    settings = ServerSettings(host="127.0.0.1", port=0, data_dir=None, **engine_settings(name))
    parts = build_server(settings)
    parts.server.start()
    try:
        with Client(f"127.0.0.1:{parts.port}", timeout_s=120) as client:
            for dataset, t in tables.items():
                client.upload(dataset, t)
            yield client
    finally:
        parts.stop(None)
