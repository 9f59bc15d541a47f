"""Spherical geometry: great-circle distances, unit vectors and chords."""

from __future__ import annotations

import math

import numpy as np
import pytest

from geonear.geometry import (
    EARTH_RADIUS_M,
    angle_between,
    chord_for_distance,
    chord_to_distance_m,
    great_circle_m,
    unit_vectors,
    unit_vectors_to_latlon,
)
from geonear.loaders.synthetic import uniform_points

R = EARTH_RADIUS_M


def haversine_m(lat1, lon1, lat2, lon2, radius_m=R):
    p1, p2 = np.radians(lat1), np.radians(lat2)
    dp, dl = p2 - p1, np.radians(np.asarray(lon2) - np.asarray(lon1))
    a = np.sin(dp / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    return 2 * radius_m * np.arcsin(np.sqrt(a))


def test_default_radius_is_the_iugg_mean_radius() -> None:
    assert EARTH_RADIUS_M == 6_371_008.8


@pytest.mark.parametrize(
    ("a", "b"),
    [((0.0, 0.0), (90.0, 0.0)), ((0.0, 17.0), (-90.0, 123.0)), ((0.0, 0.0), (0.0, 90.0))],
)
def test_quarter_circle_is_half_pi_r(a, b) -> None:
    assert great_circle_m(*a, *b) == pytest.approx(math.pi / 2 * R, abs=1e-6)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((90.0, 0.0), (-90.0, 0.0)),
        ((0.0, 0.0), (0.0, 180.0)),
        ((0.0, 180.0), (0.0, 0.0)),
        ((37.5, -122.25), (-37.5, 57.75)),
        ((-12.0, -179.5), (12.0, 0.5)),
    ],
)
def test_antipodes_are_pi_r(a, b) -> None:
    assert great_circle_m(*a, *b) == pytest.approx(math.pi * R, abs=1e-6)


def test_near_antipodes_keep_their_precision() -> None:
    # 1 m short of the antipode along the equator: haversine's arcsin flattens out here.
    one_metre_deg = math.degrees(1.0 / R)
    d = great_circle_m(0.0, 0.0, 0.0, 180.0 - one_metre_deg)
    assert d == pytest.approx(math.pi * R - 1.0, abs=1e-6)


def test_same_point_is_zero_and_distance_is_symmetric() -> None:
    lat, lon = uniform_points(500, seed=1)
    np.testing.assert_array_equal(great_circle_m(lat, lon, lat, lon), 0.0)
    lat2, lon2 = uniform_points(500, seed=2)
    np.testing.assert_allclose(
        great_circle_m(lat, lon, lat2, lon2), great_circle_m(lat2, lon2, lat, lon), atol=1e-6
    )


@pytest.mark.parametrize("separation_m", [1e-3, 0.1, 1.0, 100.0, 10_000.0])
def test_small_separations_agree_with_haversine(separation_m: float) -> None:
    lat, lon = uniform_points(200, seed=3)
    lat = np.clip(lat, -80, 80)
    bearing = np.random.default_rng(4).uniform(0, 2 * math.pi, lat.shape[0])
    step = math.degrees(separation_m / R)
    lat2 = lat + step * np.cos(bearing)
    lon2 = lon + step * np.sin(bearing) / np.cos(np.radians(lat))
    d = great_circle_m(lat, lon, lat2, lon2)
    np.testing.assert_allclose(d, haversine_m(lat, lon, lat2, lon2), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(d, separation_m, rtol=5e-3)  # flat offsets: roughly


def test_known_city_pair() -> None:
    # Paris - New York on the 6 371 008.8 m sphere, cross-checked with haversine
    d = great_circle_m(48.8566, 2.3522, 40.7128, -74.0060)
    assert d == pytest.approx(haversine_m(48.8566, 2.3522, 40.7128, -74.0060), abs=1e-6)
    assert d == pytest.approx(5_837_000, abs=2_000)


def test_radius_scales_distances() -> None:
    assert great_circle_m(0.0, 0.0, 0.0, 90.0, earth_radius_m=1.0) == pytest.approx(math.pi / 2)


def test_antimeridian_is_crossed_the_short_way() -> None:
    assert great_circle_m(0.0, 179.9, 0.0, -179.9) == pytest.approx(R * math.radians(0.2))
    assert great_circle_m(0.0, 180.0, 0.0, -180.0) == pytest.approx(0.0, abs=1e-6)


def test_broadcasting_gives_a_matrix() -> None:
    lat, lon = uniform_points(7, seed=5)
    lat2, lon2 = uniform_points(3, seed=6)
    m = great_circle_m(lat[:, None], lon[:, None], lat2[None, :], lon2[None, :])
    assert m.shape == (7, 3)
    assert m[4, 2] == great_circle_m(lat[4], lon[4], lat2[2], lon2[2])


def test_unit_vectors_are_unit_and_round_trip() -> None:
    lat, lon = uniform_points(1000, seed=7)
    lat = np.concatenate([lat, [90.0, -90.0, 0.0, 0.0, 45.0]])
    lon = np.concatenate([lon, [0.0, 0.0, 180.0, -179.999, -90.0]])
    xyz = unit_vectors(lat, lon)
    assert xyz.shape == (lat.shape[0], 3) and xyz.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(xyz, axis=1), 1.0, atol=1e-15)
    back_lat, back_lon = unit_vectors_to_latlon(xyz)
    np.testing.assert_allclose(back_lat, lat, atol=1e-12)
    # longitude is undefined at the poles and 180 == -180: compare positions instead
    np.testing.assert_allclose(great_circle_m(back_lat, back_lon, lat, lon), 0.0, atol=1e-6)
    np.testing.assert_allclose(back_lon[:1000], lon[:1000], atol=1e-9)


def test_unit_vectors_of_known_points() -> None:
    xyz = unit_vectors([0.0, 0.0, 90.0, -90.0], [0.0, 90.0, 0.0, 0.0])
    np.testing.assert_allclose(xyz, [[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, -1]], atol=1e-15)
    assert unit_vectors([10.0], [20.0], dtype=np.float32).dtype == np.float32


def test_unit_vectors_to_latlon_takes_unnormalised_vectors() -> None:
    lat, lon = unit_vectors_to_latlon(np.array([[0.0, 5.0, 5.0], [-3.0, 0.0, 0.0]]))
    np.testing.assert_allclose(lat, [45.0, 0.0])
    np.testing.assert_allclose(lon, [90.0, 180.0])


def test_angle_between_matches_great_circle() -> None:
    lat, lon = uniform_points(300, seed=8)
    lat2, lon2 = uniform_points(300, seed=9)
    angle = angle_between(unit_vectors(lat, lon), unit_vectors(lat2, lon2))
    np.testing.assert_allclose(R * angle, great_circle_m(lat, lon, lat2, lon2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("distance_m", [0.0, 1.0, 1234.5, 1e6, 1e7, math.pi * R * 0.999])
def test_chord_conversions_round_trip(distance_m: float) -> None:
    chord = chord_for_distance(distance_m, R)
    assert chord == pytest.approx(2 * math.sin(distance_m / R / 2), abs=1e-15)
    assert float(chord_to_distance_m(chord, R)) == pytest.approx(distance_m, abs=1e-6)


def test_chord_matches_the_distance_between_unit_vectors() -> None:
    a, b = unit_vectors([10.0, 0.0], [20.0, 0.0]), unit_vectors([-30.0, 0.0], [45.0, 180.0])
    chords = np.linalg.norm(a - b, axis=1)
    d = great_circle_m(np.array([10.0, 0.0]), [20.0, 0.0], [-30.0, 0.0], [45.0, 180.0])
    np.testing.assert_allclose(chord_to_distance_m(chords, R), d, rtol=1e-12)
    for c, dist in zip(chords, d, strict=True):
        assert chord_for_distance(float(dist), R) == pytest.approx(c, rel=1e-12)


def test_chord_for_half_a_circumference_or_more_is_the_diameter() -> None:
    assert chord_for_distance(math.pi * R, R) == 2.0
    assert chord_for_distance(10 * math.pi * R, R) == 2.0
    # chords beyond the diameter (rounding) clip to half a circumference
    assert float(chord_to_distance_m(np.array(2.0000001), R)) == pytest.approx(math.pi * R)


def test_chord_order_is_great_circle_order() -> None:
    q = unit_vectors([12.0], [34.0])
    lat, lon = uniform_points(2000, seed=10)
    chords = np.linalg.norm(unit_vectors(lat, lon) - q, axis=1)
    d = great_circle_m(12.0, 34.0, lat, lon)
    np.testing.assert_array_equal(np.argsort(chords), np.argsort(d))


def _matrix_angle(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The GPU float64 matrix kernel's angle, in NumPy: the chord form with its polynomial."""
    from geonear.service.engines.gpu_kernels import CHORD_ANGLE_POLYNOMIAL

    dot = np.sum(a * b, axis=-1)
    near = dot >= 0.0
    d = np.where(near[..., None], a - b, a + b)
    u = np.sum(d * d, axis=-1)
    angle = np.sqrt(u) * np.polynomial.polynomial.polyval(u - 1.0, CHORD_ANGLE_POLYNOMIAL)
    return np.where(near, angle, np.pi - angle)


def test_the_gpu_matrix_polynomial_is_asin_to_a_few_ulps() -> None:
    from geonear.service.engines.gpu_kernels import CHORD_ANGLE_POLYNOMIAL

    u = np.linspace(0.0, 2.0, 1_000_001)
    got = np.sqrt(u) * np.polynomial.polynomial.polyval(u - 1.0, CHORD_ANGLE_POLYNOMIAL)
    np.testing.assert_allclose(got, 2 * np.arcsin(np.sqrt(u) / 2), rtol=0, atol=2e-15)


def test_the_gpu_matrix_angle_is_within_a_micrometre_of_the_reference() -> None:
    lat, lon = uniform_points(200_000, seed=12)
    a, b = unit_vectors(lat[:100_000], lon[:100_000]), unit_vectors(lat[100_000:], lon[100_000:])
    pairs = {
        "random": (a, b),
        "same point": (a, a),
        "antipodes": (a, -a),
        "a metre apart": (a, unit_vectors(lat[:100_000] + 9e-6, lon[:100_000])),
    }
    for name, (p, q) in pairs.items():
        expected = angle_between(p, q)
        np.testing.assert_allclose(_matrix_angle(p, q), expected, rtol=0, atol=1e-13, err_msg=name)
    assert np.all(_matrix_angle(a, a) == 0.0)
