"""Seeded synthetic point sets: uniform on the sphere, or clustered like real data."""

from __future__ import annotations

import numpy as np

from geonear.service.geometry import unit_vectors_to_latlon


def uniform_points(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n points uniform on the sphere: (lat, lon) float64 degrees."""
    rng = np.random.default_rng(seed)
    z = rng.uniform(-1.0, 1.0, n)
    lon = rng.uniform(-180.0, 180.0, n)
    return np.degrees(np.arcsin(z)), lon


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
    lat_r, lon_r = np.radians(c_lat), np.radians(c_lon)
    centres = np.column_stack(
        [np.cos(lat_r) * np.cos(lon_r), np.cos(lat_r) * np.sin(lon_r), np.sin(lat_r)]
    )
    weights = 1.0 / np.arange(1, n_clusters + 1) ** 1.1
    member = rng.choice(n_clusters, size=n, p=weights / weights.sum())
    scale = rng.uniform(0.1, 3.0, n_clusters)[member] * spread_m / 6_371_008.8
    xyz = centres[member] + rng.normal(size=(n, 3)) * scale[:, None]
    return unit_vectors_to_latlon(xyz)
