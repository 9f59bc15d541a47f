"""DBSCAN on the sphere: density clusters of points by exact great-circle distance.

Definition (scikit-learn's DBSCAN, its haversine metric replaced by the float64
great-circle distance of ``geometry.great_circle_m``, the distance of every engine):

- the neighbourhood of point i is every point j, i itself included, with
  ``great_circle_m(lat[i], lon[i], lat[j], lon[j]) <= eps_m``: what
  ``PointIndex.radius`` returns with point i as the query;
- point i is a *core* point when its neighbourhood holds at least ``min_samples`` points;
- clusters are the connected components of the core points, two core points being
  joined when either is in the other's neighbourhood (the distance is symmetric up to
  float64 rounding; where rounding makes the two tests differ, one is enough);
- a point that is not core but has a core point in its neighbourhood is a *border*
  point: it joins the cluster of the core neighbour with the smallest row number. (This
  makes the answer independent of the order of the work; scikit-learn gives it the
  cluster that reaches it first, which differs only for a border point between two
  clusters.)
- every other point is noise, label -1.

Clusters are numbered 0, 1, ... in the order of their smallest row (core or border), so
the first row that is not noise is in cluster 0. The same points give the same labels
on every engine.

Work and memory. Neighbour pairs are counted before any is listed, and a count above
``max_neighbour_pairs`` raises :class:`TooManyNeighbours` (the service answers
RESOURCE_EXHAUSTED), so memory stays bounded by that setting:

- with no index or the CPU engine's, one search of a cKDTree over the unit vectors
  against itself (``count_neighbors`` for the bound, then ``query_pairs``: about five
  times faster than a search a point) gives the candidate pairs within the chord of
  ``eps_m`` (widened by a slack), each measured exactly in both directions;
- with another index, ``PointIndex.radius_count`` counts, in slices so that
  ``should_stop`` is checked between them, then ``radius`` lists slices of about
  ``SLICE_PAIRS`` pairs;
- with a GPU index, the same on the device (``dbscan_gpu``).

Only the links between core points (8 bytes a pair) and each border point's smallest
core neighbour are kept; components come from scipy's ``connected_components`` on the
host and from :func:`min_label_components` on the device.

Shared steps take their array namespace ``xp`` (numpy or cupy), as ``geometry`` does.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
from scipy.sparse import coo_array
from scipy.sparse.csgraph import connected_components
from scipy.spatial import cKDTree

from geonear.geometry import (
    EARTH_RADIUS_M,
    chord_for_distance,
    great_circle_m,
    unit_vectors,
)
from geonear.service.engines.base import PointIndex
from geonear.service.engines.cpu import KDTreeIndex
from geonear.service.engines.host import HostIndex

if TYPE_CHECKING:
    from geonear.service.engines.gpu import GPUIndex

__all__ = [
    "MAX_NEIGHBOUR_PAIRS",
    "DbscanResult",
    "DbscanStopped",
    "TooManyNeighbours",
    "dbscan",
    "min_label_components",
]

#: Default bound on the (point, neighbour) pairs of one run, each point counted in its
#: own neighbourhood: 1M points with 64 neighbours each. The links kept between core
#: points take 8 bytes a pair and their graph about 24 at its peak, so about 1.6 GB here.
MAX_NEIGHBOUR_PAIRS = 1 << 26
#: (point, neighbour) pairs gathered at once on the host (about 16 bytes each).
SLICE_PAIRS = 1 << 22
#: Points counted at once (``should_stop`` is checked between slices).
COUNT_SLICE_POINTS = 1 << 17
#: Relative slack on the chord of eps_m, as the CPU engine's: far above float64
#: rounding, far below 1 mm; candidates within it are measured exactly.
_CHORD_SLACK = 1e-9

ShouldStop = Callable[[], bool] | None


class TooManyNeighbours(ValueError):
    """The neighbourhoods of ``eps_m`` hold more (point, neighbour) pairs than allowed.

    Raised before any neighbour list is made; the service answers RESOURCE_EXHAUSTED.
    ``limit`` is the bound; ``pairs`` the count that passed it: every pair of a host
    tree's search (candidates within the chord of ``eps_m`` widened by a slack of 1e-9,
    so possibly a few more than the exact pairs), or the exact counts of an index's
    slices up to the one that passed the bound.
    """

    def __init__(self, pairs: int, limit: int, eps_m: float) -> None:
        self.pairs = int(pairs)
        self.limit = int(limit)
        self.eps_m = float(eps_m)
        super().__init__(
            f"eps_m={eps_m:g} m gives about {self.pairs:,} or more (point, neighbour) pairs, "
            f"above the limit of {self.limit:,}; use a smaller eps_m or fewer points"
        )


class DbscanStopped(Exception):
    """``should_stop`` returned True: the caller no longer wants the answer."""


@dataclass(frozen=True)
class DbscanResult:
    """DBSCAN answer for n points.

    Attributes
    ----------
    labels : ndarray of int64, shape (n,)
        Cluster of every row, numbered in the order of each cluster's smallest row;
        -1 for noise.
    core : ndarray of bool, shape (n,)
        Whether each row is a core point.
    n_clusters : int
        Number of clusters.
    sizes : ndarray of int64, shape (n_clusters,)
        Points (core and border) in each cluster.
    neighbour_pairs : int
        (point, neighbour) pairs examined, each point counted in its own neighbourhood.
    """

    labels: np.ndarray
    core: np.ndarray
    n_clusters: int
    sizes: np.ndarray
    neighbour_pairs: int

    @property
    def n_noise(self) -> int:
        """Number of noise points."""
        return int(np.count_nonzero(self.labels < 0))


def dbscan(
    lat: np.ndarray,
    lon: np.ndarray,
    eps_m: float,
    min_samples: int,
    *,
    index: PointIndex | None = None,
    earth_radius_m: float = EARTH_RADIUS_M,
    max_neighbour_pairs: int = MAX_NEIGHBOUR_PAIRS,
    should_stop: ShouldStop = None,
) -> DbscanResult:
    """DBSCAN of points on the sphere (see the module docstring for the definition).

    Parameters
    ----------
    lat, lon : array_like of float64, shape (n,)
        The points, degrees, latitude first.
    eps_m : float
        Neighbourhood radius, great-circle metres, > 0.
    min_samples : int
        Points (the point itself included) a neighbourhood needs for a core point, >= 1.
    index : PointIndex, optional
        An index built over exactly these points (a dataset version's), reused for the
        neighbour searches; a GPU index keeps the whole run on the device. Without one,
        a cKDTree over the points' unit vectors is built.
    earth_radius_m : float
        Sphere radius, metres; must equal the index's.
    max_neighbour_pairs : int
        Bound on the (point, neighbour) pairs; above it :class:`TooManyNeighbours` is
        raised before any neighbour list is made.
    should_stop : callable, optional
        Checked between slices of the work; when it returns True,
        :class:`DbscanStopped` is raised.

    Returns
    -------
    DbscanResult
        Host NumPy arrays.

    Raises
    ------
    ValueError
        Bad coordinates or parameters, or an index of other points or another sphere.
    TooManyNeighbours
        ``eps_m`` gives more than ``max_neighbour_pairs`` (point, neighbour) pairs.
    DbscanStopped
        ``should_stop`` returned True.
    """
    lat, lon = _checked_points(lat, lon)
    eps_m = float(eps_m)
    if not (np.isfinite(eps_m) and eps_m > 0):
        raise ValueError(f"eps_m must be a finite number of metres > 0, got {eps_m}")
    if isinstance(min_samples, bool) or int(min_samples) != min_samples or min_samples < 1:
        raise ValueError(f"min_samples must be an integer >= 1, got {min_samples!r}")
    min_samples = int(min_samples)
    if int(max_neighbour_pairs) < 1:
        raise ValueError(f"max_neighbour_pairs must be >= 1, got {max_neighbour_pairs}")
    # Every point is in its own neighbourhood, so the pair count bounds the points too:
    # rows fit int32 on the device and in the links.
    limit = min(int(max_neighbour_pairs), np.iinfo(np.int32).max)
    n = lat.shape[0]
    if n == 0:
        return DbscanResult(
            labels=np.empty(0, dtype=np.int64),
            core=np.empty(0, dtype=bool),
            n_clusters=0,
            sizes=np.empty(0, dtype=np.int64),
            neighbour_pairs=0,
        )
    if index is not None:
        _check_index(index, n, earth_radius_m)
        if _is_gpu_index(index):
            from geonear.service.analytics.dbscan_gpu import dbscan_on_device

            return dbscan_on_device(lat, lon, eps_m, min_samples, index, limit, should_stop)
    return _dbscan_on_host(lat, lon, eps_m, min_samples, index, earth_radius_m, limit, should_stop)


def _checked_points(lat: Any, lon: Any) -> tuple[np.ndarray, np.ndarray]:
    lat = np.ascontiguousarray(lat, dtype=np.float64)
    lon = np.ascontiguousarray(lon, dtype=np.float64)
    if lat.ndim != 1 or lat.shape != lon.shape:
        raise ValueError(
            f"lat and lon must be 1-D arrays of one length, got shapes {lat.shape}, {lon.shape}"
        )
    if not (np.isfinite(lat).all() and np.isfinite(lon).all()):
        raise ValueError("coordinates must be finite")
    if np.any(np.abs(lat) > 90.0) or np.any(np.abs(lon) > 180.0):
        raise ValueError("latitudes must be in [-90, 90] and longitudes in [-180, 180]")
    return lat, lon


def _check_index(index: PointIndex, n: int, earth_radius_m: float) -> None:
    if index.n_points != n:
        raise ValueError(f"the index holds {index.n_points} points, not the {n} given")
    radius = getattr(index, "earth_radius_m", None)
    if radius is not None and float(radius) != float(earth_radius_m):
        raise ValueError(
            f"the index measures on a sphere of {radius} m, not earth_radius_m={earth_radius_m}"
        )


def _is_gpu_index(index: PointIndex) -> TypeGuard[GPUIndex]:
    # A GPU index exists only once its module (and CuPy) is imported: no import here.
    gpu = sys.modules.get("geonear.service.engines.gpu")
    return gpu is not None and isinstance(index, gpu.GPUIndex)


def check_stop(should_stop: ShouldStop) -> None:
    """Raise DbscanStopped when ``should_stop`` says so."""
    if should_stop is not None and should_stop():
        raise DbscanStopped("DBSCAN was stopped: the call was cancelled or its deadline passed")


def count_neighbours(
    index: PointIndex,
    lat: np.ndarray,
    lon: np.ndarray,
    eps_m: float,
    limit: int,
    should_stop: ShouldStop,
) -> np.ndarray:
    """Each point's neighbourhood size (int64, host), in slices; raises TooManyNeighbours
    as soon as the running total passes ``limit``."""
    n = lat.shape[0]
    counts = np.empty(n, dtype=np.int64)
    total = 0
    for start in range(0, n, COUNT_SLICE_POINTS):
        check_stop(should_stop)
        stop = min(n, start + COUNT_SLICE_POINTS)
        counts[start:stop] = index.radius_count(lat[start:stop], lon[start:stop], eps_m)
        total += int(counts[start:stop].sum())
        if total > limit:
            raise TooManyNeighbours(total, limit, eps_m)
    return counts


def pair_slices(counts: np.ndarray, pairs_per_slice: int) -> list[tuple[int, int]]:
    """Consecutive row ranges whose neighbourhoods hold about ``pairs_per_slice`` pairs
    (a point with more alone)."""
    n = counts.shape[0]
    ends = np.cumsum(counts)
    cuts = np.searchsorted(ends, np.arange(pairs_per_slice, int(ends[-1]), pairs_per_slice))
    bounds = np.unique(np.concatenate([[0], np.maximum(cuts, 1), [n]]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def core_links(
    query_rows: Any, neighbour_rows: Any, core: Any, border_core: Any, xp: Any
) -> tuple[Any, Any]:
    """From (point, neighbour) pairs: the links between two distinct core points, as
    int32 (source, target) rows; and, in ``border_core`` (int32, n where none), the
    smallest core neighbour of each non-core point."""
    core_q = core[query_rows]
    core_n = core[neighbour_rows]
    border = core_n & ~core_q
    xp.minimum.at(
        border_core, query_rows[border].astype(xp.int32), neighbour_rows[border].astype(xp.int32)
    )
    link = core_q & core_n & (query_rows != neighbour_rows)
    return query_rows[link].astype(xp.int32), neighbour_rows[link].astype(xp.int32)


def min_label_components(
    source: Any, target: Any, n: int, xp: Any, should_stop: ShouldStop = None
) -> Any:
    """Connected components of n vertices and links (source[i], target[i]), int32.

    Returns ``parent`` (int32, shape (n,)): each vertex's component's smallest vertex.
    Min-label hooking with pointer jumping, in whole-array steps (the device's way):
    every link between two trees hangs the larger root under the smaller one, then every
    vertex jumps to its root. ``parent[v] <= v`` throughout, so the forest has no cycle
    and a root is its tree's smallest vertex; each round with a link between two trees
    removes at least one root, so the rounds end, and they end when every link lies in
    one tree. Links found inside one tree are dropped (trees only grow).
    """
    parent = xp.arange(n, dtype=xp.int32)
    while source.shape[0]:
        check_stop(should_stop)
        root_s, root_t = parent[source], parent[target]
        apart = root_s != root_t
        if not bool(apart.any()):
            break
        source, target = source[apart], target[apart]
        root_s, root_t = root_s[apart], root_t[apart]
        xp.minimum.at(parent, xp.maximum(root_s, root_t), xp.minimum(root_s, root_t))
        while True:
            grand = parent[parent]
            if bool((grand == parent).all()):
                break
            parent = grand
    return parent


def number_clusters(core: Any, root: Any, border_core: Any, xp: Any) -> tuple[Any, int, Any]:
    """(labels int64 (n,), n_clusters, sizes int64) from each core point's component
    root (its smallest core row; anything for other points) and each non-core point's
    smallest core neighbour (``border_core``, n where none).

    A border point takes its core neighbour's cluster; clusters are numbered in the
    order of their smallest member row.
    """
    n = int(core.shape[0])
    rows = xp.arange(n, dtype=xp.int32)
    member_root = root.astype(xp.int32)  # a copy
    member_root[~core] = -1
    border = ~core & (border_core < n)
    member_root[border] = member_root[border_core[border]]
    members = xp.flatnonzero(member_root >= 0).astype(xp.int32)
    roots = xp.flatnonzero(core & (member_root == rows))
    first_row = xp.full(n, n, dtype=xp.int32)
    xp.minimum.at(first_row, member_root[members], members)
    order = xp.argsort(first_row[roots])
    n_clusters = int(roots.shape[0])
    number = xp.full(n, -1, dtype=xp.int64)
    number[roots[order]] = xp.arange(n_clusters, dtype=xp.int64)
    labels = xp.full(n, -1, dtype=xp.int64)
    labels[members] = number[member_root[members]]
    if n_clusters == 0:
        return labels, 0, xp.zeros(0, dtype=xp.int64)
    sizes = xp.bincount(labels[members], minlength=n_clusters).astype(xp.int64)
    return labels, n_clusters, sizes


def _host_pairs(
    index: PointIndex, lat: np.ndarray, lon: np.ndarray, start: int, stop: int, eps_m: float
) -> tuple[np.ndarray, np.ndarray]:
    """(point rows, neighbour rows) of the points in [start, stop): the index's radius
    answer, without its sort where the index lists candidates (``HostIndex``), measured
    as ``HostIndex.exact_radius`` measures them."""
    la, lo = lat[start:stop], lon[start:stop]
    if isinstance(index, HostIndex) and (
        type(index).candidates_within is not HostIndex.candidates_within
    ):
        query, rows = index.candidates_within(la, lo, np.full(la.shape[0], eps_m))
        dist = great_circle_m(
            la[query], lo[query], index.lat[rows], index.lon[rows], index.earth_radius_m
        )
        keep = dist <= eps_m
        return query[keep] + start, rows[keep]
    found = index.radius(la, lo, eps_m)
    return found.query_index + start, found.indices


def _dbscan_on_host(
    lat: np.ndarray,
    lon: np.ndarray,
    eps_m: float,
    min_samples: int,
    index: PointIndex | None,
    earth_radius_m: float,
    limit: int,
    should_stop: ShouldStop,
) -> DbscanResult:
    n = lat.shape[0]
    border_core = np.full(n, n, dtype=np.int32)
    if index is None or isinstance(index, KDTreeIndex):
        tree = _unit_vector_tree(lat, lon) if index is None else index.tree
        first, second, forward, backward, counts = _tree_pairs(
            tree, lat, lon, eps_m, earth_radius_m, limit, should_stop
        )
        core = counts >= min_samples
        check_stop(should_stop)
        # A border point's core neighbours, seen from either end of each pair.
        for a, b, a_sees_b in ((first, second, forward), (second, first, backward)):
            joins = a_sees_b & core[b] & ~core[a]
            np.minimum.at(border_core, a[joins], b[joins])
        link = core[first] & core[second]
        source, target = first[link], second[link]
        del first, second, forward, backward
    else:
        counts = count_neighbours(index, lat, lon, eps_m, limit, should_stop)
        core = counts >= min_samples
        sources, targets = [], []
        for start, stop in pair_slices(counts, SLICE_PAIRS):
            check_stop(should_stop)
            query, rows = _host_pairs(index, lat, lon, start, stop, eps_m)
            links = core_links(query, rows, core, border_core, np)
            sources.append(links[0])
            targets.append(links[1])
        source, target = np.concatenate(sources), np.concatenate(targets)
    check_stop(should_stop)
    root = _component_roots(source, target, core)
    labels, n_clusters, sizes = number_clusters(core, root, border_core, np)
    return DbscanResult(
        labels=labels,
        core=core,
        n_clusters=n_clusters,
        sizes=sizes,
        neighbour_pairs=int(counts.sum()),
    )


def _unit_vector_tree(lat: np.ndarray, lon: np.ndarray) -> cKDTree:
    # As the CPU engine builds its own (sliding midpoint: faster to build, as fast to query).
    return cKDTree(unit_vectors(lat, lon), leafsize=32, balanced_tree=False, compact_nodes=False)


def _tree_pairs(
    tree: cKDTree,
    lat: np.ndarray,
    lon: np.ndarray,
    eps_m: float,
    earth_radius_m: float,
    limit: int,
    should_stop: ShouldStop,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every pair of distinct points within ``eps_m`` of each other, by one search of the
    tree against itself (several times faster than a search a point).

    Returns (first, second, forward, backward, counts): rows (int32) of each pair with
    first < second; whether second is in first's neighbourhood (forward) and first in
    second's (backward), each measured with its own point as the query, as
    ``PointIndex.radius`` does; and each point's neighbourhood size (int64, itself
    included). The candidates are the pairs within the chord of ``eps_m`` widened by
    the CPU engine's slack; their count (every ordered pair and every point with itself)
    is checked against ``limit`` before they are listed.
    """
    n = lat.shape[0]
    outer = chord_for_distance(eps_m, earth_radius_m) * (1 + _CHORD_SLACK) + _CHORD_SLACK
    candidates = int(tree.count_neighbors(tree, outer))
    if candidates > limit:
        raise TooManyNeighbours(candidates, limit, eps_m)
    check_stop(should_stop)
    pairs = tree.query_pairs(outer, output_type="ndarray")
    counts = np.ones(n, dtype=np.int64)
    kept: list[tuple[np.ndarray, ...]] = []
    for start in range(0, pairs.shape[0], SLICE_PAIRS):
        check_stop(should_stop)
        first = pairs[start : start + SLICE_PAIRS, 0].astype(np.int32)
        second = pairs[start : start + SLICE_PAIRS, 1].astype(np.int32)
        la, lo, lb, mb = lat[first], lon[first], lat[second], lon[second]
        forward = great_circle_m(la, lo, lb, mb, earth_radius_m) <= eps_m
        backward = great_circle_m(lb, mb, la, lo, earth_radius_m) <= eps_m
        counts += np.bincount(first[forward], minlength=n)
        counts += np.bincount(second[backward], minlength=n)
        near = forward | backward
        kept.append((first[near], second[near], forward[near], backward[near]))
    del pairs
    if not kept:
        empty = np.empty(0, dtype=np.int32)
        return empty, empty, np.empty(0, dtype=bool), np.empty(0, dtype=bool), counts
    first, second, forward, backward = (np.concatenate(parts) for parts in zip(*kept, strict=True))
    return first, second, forward, backward, counts


def _component_roots(source: np.ndarray, target: np.ndarray, core: np.ndarray) -> np.ndarray:
    """Each core point's component's smallest row (scipy's components; -1 elsewhere)."""
    n = core.shape[0]
    graph = coo_array((np.ones(source.shape[0]), (source, target)), shape=(n, n)).tocsr()
    _, component = connected_components(graph, directed=True, connection="weak")
    core_rows = np.flatnonzero(core)
    found, first = np.unique(component[core_rows], return_index=True)
    smallest = np.full(int(component.max()) + 1, -1, dtype=np.int64)
    smallest[found] = core_rows[first]  # rows ascend: a component's first is its smallest
    root = np.full(n, -1, dtype=np.int64)
    root[core_rows] = smallest[component[core_rows]]
    return root
