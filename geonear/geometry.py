"""Spherical geometry shared by every engine.

Functions take their array namespace ``xp`` (``numpy`` or ``cupy``) as a value so that
the CPU and GPU engines run the same code. Coordinates are degrees, latitude first;
distances are great-circle metres on a sphere of radius ``earth_radius_m``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: IUGG mean earth radius, metres: the default sphere of every distance.
EARTH_RADIUS_M = 6_371_008.8


def unit_vectors(lat_deg: Any, lon_deg: Any, xp: Any = np, dtype: Any = None) -> Any:
    """Unit vectors on the sphere, shape (n, 3), of points given in degrees.

    Ranking by chord length between these vectors gives the same order as ranking by
    great-circle distance, so engines may search in this space.
    """
    lat = xp.radians(xp.asarray(lat_deg, dtype=xp.float64))
    lon = xp.radians(xp.asarray(lon_deg, dtype=xp.float64))
    cos_lat = xp.cos(lat)
    out = xp.empty((lat.shape[0], 3), dtype=xp.float64)
    out[:, 0] = cos_lat * xp.cos(lon)
    out[:, 1] = cos_lat * xp.sin(lon)
    out[:, 2] = xp.sin(lat)
    return out if dtype is None else out.astype(dtype)


def unit_vectors_to_latlon(xyz: Any, xp: Any = np) -> tuple[Any, Any]:
    """Latitude and longitude in degrees of (not necessarily unit) vectors, shape (n, 3)."""
    x, y, z = xyz[:, 0], xyz[:, 1], xyz[:, 2]
    lat = xp.degrees(xp.arctan2(z, xp.sqrt(x * x + y * y)))
    lon = xp.degrees(xp.arctan2(y, x))
    return lat, lon


def angle_between(a: Any, b: Any, xp: Any = np) -> Any:
    """Central angle in radians between unit vectors ``a`` and ``b`` (broadcasting, (..., 3)).

    The atan2 form ``atan2(|a x b|, a . b)`` is accurate at every separation, antipodes
    included, where the haversine formula loses precision.
    """
    cx = a[..., 1] * b[..., 2] - a[..., 2] * b[..., 1]
    cy = a[..., 2] * b[..., 0] - a[..., 0] * b[..., 2]
    cz = a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]
    dot = a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]
    return xp.arctan2(xp.sqrt(cx * cx + cy * cy + cz * cz), dot)


def great_circle_m(
    lat1: Any,
    lon1: Any,
    lat2: Any,
    lon2: Any,
    earth_radius_m: float = EARTH_RADIUS_M,
    xp: Any = np,
) -> Any:
    """Great-circle distance in metres between points given in degrees (broadcasting).

    Uses the Vincenty (atan2) form of the central angle, exact to float64 rounding at
    every separation.
    """
    phi1 = xp.radians(xp.asarray(lat1, dtype=xp.float64))
    phi2 = xp.radians(xp.asarray(lat2, dtype=xp.float64))
    dlon = xp.radians(xp.asarray(lon2, dtype=xp.float64) - xp.asarray(lon1, dtype=xp.float64))
    sin1, cos1 = xp.sin(phi1), xp.cos(phi1)
    sin2, cos2 = xp.sin(phi2), xp.cos(phi2)
    cos_dlon = xp.cos(dlon)
    num_a = cos2 * xp.sin(dlon)
    num_b = cos1 * sin2 - sin1 * cos2 * cos_dlon
    den = sin1 * sin2 + cos1 * cos2 * cos_dlon
    return earth_radius_m * xp.arctan2(xp.sqrt(num_a * num_a + num_b * num_b), den)


def chord_for_distance(distance_m: Any, earth_radius_m: float) -> Any:
    """Chord length between unit vectors that are ``distance_m`` apart on the sphere: a
    float for a number, an array for an array (on the host).

    Distances of half the circumference or more map to 2 (the diameter).
    """
    angle = np.minimum(np.asarray(distance_m, dtype=np.float64) / earth_radius_m, np.pi)
    chord = 2.0 * np.sin(angle / 2.0)
    return float(chord) if np.ndim(chord) == 0 else chord


def chord_to_distance_m(chord: Any, earth_radius_m: float, xp: Any = np) -> Any:
    """Great-circle metres for chord lengths between unit vectors."""
    return 2.0 * earth_radius_m * xp.arcsin(xp.clip(chord / 2.0, 0.0, 1.0))
