"""Areas on the sphere, and which points lie in them: latitude/longitude boxes and
spherical polygons.

Coordinates are degrees, latitude first in this module's own signatures (GeoJSON and WKB
give longitude first, as their standards say). Everything here is written once with an
array namespace ``xp`` (numpy or cupy), so the masks run on the host or the device.

Boxes (:class:`Bbox`)
    ``min_lat <= lat <= max_lat`` and ``min_lon <= lon <= max_lon``, bounds included;
    ``min_lon > max_lon`` crosses the antimeridian (``lon >= min_lon or lon <= max_lon``).
    Longitudes 180 and -180 are one meridian, and a point at a pole (latitude +-90) has
    every longitude: it is in a box whose latitudes reach that pole.

Polygons (:class:`SphericalPolygon`)
    Geography semantics, as in S2 or PostGIS ``geography``: an edge is the shorter
    great-circle arc between its vertices (not a straight line in latitude/longitude), so
    polygons may cross the antimeridian or contain a pole. A polygon is its shell's
    region less its holes' regions; a multipolygon is the union of its polygons.

    Which side of a ring is its region (``oriented``):

    - ``oriented=False`` (default): each ring's region is the smaller of the two it
      bounds, whichever way the ring winds. A ring whose two sides have equal areas
      (within 1e-9 steradian, as a great circle's do) is refused as ambiguous. No
      polygon can then be larger than a hemisphere.
    - ``oriented=True``: RFC 7946's right-hand rule read as S2 reads it: the polygon lies
      to the left of every ring, walking along it on the sphere seen from outside (a
      shell counter-clockwise around its region, holes clockwise). A clockwise shell is
      taken at its word: the region is everything outside it, larger than a hemisphere.

    Boundary: a point within ``EDGE_TOLERANCE_RAD`` (1e-9 rad, about 6.4 mm on the
    earth) of any edge or vertex, a hole's included, is inside: the polygon is closed.

    Validity (else :class:`InvalidArea` with the reason): coordinates finite and in
    range; GeoJSON and WKB rings closed (first position equal to the last); at least 3
    distinct vertices a ring, consecutive vertices closer than 1e-12 rad being merged;
    no two consecutive vertices within 1e-6 rad of antipodal (their arc is undefined);
    rings simple (no two edges touch or cross except neighbours at their shared vertex,
    and no ring folds back over itself); a polygon's rings do not cross one another
    (touching at points is allowed) and its holes lie in its shell; at most
    ``MAX_VERTICES`` vertices in all.

Point in polygon: the parity of the crossings of the arc from the point to a reference
point whose side is known, with robust float64 predicates: edge normals from
``(b + a) x (b - a)`` (accurate for short edges), each vertex's side of the arc decided
once a point (the same answer for both edges that share it, so a vertex on the arc
counts once), and reference points chosen far from every edge's great circle. A ring's
side is first known at a point just left of one of its edges, inside the ring's
clearance; from there it is carried to the two reference points by the same crossing
count. Each point uses the nearer reference (they are 60-120 degrees apart, so no arc is
near a half circle). A polygon's bounding box (great-circle edges bow poleward of their
vertices; a shell around a pole reaches it) is checked first: only points in it are
tested edge by edge, so the cost is points in the box x edges (on one host core about
0.3 s for 1M points and 100 edges, 5 s for 100k points and 10k edges).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from geonear.geometry import unit_vectors

__all__ = [
    "EDGE_TOLERANCE_RAD",
    "MAX_VERTICES",
    "Area",
    "Bbox",
    "InvalidArea",
    "SphericalPolygon",
    "area_mask",
    "bbox_mask",
    "polygon_mask",
]

#: Points this close to an edge or a vertex (radians on the unit sphere) are on it, and
#: so inside: about 6.4 mm on the earth, far above float64 rounding (about 1e-16).
EDGE_TOLERANCE_RAD = 1e-9
#: Most vertices of one area, all rings together (the self-intersection check and each
#: point's test cost grow with the edges).
MAX_VERTICES = 10_000
#: Consecutive vertices closer than this (radians) are one vertex; edges nearer one
#: another than this touch.
_SAME_POINT_RAD = 1e-12
#: Consecutive vertices within this of antipodal (radians) have no defined arc.
_ANTIPODAL_RAD = 1e-6
#: A ring whose two sides' areas differ by less than this (steradians) is ambiguous.
_AMBIGUOUS_AREA_SR = 1e-9
#: A polygon's box is widened by this (degrees, about 11 cm), above the edge tolerance.
_BOX_MARGIN_DEG = 1e-6
#: Narrowest clearance (radians) at which a ring's inside can be told from its edges.
_MIN_CLEARANCE_RAD = 1e-10
#: (point, edge) pairs tested at once on the host (in cache: 1M points, 100 edges on one
#: core, 0.30 s in blocks of 2**16, 0.44 s of 2**18, 1.05 s of 2**20) and on a device;
#: blocks of at least _BLOCK_POINTS points.
_HOST_BLOCK = 1 << 16
_DEVICE_BLOCK = 1 << 24
_BLOCK_POINTS = 64
_TWO_PI = 2.0 * math.pi


class InvalidArea(ValueError):
    """An area that cannot be read or is not valid; the message says why and where."""


# -- boxes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bbox:
    """A latitude/longitude box in degrees, bounds included.

    ``min_lon > max_lon`` crosses the antimeridian. Raises :class:`InvalidArea` unless
    every bound is finite, latitudes are in [-90, 90] with ``min_lat <= max_lat``, and
    longitudes are in [-180, 180].
    """

    min_lat: float
    min_lon: float
    max_lat: float
    max_lon: float

    def __post_init__(self) -> None:
        values = (self.min_lat, self.min_lon, self.max_lat, self.max_lon)
        try:
            finite = all(math.isfinite(float(v)) for v in values)
        except (TypeError, ValueError):
            finite = False
        if not finite:
            raise InvalidArea(f"bounding box bounds must be finite numbers, got {values}")
        for name in ("min_lat", "min_lon", "max_lat", "max_lon"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if not (-90.0 <= self.min_lat <= 90.0 and -90.0 <= self.max_lat <= 90.0):
            raise InvalidArea(
                f"bounding box latitudes must be in [-90, 90], got {self.min_lat}, {self.max_lat}"
            )
        if self.min_lat > self.max_lat:
            raise InvalidArea(
                f"bounding box min_lat {self.min_lat} is above max_lat {self.max_lat}"
            )
        if not (-180.0 <= self.min_lon <= 180.0 and -180.0 <= self.max_lon <= 180.0):
            raise InvalidArea(
                "bounding box longitudes must be in [-180, 180], got "
                f"{self.min_lon}, {self.max_lon}"
            )

    @property
    def crosses_antimeridian(self) -> bool:
        """Whether the box runs east from ``min_lon`` across 180 to ``max_lon``."""
        return self.min_lon > self.max_lon

    @property
    def all_longitudes(self) -> bool:
        return self.min_lon == -180.0 and self.max_lon == 180.0


def bbox_mask(lat: Any, lon: Any, bbox: Bbox, xp: Any = np) -> Any:
    """Which points (degrees, shape (n,)) lie in ``bbox``: bool array of shape (n,)."""
    lat = xp.asarray(lat, dtype=xp.float64)
    lon = xp.asarray(lon, dtype=xp.float64)
    inside = (lat >= bbox.min_lat) & (lat <= bbox.max_lat)
    if bbox.all_longitudes:
        return inside
    # 180 and -180 are one meridian; a pole has every longitude.
    twin = lon + 360.0 * ((lon == -180.0).astype(lon.dtype) - (lon == 180.0).astype(lon.dtype))
    in_lon = _in_lon_range(lon, bbox, xp) | _in_lon_range(twin, bbox, xp)
    return inside & (in_lon | (xp.abs(lat) == 90.0))


def _in_lon_range(lon: Any, bbox: Bbox, xp: Any) -> Any:
    if bbox.crosses_antimeridian:
        return (lon >= bbox.min_lon) | (lon <= bbox.max_lon)
    return (lon >= bbox.min_lon) & (lon <= bbox.max_lon)


# -- polygons -------------------------------------------------------------------------


Ring = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _Edges:
    """A polygon's rings as arrays of edges, for the masks (host or device arrays).

    Edge e runs from vertex e to vertex ``following[e]`` (the next one of its ring);
    rings are consecutive, ``ring_start[k]:ring_start[k + 1]`` being ring k's edges and
    vertices; polygons too, shell first (``polygon_start``).
    """

    vertices: Any  # (E, 3) unit vectors
    following: Any  # (E,) int64
    normals: Any  # (E, 3) unit normals, the edge's left side positive
    ring_start: Any  # (K + 1,) int64
    ring_of_edge: Any  # (E,) int64
    references: Any  # (2, 3) reference points
    reference_inside: Any  # (K, 2) bool: each reference point in each ring's region
    polygon_start: Any  # (P + 1,) int64, into the rings
    is_hole: Any  # (K,) bool

    def to(self, xp: Any) -> _Edges:
        if xp is np:
            return self
        return _Edges(**{name: xp.asarray(value) for name, value in self.__dict__.items()})


class SphericalPolygon:
    """A polygon or multipolygon on the sphere (see the module docstring for the rules).

    Parameters
    ----------
    polygons : sequence of sequences of (lat, lon)
        Each polygon's rings, shell first, then holes; each ring a pair of 1-D arrays of
        degrees, its closing vertex repeated or left out.
    oriented : bool
        False: each ring's region is its smaller side. True: the polygon lies left of
        every ring (RFC 7946 winding), so it may exceed a hemisphere.

    Build one from GeoJSON, WKB, or anything with ``__geo_interface__`` (a shapely
    geometry) with :meth:`parse`, :meth:`from_geojson` or :meth:`from_wkb`.
    """

    def __init__(self, polygons: Sequence[Sequence[Ring]], *, oriented: bool = False) -> None:
        self.oriented = bool(oriented)
        if len(polygons) == 0:
            raise InvalidArea("the area has no polygons")
        rings: list[np.ndarray] = []
        ring_names: list[str] = []
        polygon_start = [0]
        is_hole: list[bool] = []
        total = 0
        for j, polygon in enumerate(polygons):
            if len(polygon) == 0:
                raise InvalidArea(f"polygon {j} has no rings")
            for k, ring in enumerate(polygon):
                name = _ring_name(j, k, len(polygons))
                xyz = _clean_ring(ring, name)
                total += xyz.shape[0]
                if total > MAX_VERTICES:
                    raise InvalidArea(
                        f"the area has more than {MAX_VERTICES} vertices; simplify it first"
                    )
                rings.append(xyz)
                ring_names.append(name)
                is_hole.append(k > 0)
            polygon_start.append(len(rings))
        self._ring_names = ring_names
        vertices = np.concatenate(rings)
        sizes = np.array([r.shape[0] for r in rings], dtype=np.int64)
        ring_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        ring_of_edge = np.repeat(np.arange(len(rings), dtype=np.int64), sizes)
        following = np.arange(vertices.shape[0], dtype=np.int64) + 1
        following[ring_start[1:] - 1] = ring_start[:-1]
        normals = _unit(_robust_cross(vertices, vertices[following]))
        for k in range(len(rings)):
            _check_simple(vertices, following, normals, ring_start, k, ring_names[k])
        for j in range(len(polygons)):
            _check_rings_apart(
                vertices, following, normals, ring_start, polygon_start[j : j + 2], ring_names
            )
        left_area = np.array(
            [_left_area(vertices[ring_start[k] : ring_start[k + 1]]) for k in range(len(rings))]
        )
        self.ring_left_area_sr = left_area
        if self.oriented:
            region_is_left = ~np.array(is_hole)
        else:
            ambiguous = np.flatnonzero(np.abs(left_area - _TWO_PI) <= _AMBIGUOUS_AREA_SR)
            if ambiguous.size:
                raise InvalidArea(
                    f"{ring_names[ambiguous[0]]} splits the sphere into two halves of equal "
                    "area, so its smaller side is undefined; pass oriented=True to take the "
                    "side on its left"
                )
            region_is_left = left_area < _TWO_PI
        references = _reference_points(normals)
        reference_inside = np.empty((len(rings), 2), dtype=bool)
        for k in range(len(rings)):
            lo, hi = ring_start[k], ring_start[k + 1]
            left_point = _point_left_of(vertices[lo:hi], normals[lo:hi], ring_names[k])
            one_ring = _Edges(
                vertices=vertices[lo:hi],
                following=following[lo:hi] - lo,
                normals=normals[lo:hi],
                ring_start=np.array([0, hi - lo]),
                ring_of_edge=np.zeros(hi - lo, dtype=np.int64),
                references=references,
                reference_inside=np.zeros((1, 2), dtype=bool),
                polygon_start=np.array([0, 1]),
                is_hole=np.zeros(1, dtype=bool),
            )
            # The left point is on the ring's left side; the nearer reference is across
            # as many crossings of the ring from it, the other as many from that one
            # (hops of at most 150 degrees: no arc near a half circle).
            near = int(np.argmax(references @ left_point))
            hops = _crossing_parity(
                np.stack([left_point, references[near]]),
                np.stack([references[near], references[1 - near]]),
                one_ring,
                np,
            )[:, 0]
            in_left = np.empty(2, dtype=bool)
            in_left[near] = ~hops[0]
            in_left[1 - near] = in_left[near] ^ hops[1]
            reference_inside[k] = in_left if region_is_left[k] else ~in_left
        self._edges = _Edges(
            vertices=vertices,
            following=following,
            normals=normals,
            ring_start=ring_start,
            ring_of_edge=ring_of_edge,
            references=references,
            reference_inside=reference_inside,
            polygon_start=np.asarray(polygon_start, dtype=np.int64),
            is_hole=np.asarray(is_hole, dtype=bool),
        )
        self._check_holes_inside()
        self.bbox = self._bounding_box()
        # The same rings, vertex for vertex, read the same way are the same area (however
        # they were encoded): what keys the indexes of the points in an area.
        self._identity = (
            self.oriented,
            vertices.tobytes(),
            ring_start.tobytes(),
            np.asarray(polygon_start, dtype=np.int64).tobytes(),
        )

    # -- construction from encodings -------------------------------------------------

    @classmethod
    def parse(cls, area: Any, *, oriented: bool = False) -> SphericalPolygon:
        """A polygon from GeoJSON (a mapping or its text), WKB (bytes, or its hex text),
        or an object with ``__geo_interface__`` (a shapely Polygon or MultiPolygon)."""
        if isinstance(area, bytes | bytearray | memoryview):
            return cls.from_wkb(bytes(area), oriented=oriented)
        if isinstance(area, str):
            text = area.strip()
            if text and re.fullmatch(r"(?:[0-9A-Fa-f]{2})+", text):
                return cls.from_wkb(bytes.fromhex(text), oriented=oriented)
        return cls.from_geojson(area, oriented=oriented)

    @classmethod
    def from_geojson(cls, geojson: Any, *, oriented: bool = False) -> SphericalPolygon:
        """A polygon from a GeoJSON Polygon or MultiPolygon, or a Feature of one: a
        mapping, its JSON text, or an object with ``__geo_interface__``. Positions are
        [longitude, latitude], any further value (altitude) ignored."""
        return cls(_geojson_polygons(geojson), oriented=oriented)

    @classmethod
    def from_wkb(cls, data: bytes, *, oriented: bool = False) -> SphericalPolygon:
        """A polygon from WKB: Polygon or MultiPolygon, either byte order, ISO or EWKB
        (an SRID, if given, must be 4326 or 0); Z and M values are ignored."""
        return cls(_WkbReader(bytes(data)).area(), oriented=oriented)

    # -- properties -------------------------------------------------------------------

    @property
    def n_vertices(self) -> int:
        return int(self._edges.vertices.shape[0])

    @property
    def n_polygons(self) -> int:
        return int(self._edges.polygon_start.shape[0] - 1)

    def edges(self, xp: Any = np) -> _Edges:
        """The precomputed edge arrays in namespace ``xp`` (for ``polygon_mask``)."""
        return self._edges.to(xp)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SphericalPolygon):
            return NotImplemented
        return self._identity == other._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def __repr__(self) -> str:
        return (
            f"SphericalPolygon({self.n_polygons} polygon(s), {self.n_vertices} vertices, "
            f"oriented={self.oriented}, bbox={self.bbox})"
        )

    # -- checks and bounds ------------------------------------------------------------

    def _check_holes_inside(self) -> None:
        """Each hole's first vertex in its shell's closed region, and its shell's first
        vertex not inside the hole's region (so the hole's region is within the shell)."""
        e = self._edges
        for j in range(self.n_polygons):
            shell = int(e.polygon_start[j])
            for hole in range(shell + 1, int(e.polygon_start[j + 1])):
                points = e.vertices[[e.ring_start[hole], e.ring_start[shell]]]
                inside, near = _ring_membership(points, e, np)
                if not (inside[0, shell] or near[0, shell]):
                    raise InvalidArea(f"{self._ring_names[hole]} is not inside its shell")
                if inside[1, hole] and not near[1, hole]:
                    hint = " (with oriented=True holes wind clockwise)" if self.oriented else ""
                    raise InvalidArea(
                        f"{self._ring_names[hole]} holds its shell rather than lying in it{hint}"
                    )

    def _bounding_box(self) -> Bbox:
        """The box of every shell's region, widened by _BOX_MARGIN_DEG; every longitude
        where the area reaches a pole."""
        e = self._edges
        poles = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]])
        inside, near = _ring_membership(poles, e, np)
        # A shell's region reaching a pole (even where a hole takes the pole out).
        at_pole = (inside | near)[:, e.polygon_start[:-1]].any(axis=1)
        north, south = bool(at_pole[0]), bool(at_pole[1])
        shells = np.zeros(e.vertices.shape[0], dtype=bool)
        for j in range(self.n_polygons):
            k = int(e.polygon_start[j])
            shells[e.ring_start[k] : e.ring_start[k + 1]] = True
        lat_lo, lat_hi = _edge_latitude_range(e.vertices[shells], e.vertices[e.following[shells]])
        max_lat = 90.0 if north else min(90.0, lat_hi + _BOX_MARGIN_DEG)
        min_lat = -90.0 if south else max(-90.0, lat_lo - _BOX_MARGIN_DEG)
        reach = max(abs(min_lat), abs(max_lat))
        if north or south or reach >= 89.0:
            return Bbox(min_lat, -180.0, max_lat, 180.0)
        intervals = []
        for j in range(self.n_polygons):
            k = int(e.polygon_start[j])
            ring = e.vertices[e.ring_start[k] : e.ring_start[k + 1]]
            intervals.append(_ring_longitude_span(ring))
        margin = _BOX_MARGIN_DEG / math.cos(math.radians(reach))
        span = _covering_interval(intervals)
        if span is None or span[1] + 2 * margin >= 360.0:
            return Bbox(min_lat, -180.0, max_lat, 180.0)
        start, width = span[0] - margin, span[1] + 2 * margin
        return Bbox(min_lat, _wrap_lon(start), max_lat, _wrap_lon(start + width))


#: An area: a box or a polygon.
Area = Bbox | SphericalPolygon


def area_mask(lat: Any, lon: Any, area: Area, xp: Any = np) -> Any:
    """Which points (degrees, shape (n,)) lie in ``area``: bool array of shape (n,)."""
    if isinstance(area, Bbox):
        return bbox_mask(lat, lon, area, xp)
    return polygon_mask(lat, lon, area, xp)


def polygon_mask(lat: Any, lon: Any, polygon: SphericalPolygon, xp: Any = np) -> Any:
    """Which points (degrees, shape (n,)) lie in ``polygon``: bool array of shape (n,).

    Points on the boundary (within EDGE_TOLERANCE_RAD of an edge or vertex) are inside.
    The polygon's bounding box is tested first; the points in it are tested against
    every edge, in blocks of bounded size.
    """
    lat = xp.asarray(lat, dtype=xp.float64)
    lon = xp.asarray(lon, dtype=xp.float64)
    out = xp.zeros(lat.shape[0], dtype=bool)
    candidates = xp.flatnonzero(bbox_mask(lat, lon, polygon.bbox, xp))
    if candidates.shape[0] == 0:
        return out
    edges = polygon.edges(xp)
    per_block = _HOST_BLOCK if xp is np else _DEVICE_BLOCK
    step = max(_BLOCK_POINTS, per_block // polygon.n_vertices)
    for start in range(0, int(candidates.shape[0]), step):
        rows = candidates[start : start + step]
        points = unit_vectors(lat[rows], lon[rows], xp=xp)
        out[rows] = _area_contains(points, edges, xp)
    return out


# -- the point test -------------------------------------------------------------------


def _area_contains(points: Any, e: _Edges, xp: Any) -> Any:
    """Whether each point (unit vectors (m, 3)) is in the area, its boundary included."""
    inside, near = _ring_membership(points, e, xp)
    n_polygons = int(e.polygon_start.shape[0]) - 1
    shells = e.polygon_start[:-1]
    holes_in = _segment_counts(inside & e.is_hole[None, :], e.polygon_start, xp)
    in_polygon = inside[:, shells] & (holes_in == 0)
    on_edge = near.any(axis=1)
    if n_polygons == 1:
        return on_edge | in_polygon[:, 0]
    return on_edge | in_polygon.any(axis=1)


def _ring_membership(points: Any, e: _Edges, xp: Any) -> tuple[Any, Any]:
    """(inside, near), each bool (m, K): whether each point is in each ring's region
    (by crossing parity; meaningless where near), and within EDGE_TOLERANCE_RAD of it."""
    # Each point's reference: the nearer of the two.
    second = (points @ e.references[1]) > (points @ e.references[0])
    reference = xp.where(second[:, None], e.references[1][None, :], e.references[0][None, :])
    parity, sine = _crossing_parity(points, reference, e, xp, with_sines=True)
    status = xp.where(second[:, None], e.reference_inside[:, 1], e.reference_inside[:, 0])
    inside = status ^ parity
    near = _near_rings(points, sine, e, xp)
    return inside, near


def _crossing_parity(
    points: Any, reference: Any, e: _Edges, xp: Any, with_sines: bool = False
) -> Any:
    """Per ring, whether the arc from each point to its reference point (both (m, 3))
    crosses the ring an odd number of times: bool (m, K); with ``with_sines`` also each
    point's sines to the edges' great circles (m, E).

    Edge (a, b) crosses arc (p, r) iff sign(a, b, r) = -sign(a, b, p) = sign(p, r, a) =
    -sign(p, r, b), sign(x, y, z) being that of (x × y) · z (S2's CrossingSign, with
    float64 predicates): each arc's ends on opposite sides of the other's great circle,
    on the same half of it. Each vertex's side of the arc is computed once a point (zero
    counting as negative), so a vertex on the arc's circle counts for exactly one of its
    two edges; the reference points are far from every edge's circle.
    """
    pr = _robust_cross(points, reference)  # 2 p x r: its sign is the side of the arc
    side = (pr @ e.vertices.T) > 0  # (m, E): each vertex's side
    side_b = side[:, e.following]
    sine = points @ e.normals.T
    r_left = (reference @ e.normals.T) > 0
    crosses = (side != side_b) & (r_left == side) & ((sine < 0) == side)
    parity = (_segment_counts(crosses, e.ring_start, xp) & 1).astype(bool)
    return (parity, sine) if with_sines else parity


def _near_rings(points: Any, sine: Any, e: _Edges, xp: Any) -> Any:
    """Whether each point is within EDGE_TOLERANCE_RAD of each ring: bool (m, K).

    Only (point, edge) pairs within the tolerance of the edge's great circle can be
    (few): for them, whether the point's foot on the circle lies between the ends, or
    the point is within the tolerance of an end.
    """
    m, n_rings = int(points.shape[0]), int(e.ring_start.shape[0]) - 1
    near = xp.zeros((m, n_rings), dtype=bool)
    rows, cols = xp.nonzero(xp.abs(sine) <= EDGE_TOLERANCE_RAD)
    if int(rows.shape[0]) == 0:
        return near
    p = points[rows]
    a, b, n = e.vertices[cols], e.vertices[e.following[cols]], e.normals[cols]
    between = (_dot(p, _cross(n, a)) >= 0) & (_dot(p, _cross(n, b)) <= 0)
    tol2 = EDGE_TOLERANCE_RAD * EDGE_TOLERANCE_RAD
    at_end = (_sq_dist(p, a) <= tol2) | (_sq_dist(p, b) <= tol2)
    hit = between | at_end
    near[rows[hit], e.ring_of_edge[cols[hit]]] = True
    return near


def _segment_counts(flags: Any, starts: Any, xp: Any) -> Any:
    """Per segment [starts[k], starts[k + 1]) of the columns, how many flags are set: int
    (m, K)."""
    running = xp.cumsum(flags, axis=1, dtype=xp.int32)
    total = xp.concatenate([xp.zeros((int(flags.shape[0]), 1), dtype=xp.int32), running], axis=1)
    return total[:, starts[1:]] - total[:, starts[:-1]]


# -- vector helpers (any namespace) ---------------------------------------------------


def _cross(a: Any, b: Any) -> Any:
    ax, ay, az = a[..., 0], a[..., 1], a[..., 2]
    bx, by, bz = b[..., 0], b[..., 1], b[..., 2]
    out = a * 0.0 + b * 0.0  # the broadcast shape, in a's namespace
    out[..., 0] = ay * bz - az * by
    out[..., 1] = az * bx - ax * bz
    out[..., 2] = ax * by - ay * bx
    return out


def _robust_cross(a: Any, b: Any) -> Any:
    """2 (a x b) as (b + a) x (b - a): accurate where a and b are close (b - a is exact)."""
    return _cross(b + a, b - a)


def _dot(a: Any, b: Any) -> Any:
    return a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]


def _sq_dist(a: Any, b: Any) -> Any:
    d = a - b
    return _dot(d, d)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


# -- construction helpers (host) ------------------------------------------------------


def _ring_name(polygon: int, ring: int, n_polygons: int) -> str:
    what = "the shell" if ring == 0 else f"hole {ring}"
    return what if n_polygons == 1 else f"{what} of polygon {polygon}"


def _clean_ring(ring: Ring, name: str) -> np.ndarray:
    """A ring's unit vectors (k, 3), open, consecutive duplicates merged; checked."""
    try:
        lat = np.asarray(ring[0], dtype=np.float64)
        lon = np.asarray(ring[1], dtype=np.float64)
    except (TypeError, ValueError, IndexError) as exc:
        raise InvalidArea(f"{name}: coordinates must be numbers ({exc})") from None
    if lat.ndim != 1 or lat.shape != lon.shape:
        raise InvalidArea(f"{name}: latitudes and longitudes must be 1-D of one length")
    if not (np.isfinite(lat).all() and np.isfinite(lon).all()):
        raise InvalidArea(f"{name}: coordinates must be finite")
    bad = np.flatnonzero((np.abs(lat) > 90.0) | (np.abs(lon) > 180.0))
    if bad.size:
        i = int(bad[0])
        raise InvalidArea(
            f"{name}: vertex {i} (lat {lat[i]}, lon {lon[i]}) is out of range: latitude "
            "must be in [-90, 90] and longitude in [-180, 180]"
        )
    xyz = unit_vectors(lat, lon)
    # Merge runs of (nearly) equal consecutive vertices, the closing repeat included.
    keep = np.ones(xyz.shape[0], dtype=bool)
    if xyz.shape[0]:
        step = np.linalg.norm(np.diff(xyz, axis=0, append=xyz[:1]), axis=1)
        keep = step > _SAME_POINT_RAD
        if not keep.any():
            keep[0] = True
    xyz = xyz[keep]
    if xyz.shape[0] < 3:
        raise InvalidArea(f"{name} has fewer than 3 distinct vertices")
    opposite = np.linalg.norm(xyz + np.roll(xyz, -1, axis=0), axis=1)
    bad = np.flatnonzero(opposite <= 2.0 * math.sin(_ANTIPODAL_RAD / 2.0))
    if bad.size:
        raise InvalidArea(
            f"{name}: consecutive vertices {int(bad[0])} and {int(bad[0]) + 1} are antipodal "
            "(within 1e-6 rad), so the great-circle arc between them is undefined; add a "
            "vertex between them"
        )
    return xyz


def _arc_distance(x: np.ndarray, a: np.ndarray, b: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Angles (radians) from points x (m, 3) to arcs (a, b) with unit normals n (each
    (E, 3)): (m, E)."""
    xe = x[:, None, :]
    sine = np.abs(_dot(xe, n[None]))
    between = (_dot(xe, _cross(n, a)[None]) >= 0) & (_dot(xe, _cross(n, b)[None]) <= 0)
    to_a = _angle(xe, a[None])
    to_b = _angle(xe, b[None])
    return np.where(between, np.arcsin(np.minimum(sine, 1.0)), np.minimum(to_a, to_b))


def _angle(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    c = _cross(a, b) if a.shape == b.shape else _cross(*np.broadcast_arrays(a, b))
    return np.arctan2(np.linalg.norm(c, axis=-1), _dot(a, b))


def _pairs_crossing(
    a: np.ndarray,
    b: np.ndarray,
    n1: np.ndarray,
    c: np.ndarray,
    d: np.ndarray,
    n2: np.ndarray,
    margin: float,
) -> np.ndarray:
    """Whether arcs (a, b) and (c, d) (normals n1, n2) cross at a point inside both, each
    end more than ``margin`` (sine) from the other's circle."""
    s_c, s_d = _dot(c, n1), _dot(d, n1)
    s_a, s_b = _dot(a, n2), _dot(b, n2)
    # S2's CrossingSign: sign(abd) == -sign(abc) == -sign(cdb) == sign(cda).
    positive = (s_d > margin) & (s_c < -margin) & (s_b < -margin) & (s_a > margin)
    negative = (s_d < -margin) & (s_c > margin) & (s_b > margin) & (s_a < -margin)
    return positive | negative


def _boxes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Axis-aligned 3-D boxes around arcs (a, b): the ends' box widened by the arc's
    sagitta (how far it bows from its chord) and the touching distance."""
    half_chord = np.linalg.norm(a - b, axis=1) / 2.0
    sagitta = 1.0 - np.sqrt(np.maximum(0.0, 1.0 - half_chord * half_chord))
    pad = (sagitta + 4.0 * _SAME_POINT_RAD)[:, None]
    return np.minimum(a, b) - pad, np.maximum(a, b) + pad


def _candidate_pairs(lo: np.ndarray, hi: np.ndarray) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """Pairs (i, j), i < j, of boxes that overlap, in blocks: a sweep along the axis
    where the boxes spread most, each pair then checked on all three."""
    axis = int(np.argmax(hi.max(axis=0) - lo.min(axis=0)))
    order = np.argsort(lo[:, axis], kind="stable")
    lo_x = lo[order, axis]
    ends = np.searchsorted(lo_x, hi[order, axis], side="right")
    counts = np.maximum(ends - np.arange(order.shape[0]) - 1, 0)
    block = 1 << 20
    first = 0
    while first < order.shape[0]:
        total = np.cumsum(counts[first:])
        last = first + max(1, int(np.searchsorted(total, block, side="right")))
        pos = np.repeat(np.arange(first, last), counts[first:last])
        if pos.size:
            offsets = np.cumsum(counts[first:last]) - counts[first:last]
            other = pos + 1 + (np.arange(pos.size) - np.repeat(offsets, counts[first:last]))
            i, j = order[pos], order[other]
            overlap = np.all((lo[i] <= hi[j]) & (lo[j] <= hi[i]), axis=1)
            i, j = i[overlap], j[overlap]
            yield np.minimum(i, j), np.maximum(i, j)
        first = last


def _check_simple(
    vertices: np.ndarray,
    following: np.ndarray,
    normals: np.ndarray,
    ring_start: np.ndarray,
    k: int,
    name: str,
) -> None:
    """No two edges of ring k touch or cross, except neighbours at their shared vertex,
    and the ring does not fold back at a vertex."""
    lo, hi = int(ring_start[k]), int(ring_start[k + 1])
    size = hi - lo
    a, b, n = vertices[lo:hi], vertices[following[lo:hi]], normals[lo:hi]
    # Folding back: the next vertex on this edge, or this edge's start on the next edge.
    nxt = (np.arange(size) + 1) % size
    fold_next = _arc_distance_rows(b[nxt], a, b, n) <= _SAME_POINT_RAD
    fold_back = _arc_distance_rows(a, a[nxt], b[nxt], n[nxt]) <= _SAME_POINT_RAD
    folds = np.flatnonzero(fold_next | fold_back)
    if folds.size:
        raise InvalidArea(f"{name} folds back over itself at vertex {(int(folds[0]) + 1) % size}")
    box_lo, box_hi = _boxes(a, b)
    for i, j in _candidate_pairs(box_lo, box_hi):
        apart = (j - i > 1) & ~((i == 0) & (j == size - 1))
        i, j = i[apart], j[apart]
        if not i.size:
            continue
        crossing = _pairs_crossing(a[i], b[i], n[i], a[j], b[j], n[j], 0.0)
        touching = (
            (_arc_distance_rows(a[j], a[i], b[i], n[i]) <= _SAME_POINT_RAD)
            | (_arc_distance_rows(b[j], a[i], b[i], n[i]) <= _SAME_POINT_RAD)
            | (_arc_distance_rows(a[i], a[j], b[j], n[j]) <= _SAME_POINT_RAD)
            | (_arc_distance_rows(b[i], a[j], b[j], n[j]) <= _SAME_POINT_RAD)
        )
        bad = np.flatnonzero(crossing | touching)
        if bad.size:
            raise InvalidArea(
                f"{name} intersects itself: edges {int(i[bad[0]])} and {int(j[bad[0]])} "
                "(counting from its first vertex) meet"
            )


def _check_rings_apart(
    vertices: np.ndarray,
    following: np.ndarray,
    normals: np.ndarray,
    ring_start: np.ndarray,
    rings: Sequence[int],
    names: Sequence[str],
) -> None:
    """No edge of one ring of a polygon (``rings``: its first and end ring) crosses an
    edge of another (touching is allowed)."""
    first_ring, end_ring = int(rings[0]), int(rings[1])
    if end_ring - first_ring < 2:
        return
    lo, hi = int(ring_start[first_ring]), int(ring_start[end_ring])
    a, b, n = vertices[lo:hi], vertices[following[lo:hi]], normals[lo:hi]
    ring = np.repeat(
        np.arange(first_ring, end_ring), np.diff(ring_start[first_ring : end_ring + 1])
    )
    box_lo, box_hi = _boxes(a, b)
    for i, j in _candidate_pairs(box_lo, box_hi):
        other = ring[i] != ring[j]
        i, j = i[other], j[other]
        crossing = _pairs_crossing(a[i], b[i], n[i], a[j], b[j], n[j], _SAME_POINT_RAD)
        bad = np.flatnonzero(crossing)
        if bad.size:
            r1, r2 = sorted((int(ring[i[bad[0]]]), int(ring[j[bad[0]]])))
            raise InvalidArea(f"{names[r1]} and {names[r2]} cross each other")


def _arc_distance_rows(x: np.ndarray, a: np.ndarray, b: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Angle (radians) from each point x[i] to arc (a[i], b[i]) with normal n[i]: (m,)."""
    sine = np.abs(_dot(x, n))
    between = (_dot(x, _cross(n, a)) >= 0) & (_dot(x, _cross(n, b)) <= 0)
    ends = np.minimum(_angle(x, a), _angle(x, b))
    return np.where(between, np.arcsin(np.minimum(sine, 1.0)), ends)


def _left_area(ring: np.ndarray) -> float:
    """Area (steradians) of the region left of a simple ring (k, 3), by Gauss-Bonnet: 2 pi
    less the sum of the turns at its vertices (left turns positive)."""
    nxt = np.roll(ring, -1, axis=0)
    prv = np.roll(ring, 1, axis=0)
    n_out = _unit(_robust_cross(ring, nxt))
    n_in = _unit(_robust_cross(prv, ring))
    t_in = _cross(n_in, ring)
    t_out = _cross(n_out, ring)
    turn = np.arctan2(_dot(_cross(t_in, t_out), ring), _dot(t_in, t_out))
    return float(_TWO_PI - turn.sum())


def _point_left_of(ring: np.ndarray, normals: np.ndarray, name: str) -> np.ndarray:
    """A point in the ring's left side: just left of the middle of the edge with the most
    room, closer to it than to any other edge of the ring."""
    nxt = np.roll(ring, -1, axis=0)
    length = _angle(ring, nxt)
    candidates = np.argsort(-length, kind="stable")[:16]
    middles = _unit(ring[candidates] + nxt[candidates])
    distance = _arc_distance(middles, ring, nxt, normals)
    distance[np.arange(candidates.shape[0]), candidates] = np.inf
    room = np.minimum(distance.min(axis=1), length[candidates] / 2.0)
    best = int(np.argmax(room))
    if room[best] < _MIN_CLEARANCE_RAD:
        raise InvalidArea(f"{name} is too narrow everywhere to tell its inside from its outside")
    step = room[best] / 2.0
    point = math.cos(step) * middles[best] + math.sin(step) * normals[candidates[best]]
    return np.asarray(point / np.linalg.norm(point))


def _fibonacci_sphere(count: int) -> np.ndarray:
    i = np.arange(count) + 0.5
    z = 1.0 - 2.0 * i / count
    phi = math.pi * (3.0 - math.sqrt(5.0)) * i + 0.1
    r = np.sqrt(1.0 - z * z)
    return np.column_stack([r * np.cos(phi), r * np.sin(phi), z])


_CANDIDATES = _fibonacci_sphere(128)


def _reference_points(normals: np.ndarray) -> np.ndarray:
    """Two points far from every edge's great circle, 60 to 120 degrees apart (2, 3)."""
    room = np.abs(_CANDIDATES @ normals.T).min(axis=1)
    first = int(np.argmax(room))
    apart = np.abs(_CANDIDATES @ _CANDIDATES[first]) <= 0.5
    second = int(np.argmax(np.where(apart, room, -1.0)))
    return _CANDIDATES[[first, second]].copy()


def _edge_latitude_range(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Lowest and highest latitude (degrees) reached by arcs (a, b): their ends, and the
    top or bottom of their great circle where that lies on the arc."""
    z = np.concatenate([a[:, 2], b[:, 2]])
    n = _unit(_robust_cross(a, b))
    top = np.array([0.0, 0.0, 1.0]) - n[:, 2:3] * n
    norm = np.linalg.norm(top, axis=1, keepdims=True)
    ok = norm[:, 0] > 1e-12  # an equator-like circle: no single top
    top = np.where(ok[:, None], top / np.where(norm > 0, norm, 1.0), 0.0)
    for extreme in (top, -top):
        on_arc = ok & (_dot(extreme, _cross(n, a)) >= 0) & (_dot(extreme, _cross(n, b)) <= 0)
        z = np.concatenate([z, extreme[on_arc, 2]])
    lat = np.degrees(np.arcsin(np.clip(z, -1.0, 1.0)))
    return float(lat.min()), float(lat.max())


def _ring_longitude_span(ring: np.ndarray) -> tuple[float, float]:
    """(start, width) in degrees of the longitudes a ring's edges cover, its path's
    longitudes unwrapped (no pole on or in the ring: its edges each turn less than 180)."""
    lon = np.degrees(np.arctan2(ring[:, 1], ring[:, 0]))
    step = np.diff(lon, append=lon[:1])
    step = (step + 180.0) % 360.0 - 180.0
    path = lon[0] + np.concatenate([[0.0], np.cumsum(step[:-1])])
    return float(path.min()), float(path.max() - path.min())


def _covering_interval(intervals: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """The shortest (start, width) interval of longitudes covering every (start, width)
    interval: the complement of the largest gap between them; None for all of them."""
    if any(width >= 360.0 for _, width in intervals):
        return None
    spans = sorted(((start % 360.0), width) for start, width in intervals)
    merged: list[list[float]] = []
    for start, width in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], start + width - merged[-1][0])
        else:
            merged.append([start, width])
    # The last may run past 360 over the first ones.
    while len(merged) > 1 and merged[-1][0] + merged[-1][1] - 360.0 >= merged[0][0]:
        first = merged.pop(0)
        last = merged[-1]
        last[1] = max(last[1], first[0] + 360.0 + first[1] - last[0])
    if merged[-1][1] >= 360.0:
        return None
    gaps = [
        ((merged[(i + 1) % len(merged)][0] - (s + w)) % 360.0, i) for i, (s, w) in enumerate(merged)
    ]
    if len(merged) == 1:
        return merged[0][0], merged[0][1]
    widest, before_gap = max(gaps)
    if widest <= 0.0:
        return None
    start = merged[(before_gap + 1) % len(merged)][0]
    end = merged[before_gap][0] + merged[before_gap][1]
    return start, (end - start) % 360.0


def _wrap_lon(lon: float) -> float:
    """A longitude in [-180, 180] (180 kept as 180)."""
    wrapped = (lon + 180.0) % 360.0 - 180.0
    return 180.0 if wrapped == -180.0 and lon > 0 else wrapped


# -- GeoJSON --------------------------------------------------------------------------


def _geojson_polygons(geojson: Any) -> list[list[Ring]]:
    if isinstance(geojson, str | bytes | bytearray):
        try:
            geojson = json.loads(geojson)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidArea(f"the area is not valid JSON: {exc}") from None
    if not isinstance(geojson, Mapping) and hasattr(geojson, "__geo_interface__"):
        geojson = geojson.__geo_interface__
    if not isinstance(geojson, Mapping):
        raise InvalidArea(
            "expected a GeoJSON Polygon or MultiPolygon (a mapping or its text), WKB bytes "
            f"or a geometry with __geo_interface__; got {type(geojson).__name__}"
        )
    kind = geojson.get("type")
    if kind == "Feature":
        return _geojson_polygons(geojson.get("geometry"))
    if kind not in ("Polygon", "MultiPolygon"):
        raise InvalidArea(
            f"expected a GeoJSON Polygon or MultiPolygon (or a Feature of one), got type {kind!r}"
        )
    coordinates = geojson.get("coordinates")
    if not isinstance(coordinates, Sequence) or isinstance(coordinates, str):
        raise InvalidArea(f"the {kind}'s coordinates must be an array")
    polygons = [coordinates] if kind == "Polygon" else list(coordinates)
    if not polygons:
        raise InvalidArea("the MultiPolygon has no polygons")
    out = []
    for j, rings in enumerate(polygons):
        if not isinstance(rings, Sequence) or isinstance(rings, str):
            raise InvalidArea(f"polygon {j}: its coordinates must be an array of rings")
        out.append(
            [_geojson_ring(ring, _ring_name(j, k, len(polygons))) for k, ring in enumerate(rings)]
        )
    return out


def _geojson_ring(positions: Any, name: str) -> Ring:
    try:
        rows = [tuple(float(v) for v in position[:2]) for position in positions]
    except (TypeError, ValueError) as exc:
        raise InvalidArea(
            f"{name}: positions must be [longitude, latitude] numbers ({exc})"
        ) from None
    if any(len(row) != 2 for row in rows):
        raise InvalidArea(f"{name}: every position needs a longitude and a latitude")
    return _closed_ring(np.array(rows, dtype=np.float64).reshape(-1, 2), name)


def _closed_ring(lon_lat: np.ndarray, name: str) -> Ring:
    """(lat, lon) of a closed ring given as (longitude, latitude) rows, the repeat dropped."""
    if not np.isfinite(lon_lat).all():
        raise InvalidArea(f"{name}: coordinates must be finite")
    if lon_lat.shape[0] < 4:
        raise InvalidArea(
            f"{name} has {lon_lat.shape[0]} positions; a closed ring needs at least 4 "
            "(3 distinct vertices and the first repeated at the end)"
        )
    if not np.array_equal(lon_lat[0], lon_lat[-1]):
        raise InvalidArea(
            f"{name} is not closed: its first position {lon_lat[0].tolist()} differs from "
            f"its last {lon_lat[-1].tolist()}"
        )
    return lon_lat[:-1, 1].copy(), lon_lat[:-1, 0].copy()


# -- WKB ------------------------------------------------------------------------------

_WKB_POLYGON = 3
_WKB_MULTIPOLYGON = 6
_EWKB_Z, _EWKB_M, _EWKB_SRID = 0x80000000, 0x40000000, 0x20000000


class _WkbReader:
    """Polygons from WKB (ISO or PostGIS EWKB), read with struct."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def area(self) -> list[list[Ring]]:
        kind, order, dims = self._header()
        if kind == _WKB_POLYGON:
            polygons = [self._polygon_body(order, dims, 0, 1)]
        elif kind == _WKB_MULTIPOLYGON:
            count = self._uint(order)
            polygons = []
            for j in range(count):
                inner, inner_order, inner_dims = self._header()
                if inner != _WKB_POLYGON:
                    raise InvalidArea(
                        f"WKB MultiPolygon member {j} is of type {inner}, not Polygon"
                    )
                polygons.append(self._polygon_body(inner_order, inner_dims, j, count))
            if not polygons:
                raise InvalidArea("the WKB MultiPolygon has no polygons")
        else:
            raise InvalidArea(f"expected a WKB Polygon (3) or MultiPolygon (6), got type {kind}")
        if self.pos != len(self.data):
            raise InvalidArea(f"WKB has {len(self.data) - self.pos} bytes after the geometry")
        return polygons

    def _take(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise InvalidArea(f"WKB ends early, at byte {len(self.data)} of {self.pos + size}")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def _uint(self, order: str) -> int:
        value: int = struct.unpack(order + "I", self._take(4))[0]
        return value

    def _header(self) -> tuple[int, str, int]:
        """(base type, struct byte order, values a position)."""
        flag = self._take(1)[0]
        if flag not in (0, 1):
            raise InvalidArea(f"WKB byte order must be 0 or 1, got {flag}")
        order = "<" if flag == 1 else ">"
        code = self._uint(order)
        has_z, has_m = bool(code & _EWKB_Z), bool(code & _EWKB_M)
        if code & _EWKB_SRID:
            srid = self._uint(order)
            if srid not in (0, 4326):
                raise InvalidArea(
                    f"WKB SRID {srid}: only longitude/latitude on WGS84 (4326) is read"
                )
        code &= 0x0FFFFFFF
        iso, kind = divmod(code, 1000)
        if iso > 3:
            raise InvalidArea(f"unknown WKB geometry type {code}")
        has_z = has_z or iso in (1, 3)
        has_m = has_m or iso in (2, 3)
        return kind, order, 2 + has_z + has_m

    def _polygon_body(self, order: str, dims: int, j: int, count: int) -> list[Ring]:
        n_rings = self._uint(order)
        rings = []
        for k in range(n_rings):
            n_points = self._uint(order)
            size = 8 * dims * n_points
            if self.pos + size > len(self.data):
                raise InvalidArea(f"WKB ends early: a ring of {n_points} positions is cut short")
            values = np.frombuffer(self._take(size), dtype=np.dtype(order + "f8"))
            lon_lat = values.reshape(n_points, dims)[:, :2].astype(np.float64)
            rings.append(_closed_ring(lon_lat, _ring_name(j, k, count)))
        return rings
