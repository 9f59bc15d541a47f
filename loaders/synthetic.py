"""Seeded synthetic point sets: uniform on the sphere, or clustered like real data.

``uniform_points`` and ``clustered_points`` return whole arrays. ``generate_points``
streams any number of points in chunks of ``CHUNK_ROWS`` (each drawn from its own
generator seeded by ``(seed, chunk)``, so memory stays bounded and the same ``n`` and
``seed`` always give the same points), and ``write_points`` writes them to a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from geonear.geometry import EARTH_RADIUS_M, unit_vectors, unit_vectors_to_latlon
from geonear.loaders.writers import write_batches

#: Rows drawn per chunk by the streaming generators (fixes their output for a seed).
CHUNK_ROWS = 1 << 20
SCHEMA = pa.schema([("id", pa.int64()), ("lat", pa.float64()), ("lon", pa.float64())])


def _uniform(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    # Uniform in z (= sin lat) is uniform in area on the sphere.
    z = rng.uniform(-1.0, 1.0, n)
    lon = rng.uniform(-180.0, 180.0, n)
    return np.degrees(np.arcsin(z)), lon


def uniform_points(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n points uniform on the sphere: (lat, lon) float64 degrees."""
    return _uniform(np.random.default_rng(seed), n)


def clustered_points(
    n: int, seed: int = 0, n_clusters: int = 200, spread_m: float = 50_000.0
) -> tuple[np.ndarray, np.ndarray]:
    """n points in Gaussian clusters of very unequal sizes, like cities or stores.

    Cluster centres are uniform on the sphere; cluster weights follow a Zipf-like law;
    each point is its centre plus an isotropic normal offset of ``spread_m`` metres
    (scaled per cluster between 0.1x and 3x), projected back onto the sphere.
    """
    rng = np.random.default_rng(seed)
    c_lat, c_lon = uniform_points(n_clusters, seed=seed + 1)
    centres = unit_vectors(c_lat, c_lon)
    weights = 1.0 / np.arange(1, n_clusters + 1) ** 1.1
    member = rng.choice(n_clusters, size=n, p=weights / weights.sum())
    scale = rng.uniform(0.1, 3.0, n_clusters)[member] * spread_m / EARTH_RADIUS_M
    xyz = centres[member] + rng.normal(size=(n, 3)) * scale[:, None]
    return unit_vectors_to_latlon(xyz)


@dataclass(frozen=True)
class _Clusters:
    """Centres (unit vectors), membership probabilities and spreads (radians) of clusters."""

    centres: np.ndarray
    probability: np.ndarray
    spread_rad: np.ndarray

    @classmethod
    def draw(cls, seed: int, n_clusters: int, spread_m: float) -> _Clusters:
        rng = np.random.default_rng([seed, 1 << 32])
        weights = 1.0 / np.arange(1, n_clusters + 1) ** 1.1
        return cls(
            unit_vectors(*_uniform(rng, n_clusters)),
            weights / weights.sum(),
            rng.uniform(0.1, 3.0, n_clusters) * spread_m / EARTH_RADIUS_M,
        )

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        member = rng.choice(self.centres.shape[0], size=n, p=self.probability)
        offsets = rng.normal(size=(n, 3)) * self.spread_rad[member][:, None]
        return unit_vectors_to_latlon(self.centres[member] + offsets)


def generate_points(
    n: int,
    *,
    clustered: bool = False,
    seed: int = 0,
    n_clusters: int = 200,
    spread_m: float = 50_000.0,
) -> pa.RecordBatchReader:
    """``n`` synthetic points as batches of id (0..n-1), lat, lon (degrees).

    Uniform on the sphere, or (``clustered``) in ``n_clusters`` Gaussian clusters of
    Zipf-like sizes and spreads around ``spread_m`` metres, as :func:`clustered_points`.
    """
    if n < 0:
        raise ValueError(f"n must be at least 0, got {n}")
    if n_clusters < 1:
        raise ValueError(f"n_clusters must be at least 1, got {n_clusters}")
    clusters = _Clusters.draw(seed, n_clusters, spread_m) if clustered else None

    def batches() -> Iterator[pa.RecordBatch]:
        for chunk, start in enumerate(range(0, n, CHUNK_ROWS)):
            m = min(CHUNK_ROWS, n - start)
            rng = np.random.default_rng([seed, chunk])
            lat, lon = clusters.sample(rng, m) if clusters else _uniform(rng, m)
            ids = np.arange(start, start + m, dtype=np.int64)
            yield pa.RecordBatch.from_arrays(
                [pa.array(ids), pa.array(lat), pa.array(lon)], schema=SCHEMA
            )

    return pa.RecordBatchReader.from_batches(SCHEMA, batches())


def write_points(
    path: str | os.PathLike[str],
    n: int,
    *,
    clustered: bool = False,
    seed: int = 0,
    n_clusters: int = 200,
    spread_m: float = 50_000.0,
    format: str | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> int:
    """Write :func:`generate_points` to ``path`` (Parquet, CSV or Arrow by extension).

    One chunk at a time is in memory; ``on_batch(rows)`` follows each. Returns ``n``.
    """
    reader = generate_points(
        n, clustered=clustered, seed=seed, n_clusters=n_clusters, spread_m=spread_m
    )

    def batches() -> Iterator[pa.RecordBatch]:
        for batch in reader:
            yield batch
            if on_batch is not None:
                on_batch(batch.num_rows)

    return write_batches(path, SCHEMA, batches(), format)
