"""Boxes and spherical polygons: the vectorised masks against a reference written another
way, the boundary and orientation rules, the encodings, and refusals of bad areas.

The reference decides one point at a time, in a Python loop: a ring's small side holds a
point when the ring winds around it as around the ring's centre (the winding number from
the signed angles the edges subtend at the point, a different method from the masks'
crossing count), and a point within 1e-9 rad of an edge (its foot on the edge's circle
found by angles) is inside. Test rings are stars drawn around a known centre.

CuPy parity runs on a GPU machine (``pytest -m gpu``), skipped without a GPU.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
from analytics_data import cpu_engine_params

from geonear.loaders.synthetic import uniform_points
from geonear.service.analytics import (
    EDGE_TOLERANCE_RAD,
    MAX_VERTICES,
    Bbox,
    InvalidArea,
    SphericalPolygon,
    area_mask,
    bbox_mask,
    polygon_mask,
)
from geonear.service.engines import create_engine, gpu_available

# -- the reference --------------------------------------------------------------------


def xyz(lat: float, lon: float) -> np.ndarray:
    la, lo = math.radians(lat), math.radians(lon)
    return np.array([math.cos(la) * math.cos(lo), math.cos(la) * math.sin(lo), math.sin(la)])


def latlon(v: np.ndarray) -> tuple[float, float]:
    v = v / np.linalg.norm(v)
    return math.degrees(math.asin(max(-1.0, min(1.0, v[2])))), math.degrees(math.atan2(v[1], v[0]))


def angle(a: np.ndarray, b: np.ndarray) -> float:
    return math.atan2(float(np.linalg.norm(np.cross(a, b))), float(np.dot(a, b)))


def winding(p: np.ndarray, ring: np.ndarray) -> int:
    """Turns of the ring (k, 3) around p, from the signed angles its edges subtend."""
    t = ring - np.outer(ring @ p, p)
    t_next = np.roll(t, -1, axis=0)
    angles = np.arctan2(np.cross(t, t_next) @ p, np.einsum("ij,ij->i", t, t_next))
    return round(float(angles.sum()) / (2 * math.pi))


def distance_to_arcs(p: np.ndarray, ring: np.ndarray) -> np.ndarray:
    """Radians from p to each edge of the ring (k, 3): to the foot on the edge's circle
    where the foot's angles to the ends add up to the edge's, else to the nearer end."""
    a, b = ring, np.roll(ring, -1, axis=0)
    n = np.cross(a, b)
    n /= np.linalg.norm(n, axis=1, keepdims=True)
    foot = p - (n @ p)[:, None] * n
    foot /= np.linalg.norm(foot, axis=1, keepdims=True)

    def angles(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        return np.arctan2(np.linalg.norm(np.cross(u, v), axis=1), np.einsum("ij,ij->i", u, v))

    on_arc = np.abs(angles(a, foot) + angles(foot, b) - angles(a, b)) < 1e-12
    p = np.broadcast_to(p, a.shape)
    to_foot, to_ends = angles(p, foot), np.minimum(angles(p, a), angles(p, b))
    return np.where(on_arc, to_foot, to_ends)


@dataclass
class StarRing:
    """A ring drawn around ``centre`` (lat, lon): vertices at rising azimuths."""

    lat: np.ndarray
    lon: np.ndarray
    centre: tuple[float, float]

    @functools.cached_property
    def xyz(self) -> np.ndarray:
        return np.array([xyz(a, b) for a, b in zip(self.lat, self.lon, strict=True)])

    def reversed(self) -> StarRing:
        return StarRing(self.lat[::-1].copy(), self.lon[::-1].copy(), self.centre)

    def counter_clockwise(self) -> bool:
        return self.centre_winding == 1

    @functools.cached_property
    def centre_winding(self) -> int:
        return winding(xyz(*self.centre), self.xyz)

    def holds(self, p: np.ndarray) -> bool:
        """Whether p is on the ring's small side (around its centre)."""
        w = winding(p, self.xyz)
        return w != 0 and w == self.centre_winding

    def near(self, p: np.ndarray) -> bool:
        return bool(distance_to_arcs(p, self.xyz).min() <= EDGE_TOLERANCE_RAD)


def star(
    lat0: float,
    lon0: float,
    r_min_deg: float,
    r_max_deg: float,
    k: int,
    seed: int,
    ccw: bool = True,
) -> StarRing:
    rng = np.random.default_rng(seed)
    c = xyz(lat0, lon0)
    east = np.cross([0.0, 0.0, 1.0], c)
    east = np.array([0.0, 1.0, 0.0]) if np.linalg.norm(east) < 1e-12 else east
    east /= np.linalg.norm(east)
    north = np.cross(c, east)
    azimuth = np.sort(rng.uniform(0, 2 * math.pi, k))
    radius = np.radians(rng.uniform(r_min_deg, r_max_deg, k))
    points = [
        math.cos(r) * c + math.sin(r) * (math.cos(t) * north + math.sin(t) * east)
        for t, r in zip(azimuth, radius, strict=True)
    ]
    lat, lon = zip(*(latlon(p) for p in points), strict=True)
    ring = StarRing(np.array(lat), np.array(lon), (lat0, lon0))  # clockwise from outside
    return ring.reversed() if ccw else ring


@dataclass
class Case:
    polygons: list[tuple[StarRing, list[StarRing]]]
    oriented: bool = False
    points: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: (np.empty(0),) * 2)

    def area(self) -> SphericalPolygon:
        rings = [[(s.lat, s.lon)] + [(h.lat, h.lon) for h in holes] for s, holes in self.polygons]
        return SphericalPolygon(rings, oriented=self.oriented)

    def reference(self, lat: float, lon: float) -> bool:
        p = xyz(lat, lon)
        for shell, holes in self.polygons:
            if shell.near(p) or any(h.near(p) for h in holes):
                return True
        for shell, holes in self.polygons:
            if self.oriented:  # left of the shell; right of each hole
                ccw = shell.counter_clockwise()
                in_shell = shell.holds(p) if ccw else not shell.holds(p)
                in_hole = any(h.holds(p) == (not h.counter_clockwise()) for h in holes)
            else:
                in_shell = shell.holds(p)
                in_hole = any(h.holds(p) for h in holes)
            if in_shell and not in_hole:
                return True
        return False


def points_near(case: Case, n_each: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform points, and points scattered around each ring's centre."""
    rng = np.random.default_rng(seed)
    lat, lon = [uniform_points(n_each, seed=seed)[0]], [uniform_points(n_each, seed=seed)[1]]
    for shell, holes in case.polygons:
        for ring in [shell, *holes]:
            reach = max(angle(xyz(*ring.centre), v) for v in ring.xyz) * 1.3
            ring_case = star(*ring.centre, 0.0, math.degrees(reach), n_each, int(rng.integers(1e9)))
            lat.append(ring_case.lat)
            lon.append(ring_case.lon)
    return np.concatenate(lat), np.concatenate(lon)


def _cases() -> dict[str, Case]:
    small = star(40.0, -100.0, 2.0, 5.0, 24, seed=1)
    tiny = star(48.85, 2.35, 0.0005, 0.002, 12, seed=2)  # about 50-200 m
    wide = star(-10.0, 30.0, 30.0, 70.0, 30, seed=3)  # beyond a hemisphere's width
    antimeridian = star(-15.0, 179.0, 3.0, 8.0, 20, seed=4)
    north = star(90.0, 0.0, 5.0, 15.0, 20, seed=5)
    south = star(-88.0, 120.0, 4.0, 9.0, 20, seed=6)  # holds the south pole
    shell = star(10.0, 10.0, 8.0, 12.0, 30, seed=7)
    holes = [star(10.0, 10.0, 2.0, 4.0, 12, seed=8, ccw=False)]
    holes.append(star(10.0, 16.0, 0.5, 1.0, 8, seed=9, ccw=False))
    band_shell = star(90.0, 0.0, 20.0, 30.0, 24, seed=10)
    band_hole = [star(90.0, 0.0, 5.0, 10.0, 16, seed=11, ccw=False)]
    return {
        "small": Case([(small, [])]),
        "small-clockwise": Case([(small.reversed(), [])]),
        "tiny": Case([(tiny, [])]),
        "wide": Case([(wide, [])]),
        "antimeridian": Case([(antimeridian, [])]),
        "north-pole": Case([(north, [])]),
        "south-pole": Case([(south, [])]),
        "holes": Case([(shell, holes)]),
        "polar-band": Case([(band_shell, band_hole)]),
        "multipolygon": Case([(small, []), (antimeridian, []), (shell, holes[:1])]),
        "oriented": Case([(shell, holes)], oriented=True),
        "oriented-clockwise-shell": Case([(small.reversed(), [])], oriented=True),
        "oriented-clockwise-antimeridian": Case([(antimeridian.reversed(), [])], oriented=True),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_polygon_mask_matches_the_winding_reference(name: str) -> None:
    case = CASES[name]
    area = case.area()
    lat, lon = points_near(case, 200, seed=list(CASES).index(name))
    mask = polygon_mask(lat, lon, area)
    expected = np.array([case.reference(a, b) for a, b in zip(lat, lon, strict=True)])
    wrong = np.flatnonzero(mask != expected)
    assert wrong.size == 0, f"{wrong.size} points differ, e.g. {lat[wrong[:3]]}, {lon[wrong[:3]]}"
    assert 0 < expected.sum() < expected.size  # points both inside and out
    # Every point inside lies in the polygon's box.
    assert bbox_mask(lat[mask], lon[mask], area.bbox).all()


def test_the_tiny_polygon_is_told_apart_at_metres() -> None:
    # 50-200 m across, near Paris: points 1 m either side of an edge's middle.
    ring = CASES["tiny"].polygons[0][0]
    v = ring.xyz
    a, b = v[0], v[1]
    middle = (a + b) / np.linalg.norm(a + b)
    normal = np.cross(a, b) / np.linalg.norm(np.cross(a, b))  # to the left (inside: CCW)
    step = 1.0 / 6_371_008.8
    inside = latlon(math.cos(step) * middle + math.sin(step) * normal)
    outside = latlon(math.cos(step) * middle - math.sin(step) * normal)
    mask = polygon_mask(
        np.array([inside[0], outside[0]]), np.array([inside[1], outside[1]]), CASES["tiny"].area()
    )
    assert mask.tolist() == [True, False]


def test_points_on_edges_and_vertices_are_inside() -> None:
    shell, holes = CASES["holes"].polygons[0]
    area = CASES["holes"].area()
    points = []
    for ring in (shell, holes[0]):
        v = ring.xyz
        points.append((ring.lat[3], ring.lon[3]))  # a vertex
        points.append(latlon(v[5] + v[6]))  # the middle of an edge
    lat, lon = (np.array(c) for c in zip(*points, strict=True))
    assert polygon_mask(lat, lon, area).all()


def test_the_edge_tolerance_is_about_a_nanoradian() -> None:
    ring = CASES["small"].polygons[0][0]
    v = ring.xyz
    middle = (v[2] + v[3]) / np.linalg.norm(v[2] + v[3])
    outward = -np.cross(v[2], v[3]) / np.linalg.norm(np.cross(v[2], v[3]))  # right: out
    offsets = [0.5e-9, 2e-9, 1e-7]
    points = [latlon(math.cos(d) * middle + math.sin(d) * outward) for d in offsets]
    lat, lon = (np.array(c) for c in zip(*points, strict=True))
    assert polygon_mask(lat, lon, CASES["small"].area()).tolist() == [True, False, False]


def test_winding_does_not_matter_unless_oriented() -> None:
    lat, lon = uniform_points(2000, seed=5)
    ring = CASES["small"].polygons[0][0]
    ccw = polygon_mask(lat, lon, SphericalPolygon([[(ring.lat, ring.lon)]]))
    cw_ring = ring.reversed()
    cw = polygon_mask(lat, lon, SphericalPolygon([[(cw_ring.lat, cw_ring.lon)]]))
    np.testing.assert_array_equal(ccw, cw)
    # Oriented, the clockwise ring is everything outside: the complement, boundary kept.
    world_less_ring = SphericalPolygon([[(cw_ring.lat, cw_ring.lon)]], oriented=True)
    np.testing.assert_array_equal(polygon_mask(lat, lon, world_less_ring), ~ccw)
    assert world_less_ring.ring_left_area_sr[0] > 2 * math.pi


def test_a_ring_halving_the_sphere_needs_oriented() -> None:
    equator = {"type": "Polygon", "coordinates": [[[0, 0], [90, 0], [180, 0], [-90, 0], [0, 0]]]}
    with pytest.raises(InvalidArea, match="oriented=True"):
        SphericalPolygon.from_geojson(equator)
    # Walking east along the equator, the north is on the left.
    north = SphericalPolygon.from_geojson(equator, oriented=True)
    lat = np.array([45.0, 89.0, 90.0, -45.0, -90.0, 0.0, 0.0])
    lon = np.array([0.0, 120.0, 0.0, 10.0, 0.0, 37.0, -180.0])
    assert polygon_mask(lat, lon, north).tolist() == [True, True, True, False, False, True, True]


def test_polygon_boxes_cover_poles_and_the_antimeridian() -> None:
    box = CASES["antimeridian"].area().bbox
    assert box.crosses_antimeridian and 160 < box.min_lon < 180 and -180 < box.max_lon < -160
    assert CASES["north-pole"].area().bbox.max_lat == 90.0
    assert CASES["north-pole"].area().bbox.all_longitudes
    assert CASES["south-pole"].area().bbox.min_lat == -90.0
    band = CASES["polar-band"].area()
    assert band.bbox.max_lat == 90.0 and band.bbox.all_longitudes
    # Great-circle edges bow poleward of their vertices: the box holds the bulge.
    square = SphericalPolygon.from_geojson(
        {"type": "Polygon", "coordinates": [[[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]]]}
    )
    assert square.bbox.max_lat > 10.03
    assert polygon_mask(np.array([10.03]), np.array([5.0]), square).tolist() == [True]


def test_the_mask_in_small_blocks_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    areas = importlib.import_module("geonear.service.analytics.areas")
    case = CASES["multipolygon"]
    lat, lon = points_near(case, 200, seed=3)
    whole = polygon_mask(lat, lon, case.area())
    monkeypatch.setattr(areas, "_HOST_BLOCK", 50)
    np.testing.assert_array_equal(polygon_mask(lat, lon, case.area()), whole)


# -- boxes ----------------------------------------------------------------------------


def test_bbox_mask_across_the_antimeridian() -> None:
    box = Bbox(min_lat=-10.0, min_lon=170.0, max_lat=10.0, max_lon=-170.0)
    lat = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 10.5, -10.0])
    lon = np.array([175.0, -175.0, 180.0, -180.0, 0.0, 169.9, 170.0, 175.0, -170.0])
    expected = [True, True, True, True, False, False, True, False, True]
    assert bbox_mask(lat, lon, box).tolist() == expected
    assert box.crosses_antimeridian


def test_bbox_mask_meridian_180_and_poles() -> None:
    box = Bbox(-90.0, -180.0, -80.0, -170.0)
    lat = np.array([-85.0, -85.0, -90.0, -90.0, -79.0])
    lon = np.array([180.0, 175.0, 0.0, 90.0, -175.0])
    # 180 is -180; the south pole has every longitude; -79 is north of the box.
    assert bbox_mask(lat, lon, box).tolist() == [True, False, True, True, False]
    everywhere = Bbox(-90.0, -180.0, 90.0, 180.0)
    assert bbox_mask(*uniform_points(100, seed=1), everywhere).all()


@pytest.mark.parametrize(
    ("bounds", "reason"),
    [
        ((-91.0, 0.0, 0.0, 1.0), r"\[-90, 90\]"),
        ((10.0, 0.0, 5.0, 1.0), "above max_lat"),
        ((0.0, -181.0, 1.0, 1.0), r"\[-180, 180\]"),
        ((0.0, float("nan"), 1.0, 1.0), "finite"),
        ((0.0, "x", 1.0, 1.0), "finite"),
    ],
)
def test_bad_boxes_are_refused(bounds: tuple, reason: str) -> None:
    with pytest.raises(InvalidArea, match=reason):
        Bbox(*bounds)


# -- refusals -------------------------------------------------------------------------


def _polygon(*rings: list) -> dict:
    return {"type": "Polygon", "coordinates": list(rings)}


SQUARE = [[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]]


@pytest.mark.parametrize(
    ("area", "reason"),
    [
        (_polygon([[0, 0], [10, 0], [10, 10], [0, 10]]), "not closed"),
        (_polygon([[0, 0], [10, 0], [0, 0]]), "at least 4"),
        (_polygon([[0, 0], [10, 0], [10, 0], [0, 0], [0, 0]]), "fewer than 3 distinct"),
        (_polygon([[0, 0], [10, 0], [10, 95], [0, 0]]), "out of range"),
        (_polygon([[0, 0], [190, 0], [10, 10], [0, 0]]), "out of range"),
        (_polygon([[0, 0], [float("nan"), 0], [10, 10], [0, 0]]), "finite"),
        (_polygon([[0, 0], [10, 10], [10, 0], [0, 10], [0, 0]]), "intersects itself"),
        (_polygon([[0, 0], [10, 0], [5, 0], [5, 5], [0, 0]]), "folds back"),
        (_polygon([[0, 0], [180, 0], [90, 45], [0, 0]]), "antipodal"),
        (_polygon(SQUARE, [[20, 20], [20, 21], [21, 21], [20, 20]]), "not inside its shell"),
        (_polygon(SQUARE, [[5, 5], [15, 5], [15, 6], [5, 6], [5, 5]]), "cross each other"),
        ({"type": "Point", "coordinates": [0, 0]}, "Polygon or MultiPolygon"),
        ({"type": "MultiPolygon", "coordinates": []}, "no polygons"),
        ({"type": "Polygon", "coordinates": []}, "no rings"),
        ("{not json", "not valid JSON"),
        (42, "got int"),
    ],
)
def test_bad_polygons_are_refused_with_the_reason(area: object, reason: str) -> None:
    with pytest.raises(InvalidArea, match=reason):
        SphericalPolygon.parse(area)


def test_a_counter_clockwise_hole_is_refused_when_oriented() -> None:
    hole = [[2, 2], [8, 2], [8, 8], [2, 8], [2, 2]]  # counter-clockwise, as the shell
    SphericalPolygon.from_geojson(_polygon(SQUARE, hole))  # the smaller side: fine
    with pytest.raises(InvalidArea, match="holes wind clockwise"):
        SphericalPolygon.from_geojson(_polygon(SQUARE, hole), oriented=True)


def test_too_many_vertices_are_refused() -> None:
    n = MAX_VERTICES + 1
    ring = star(0.0, 0.0, 5.0, 5.0, n, seed=1)
    with pytest.raises(InvalidArea, match=f"more than {MAX_VERTICES} vertices"):
        SphericalPolygon([[(ring.lat, ring.lon)]])


# -- encodings ------------------------------------------------------------------------


def wkb_polygon(
    rings: list, little: bool = True, srid: int | None = None, z: bool = False
) -> bytes:
    order = "<" if little else ">"
    code = 3 | (0x20000000 if srid is not None else 0) | (0x80000000 if z else 0)
    out = struct.pack(order + "BI", 1 if little else 0, code)
    if srid is not None:
        out += struct.pack(order + "I", srid)
    out += struct.pack(order + "I", len(rings))
    for ring in rings:
        out += struct.pack(order + "I", len(ring))
        for x, y in ring:
            out += struct.pack(order + ("ddd" if z else "dd"), x, y, *([7.0] if z else []))
    return out


def wkb_multipolygon(polygons: list, little: bool = True) -> bytes:
    order = "<" if little else ">"
    out = struct.pack(order + "BII", 1 if little else 0, 6, len(polygons))
    # Each member in the other byte order: each carries its own.
    return out + b"".join(wkb_polygon(p, little=not little) for p in polygons)


def as_lists(case: Case) -> list[list[list[list[float]]]]:
    polygons = []
    for shell, holes in case.polygons:
        rings = []
        for ring in [shell, *holes]:
            pts = [[float(b), float(a)] for a, b in zip(ring.lat, ring.lon, strict=True)]
            rings.append([*pts, pts[0]])
        polygons.append(rings)
    return polygons


def test_wkb_in_both_byte_orders_matches_geojson() -> None:
    case = CASES["multipolygon"]
    polygons = as_lists(case)
    lat, lon = points_near(case, 200, seed=9)
    expected = polygon_mask(lat, lon, case.area())
    geojson = {"type": "MultiPolygon", "coordinates": polygons}
    encodings: list[object] = [
        geojson,
        json.dumps(geojson),
        {"type": "Feature", "properties": {}, "geometry": geojson},
        wkb_multipolygon(polygons, little=True),
        wkb_multipolygon(polygons, little=False),
        wkb_multipolygon(polygons, little=True).hex(),
    ]
    for encoded in encodings:
        mask = polygon_mask(lat, lon, SphericalPolygon.parse(encoded))
        np.testing.assert_array_equal(mask, expected)
    one = polygons[2]
    single = polygon_mask(lat, lon, SphericalPolygon.from_geojson(_polygon(*one)))
    for encoded_one in (
        wkb_polygon(one, little=False),
        wkb_polygon(one, srid=4326),
        wkb_polygon(one, z=True),
    ):
        np.testing.assert_array_equal(
            polygon_mask(lat, lon, SphericalPolygon.from_wkb(encoded_one)), single
        )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (wkb_polygon([SQUARE])[:-3], "ends early"),
        (wkb_polygon([SQUARE]) + b"\x00", "after the geometry"),
        (b"\x02" + wkb_polygon([SQUARE])[1:], "byte order"),
        (struct.pack("<BIdd", 1, 1, 0.0, 0.0), "got type 1"),
        (wkb_polygon([SQUARE], srid=3857), "SRID 3857"),
        (wkb_polygon([SQUARE[:-1]]), "not closed"),
    ],
)
def test_bad_wkb_is_refused_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(InvalidArea, match=reason):
        SphericalPolygon.from_wkb(data)


def test_shapely_geometries_are_read_through_geo_interface_and_wkb() -> None:
    shapely = pytest.importorskip("shapely")
    case = CASES["holes"]
    (rings,) = as_lists(case)
    geometry = shapely.Polygon(rings[0], rings[1:])
    lat, lon = points_near(case, 200, seed=4)
    expected = polygon_mask(lat, lon, case.area())
    for area in (
        geometry,
        shapely.to_wkb(geometry),
        shapely.to_wkb(geometry, byte_order=0),
        shapely.to_wkb(geometry, hex=True),
        shapely.MultiPolygon([geometry]),
    ):
        mask = polygon_mask(lat, lon, SphericalPolygon.parse(area))
        np.testing.assert_array_equal(mask, expected)


# -- GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available()[0], reason=f"no usable GPU: {gpu_available()[1]}")
@pytest.mark.parametrize("name", list(CASES))
def test_cupy_masks_equal_numpy_masks(name: str) -> None:
    import cupy as cp

    case = CASES[name]
    area = case.area()
    lat, lon = points_near(case, 2000, seed=7)
    on_host = polygon_mask(lat, lon, area)
    on_device = polygon_mask(cp.asarray(lat), cp.asarray(lon), area, xp=cp)
    np.testing.assert_array_equal(cp.asnumpy(on_device), on_host)
    box = Bbox(-10.0, 170.0, 10.0, -170.0)
    np.testing.assert_array_equal(
        cp.asnumpy(bbox_mask(cp.asarray(lat), cp.asarray(lon), box, xp=cp)),
        bbox_mask(lat, lon, box),
    )


# -- every engine's index -------------------------------------------------------------


@pytest.mark.parametrize("engine", cpu_engine_params(with_dask=False))
def test_every_index_finds_the_rows_the_masks_find(engine: str) -> None:
    """``PointIndex.area_rows`` (a device copy of the degrees on the GPU engine) gives the
    rows the host masks give, over every point or a subset, for every polygon case and a
    box across the antimeridian."""
    case = CASES["holes"]
    lat, lon = points_near(case, 500, seed=11)
    index = create_engine(engine).build_index(lat, lon)
    subset = np.flatnonzero(np.arange(lat.shape[0]) % 3 != 0)
    for area in [*(c.area() for c in CASES.values()), Bbox(-10.0, 170.0, 10.0, -170.0)]:
        mask = area_mask(lat, lon, area)
        rows = index.area_rows(lat, lon, area)
        assert rows.dtype == np.int64
        np.testing.assert_array_equal(rows, np.flatnonzero(mask))
        np.testing.assert_array_equal(index.area_rows(lat, lon, area, subset), subset[mask[subset]])
    # Every case's points are near its own rings: the holes case has rows inside.
    assert index.area_rows(lat, lon, case.area()).size > 0
