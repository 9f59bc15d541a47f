"""Exactness of a bench answer against the float64 reference, one check per operation.

Each check takes the engine's answer and the reference (computed by ``bench`` on the
first ``ref_queries`` queries) and returns ``(metrics, exact)``: a dict for the JSON and
a verdict (None where exactness does not apply). The rule is docs/design.md's: the same rows
in the same order, except among neighbours whose distances differ by less than 1 mm, and
distances within 1 mm. An engine's distances are never trusted to judge its own rows:
every returned row is re-measured with the reference formula, so an engine that returns
wrong rows with plausible distances is still caught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from geonear.geometry import EARTH_RADIUS_M, great_circle_m, unit_vectors
from geonear.service.engines import KMeansResult, Neighbours, RadiusNeighbours

#: The exactness rule's tolerance, metres.
TIE_M = 1e-3
#: What float32 matrices are held to: their precision allows about 3-4 m at long range.
FLOAT32_MATRIX_TOLERANCE_M = 5.0
#: k-means answers whose inertia differs from the cpu engine's by more than this fail.
KMEANS_INERTIA_RTOL = 1e-6


def _true_distances(q_lat: np.ndarray, q_lon: np.ndarray, rows: np.ndarray, data: Any) -> Any:
    """Reference metres from each query to the row an engine returned; inf for a bad row."""
    n = data.lat.shape[0]
    valid = (rows >= 0) & (rows < n)
    safe = np.where(valid, rows, 0)
    dist = great_circle_m(q_lat, q_lon, data.lat[safe], data.lon[safe], EARTH_RADIUS_M)
    return np.where(valid, dist, np.inf)


def _first_occurrence(rows: np.ndarray) -> np.ndarray:
    """Per (n, k) row, True where an id appears for the first time (duplicates are wrong)."""
    first = np.ones(rows.shape, dtype=bool)
    for j in range(1, rows.shape[1]):
        first[:, j] = ~(rows[:, :j] == rows[:, j : j + 1]).any(axis=1)
    return first


def _max_error(*gaps: np.ndarray) -> float:
    finite = [g[np.isfinite(g)] for g in gaps]
    values = [float(g.max()) for g in finite if g.size]
    return max(values, default=0.0)


def knn_exactness(out: Neighbours, ref: Neighbours, *, data: Any, **_: Any) -> tuple[dict, bool]:
    """Recall, order agreement and distance error of a KNN answer."""
    r = min(ref.indices.shape[0], out.indices.shape[0])
    got_i, got_d = np.asarray(out.indices[:r], np.int64), np.asarray(out.distances_m[:r], float)
    ref_i, ref_d = ref.indices[:r], ref.distances_m[:r]
    q_lat, q_lon = data.q_lat[:r, None], data.q_lon[:r, None]
    true_d = _true_distances(q_lat, q_lon, got_i, data)
    ref_valid, got_valid = ref_i >= 0, got_i >= 0
    # A returned row is right if the reference has it, or if it is as near as the
    # reference's k-th neighbour (a tie the reference broke differently).
    kth = np.where(np.isfinite(ref_d), ref_d, -np.inf).max(axis=1, initial=-np.inf)
    member = ((got_i[:, :, None] == ref_i[:, None, :]) & ref_valid[:, None, :]).any(axis=2)
    right = (member | (true_d <= kth[:, None] + TIE_M)) & _first_occurrence(got_i) & got_valid
    n_ref = int(ref_valid.sum())
    hits = np.minimum(right.sum(axis=1), ref_valid.sum(axis=1)).sum()
    recall = float(hits / n_ref) if n_ref else 1.0
    wrong = int((got_valid & ~right).sum())
    kk = min(got_i.shape[1], ref_i.shape[1])
    with np.errstate(invalid="ignore"):  # inf - inf where both are missing
        same = (got_i[:, :kk] == ref_i[:, :kk]) | (np.abs(true_d[:, :kk] - ref_d[:, :kk]) <= TIE_M)
        rank_gap = np.abs(got_d[:, :kk] - ref_d[:, :kk])
    order = float(same.sum() / ref_i.size) if ref_i.size else 1.0
    with np.errstate(invalid="ignore"):  # inf - inf where a row is missing
        max_error_m = _max_error(np.abs(got_d - true_d)[got_valid], rank_gap)
    metrics = {
        "queries_checked": r,
        "recall": recall,
        "order_agreement": order,
        "wrong_rows": wrong,
        "max_distance_error_m": max_error_m,
    }
    exact = (
        out.indices.shape[1] == ref.indices.shape[1]
        and recall == 1.0
        and order == 1.0
        and wrong == 0
        and max_error_m <= TIE_M
    )
    return metrics, bool(exact)


def _first_queries(res: RadiusNeighbours, r: int) -> tuple[np.ndarray, ...]:
    """(query_index, rank, rows, distances_m) of the results of the first r queries."""
    offsets = np.asarray(res.offsets[: r + 1], np.int64)
    end = int(offsets[-1])
    query = np.repeat(np.arange(r, dtype=np.int64), np.diff(offsets))
    rank = np.arange(end, dtype=np.int64) - offsets[query]
    return (
        query,
        rank,
        np.asarray(res.indices[:end], np.int64),
        np.asarray(res.distances_m[:end], float),
    )


def _mean_neighbours(res: RadiusNeighbours) -> float:
    """Neighbours per query over all the queries an engine answered."""
    n_q = res.offsets.shape[0] - 1
    return float(res.offsets[-1] / n_q) if n_q else 0.0


def radius_exactness(
    out: RadiusNeighbours, ref: RadiusNeighbours, *, data: Any, config: Any, **_: Any
) -> tuple[dict, bool]:
    """Recall, wrong rows, order agreement and distance error of a radius answer."""
    r = min(ref.offsets.shape[0], out.offsets.shape[0]) - 1
    n = data.lat.shape[0]
    rq, rrank, ri, rd = _first_queries(ref, r)
    gq, grank, gi, gd = _first_queries(out, r)
    true_d = _true_distances(data.q_lat[gq], data.q_lon[gq], gi, data)
    ref_keys, got_keys = rq * n + ri, gq * n + np.clip(gi, 0, n - 1)
    found = np.isin(ref_keys, got_keys[np.isfinite(true_d)])
    # Points within 1 mm of the boundary may fall either side of it.
    on_boundary = rd >= config.radius_m - TIE_M
    recall = float((found | on_boundary).sum() / rd.size) if rd.size else 1.0
    unique = np.zeros(gi.shape, dtype=bool)
    unique[np.unique(got_keys, return_index=True)[1]] = True
    outside = ~np.isin(got_keys, ref_keys) & ~(true_d <= config.radius_m + TIE_M)
    wrong = int((outside | ~unique).sum())
    # Order: the entry at the same (query, rank) names the same row, or one as far away.
    width = int(max(rrank.max(initial=0), grank.max(initial=0))) + 1
    ref_pos, got_pos = rq * width + rrank, gq * width + grank
    at = np.clip(np.searchsorted(got_pos, ref_pos), 0, max(0, got_pos.size - 1))
    matched = (got_pos[at] == ref_pos) if got_pos.size else np.zeros(ref_pos.shape, bool)
    same = matched & ((gi[at] == ri) | (np.abs(true_d[at] - rd) <= TIE_M)) if gi.size else matched
    order = float(same.sum() / rd.size) if rd.size else 1.0
    rank_gap = np.abs(gd[at] - rd)[matched] if gi.size else np.zeros(0)
    max_error_m = _max_error(np.abs(gd - true_d), rank_gap)
    metrics = {
        "queries_checked": r,
        "recall": recall,
        "order_agreement": order,
        "wrong_rows": wrong,
        "max_distance_error_m": max_error_m,
        "mean_neighbours": _mean_neighbours(out),
    }
    exact = recall == 1.0 and order == 1.0 and wrong == 0 and max_error_m <= TIE_M
    return metrics, bool(exact)


def matrix_exactness(
    out: np.ndarray, ref: np.ndarray, *, config: Any, **_: Any
) -> tuple[dict, bool]:
    """Largest absolute error, metres, of the first reference rows of a distance matrix."""
    r = min(ref.shape[0], out.shape[0])
    tolerance = TIE_M if config.dtype == "float64" else FLOAT32_MATRIX_TOLERANCE_M
    if out.shape[1:] != ref.shape[1:]:
        return {"rows_checked": r, "max_abs_error_m": float("inf"), "tolerance_m": tolerance}, False
    error = np.abs(np.asarray(out[:r], dtype=np.float64) - ref[:r])
    max_error_m = float(np.nanmax(error, initial=0.0)) if not np.isnan(error).any() else np.inf
    metrics = {"rows_checked": r, "max_abs_error_m": max_error_m, "tolerance_m": tolerance}
    return metrics, bool(max_error_m <= tolerance)


def kmeans_exactness(
    out: KMeansResult | dict, ref: KMeansResult, *, engine: Any, **_: Any
) -> tuple[dict, bool | None]:
    """Inertia and labels of a k-means answer against the cpu engine's, from the same seed."""
    if isinstance(out, dict):  # the scikit-learn baseline: Euclidean, not expected to match
        labels, inertia, n_iter = out["labels"], out["inertia_m2"], out["n_iter"]
    else:
        labels, inertia, n_iter = out.labels, out.inertia_m2, out.n_iter
    metrics = {
        "inertia_m2": float(inertia),
        "inertia_rel_diff": abs(float(inertia) - ref.inertia_m2) / max(ref.inertia_m2, 1e-300),
        "label_agreement": float(np.mean(np.asarray(labels) == ref.labels)),
        "n_iter": int(n_iter),
        "reference_n_iter": int(ref.n_iter),
    }
    if isinstance(out, dict):
        return metrics, None
    return metrics, bool(metrics["inertia_rel_diff"] <= KMEANS_INERTIA_RTOL)


def build_metrics(out: Any, ref: Any, *, index: Any, **_: Any) -> tuple[dict, None]:
    """Memory held by a built index (exactness does not apply to a build)."""
    return {
        "host_mib": index.host_bytes / 2**20,
        "device_mib": getattr(index, "device_bytes", 0) / 2**20,
    }, None


# -- the analytics ops ----------------------------------------------------------------


def neighbours_from_rows(
    query: np.ndarray, rank: np.ndarray, ids: np.ndarray, distances_m: np.ndarray, shape: tuple
) -> Neighbours:
    """Result rows (query or left position, rank, id, distance) as a (queries, k) answer.

    Ids are row numbers where the bench uploaded ``id = row``. Rows out of ``shape``
    are dropped and missing ranks stay -1 / inf, so the check counts them as wrong.
    """
    n_q, k = shape
    indices = np.full(shape, -1, dtype=np.int64)
    distances = np.full(shape, np.inf)
    query, rank = np.asarray(query, np.int64), np.asarray(rank, np.int64)
    inside = (query >= 0) & (query < n_q) & (rank >= 0) & (rank < k)
    indices[query[inside], rank[inside]] = np.asarray(ids, np.int64)[inside]
    distances[query[inside], rank[inside]] = np.asarray(distances_m, float)[inside]
    return Neighbours(distances, indices)


def count_exactness(
    counts: np.ndarray, low: np.ndarray, high: np.ndarray, n_queries: int
) -> tuple[dict, bool]:
    """Counts of the first queries against the reference's at radius -/+ 1 mm.

    ``low`` and ``high`` are the reference counts at ``radius_m - TIE_M`` and
    ``radius_m + TIE_M``: a point within 1 mm of the boundary may be counted or not.
    """
    counts = np.asarray(counts, np.int64)
    r = min(low.shape[0], counts.shape[0])
    got = counts[:r]
    wrong = int(((got < low[:r]) | (got > high[:r])).sum()) + (low.shape[0] - r)
    metrics = {
        "queries_checked": int(low.shape[0]),
        "wrong_counts": wrong,
        "answered": int(counts.shape[0]),
        "mean_count": float(counts.mean()) if counts.size else 0.0,
    }
    return metrics, bool(wrong == 0 and counts.shape[0] == n_queries)


def _clusters(labels: np.ndarray) -> int:
    return int(np.unique(labels[labels >= 0]).size)


def label_agreement(labels: np.ndarray, reference: np.ndarray) -> float:
    """Share of points whose label is the reference's, up to relabelling.

    Each cluster of ``labels`` stands for the reference label most of its points carry;
    noise (-1) stands for noise only.
    """
    labels, reference = np.asarray(labels, np.int64), np.asarray(reference, np.int64)
    if labels.shape != reference.shape:
        return 0.0
    if not labels.size:
        return 1.0
    pairs, counts = np.unique(np.stack([labels, reference]), axis=1, return_counts=True)
    order = np.lexsort((-counts, pairs[0]))  # per label, its most common reference first
    first = np.r_[True, pairs[0, order][1:] != pairs[0, order][:-1]]
    chosen = order[first]  # one entry per label, in label order
    stand_for = pairs[1, chosen][np.searchsorted(pairs[0, chosen], labels)]
    stand_for[labels == -1] = -1
    return float(np.mean(stand_for == reference))


def dbscan_exactness(
    labels: np.ndarray, reference: np.ndarray, reference_core: np.ndarray
) -> tuple[dict, bool]:
    """DBSCAN labels against scikit-learn's on the same points, up to relabelling.

    Exact when the noise is the same points, the clusters are as many, and the core
    points (``reference_core``, a mask) fall in the same groups under a one-to-one
    relabelling. Border points are not judged: scikit-learn gives one between two
    clusters the first that reaches it, geonear the one of its lowest-row core
    neighbour (docs/design.md).
    """
    labels, reference = np.asarray(labels, np.int64), np.asarray(reference, np.int64)
    metrics: dict[str, Any] = {
        "points_checked": int(reference.shape[0]),
        "n_clusters": _clusters(labels),
        "reference_clusters": _clusters(reference),
        "noise_share": float(np.mean(labels == -1)) if labels.size else 0.0,
        "label_agreement": label_agreement(labels, reference),
    }
    if labels.shape != reference.shape:
        return {**metrics, "noise_differs": -1, "core_groups_differ": -1}, False
    core_pairs = np.unique(np.stack([reference[reference_core], labels[reference_core]]), axis=1)
    one_to_one = (
        np.unique(core_pairs[0]).size == core_pairs.shape[1] == np.unique(core_pairs[1]).size
    )
    noise_differs = int(((labels == -1) != (reference == -1)).sum())
    core_noise = int((labels[reference_core] == -1).sum())
    metrics["noise_differs"] = noise_differs
    metrics["core_groups_differ"] = 0 if one_to_one and not core_noise else 1
    exact = (
        noise_differs == 0
        and one_to_one
        and not core_noise
        and metrics["n_clusters"] == metrics["reference_clusters"]
    )
    return metrics, bool(exact)


@dataclass(frozen=True)
class StarPolygon:
    """A star-shaped spherical polygon around a centre, and its own point-in-polygon test.

    Vertex j lies at bearing ``360 j / vertices`` degrees from the centre, alternately
    ``outer_deg`` and ``inner_deg`` of arc away; edges are great-circle arcs. Every point
    of it sees the centre, so it is the union of the triangles (centre, vertex j,
    vertex j+1): a point is inside when it is on the inner side of the three great
    circles of one of them. That test is written here, independently of the service's
    crossing count, as the float64 reference of ``--op within``.
    """

    centre_lat: float
    centre_lon: float
    vertices: int
    outer_deg: float
    inner_deg: float

    def _frame(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lat, lon = np.radians(self.centre_lat), np.radians(self.centre_lon)
        centre = np.array([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)])
        north = np.array([-np.sin(lat) * np.cos(lon), -np.sin(lat) * np.sin(lon), np.cos(lat)])
        east = np.array([-np.sin(lon), np.cos(lon), 0.0])
        return centre, north, east

    def vertex_vectors(self) -> np.ndarray:
        """Unit vectors of the vertices, shape (vertices, 3), in bearing order."""
        centre, north, east = self._frame()
        bearing = 2.0 * np.pi * np.arange(self.vertices) / self.vertices
        outer = np.arange(self.vertices) % 2 == 0
        arc = np.radians(np.where(outer, self.outer_deg, self.inner_deg))
        towards = np.cos(bearing)[:, None] * north + np.sin(bearing)[:, None] * east
        return np.cos(arc)[:, None] * centre + np.sin(arc)[:, None] * towards

    def geojson(self) -> dict[str, Any]:
        """The polygon as a GeoJSON Polygon (longitude first, ring closed)."""
        v = self.vertex_vectors()
        lat = np.degrees(np.arctan2(v[:, 2], np.hypot(v[:, 0], v[:, 1])))
        lon = np.degrees(np.arctan2(v[:, 1], v[:, 0]))
        ring = [[float(x), float(y)] for x, y in zip(lon, lat, strict=True)]
        return {"type": "Polygon", "coordinates": [[*ring, ring[0]]]}

    def _inward_normals(self) -> np.ndarray:
        """Per triangle (centre, v_j, v_j+1), its three edges' unit normals pointing in:
        shape (vertices, 3 edges, 3)."""
        centre, _, _ = self._frame()
        v = self.vertex_vectors()
        a = np.broadcast_to(centre, v.shape)
        b, c = v, np.roll(v, -1, axis=0)
        normals = []
        for x, y, opposite in ((a, b, c), (b, c, a), (c, a, b)):
            n = np.cross(x, y)
            n /= np.linalg.norm(n, axis=1)[:, None]
            normals.append(n * np.sign(np.einsum("ij,ij->i", n, opposite))[:, None])
        return np.stack(normals, axis=1)

    def inside(self, lat: np.ndarray, lon: np.ndarray, margin_rad: float = 0.0) -> np.ndarray:
        """Whether each point is inside, by more than ``margin_rad`` of arc (a negative
        margin takes in points just outside); bool of shape (n,)."""
        _, north, east = self._frame()
        normals = self._inward_normals()
        points = unit_vectors(np.asarray(lat, float), np.asarray(lon, float))
        bearing = np.arctan2(points @ east, points @ north) % (2.0 * np.pi)
        wedge = (bearing // (2.0 * np.pi / self.vertices)).astype(np.int64) % self.vertices
        found = np.zeros(points.shape[0], dtype=bool)
        # The wedges beside a point's bearing too: rounding may put it one off.
        for shift in (-1, 0, 1):
            side = np.einsum("ij,ikj->ik", points, normals[(wedge + shift) % self.vertices])
            found |= (np.arcsin(np.clip(side, -1.0, 1.0)) > margin_rad).all(axis=1)
        return found


#: Arc (radians, about 6 cm) within which a point may be either side of a polygon's
#: edge: above the service's edge tolerance (1e-9 rad) and float64 rounding.
AREA_TOLERANCE_RAD = 1e-8


def within_exactness(
    ids: np.ndarray, polygon: StarPolygon, data: Any, checked: int
) -> tuple[dict, bool]:
    """The ids a within call returned, against the reference on the first ``checked``
    points (ids are row numbers): every point surely inside found, none surely outside,
    none twice, in row order."""
    ids = np.asarray(ids, np.int64)
    lat, lon = data.lat[:checked], data.lon[:checked]
    surely = polygon.inside(lat, lon, AREA_TOLERANCE_RAD)
    maybe = polygon.inside(lat, lon, -AREA_TOLERANCE_RAD)
    got = np.zeros(checked, dtype=bool)
    mine = ids[(ids >= 0) & (ids < checked)]
    got[mine] = True
    repeated = int(mine.size - np.unique(mine).size)
    missed, extra = int((surely & ~got).sum()), int((got & ~maybe).sum())
    in_order = bool(np.all(np.diff(ids) > 0))
    metrics = {
        "points_checked": int(checked),
        "n_inside": int(ids.size),
        "reference_inside": int(surely.sum()),
        "wrong_points": missed + extra + repeated,
        "in_row_order": in_order,
    }
    return metrics, bool(metrics["wrong_points"] == 0 and in_order)


#: The check of each operation: (answer, reference, **context) -> (columns, exact).
EXACTNESS: dict[str, Callable[..., tuple[dict[str, Any], bool | None]]] = {
    "knn": knn_exactness,
    "radius": radius_exactness,
    "matrix": matrix_exactness,
    "kmeans": kmeans_exactness,
    "build": build_metrics,
}
