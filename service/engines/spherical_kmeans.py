"""Spherical k-means: one driver over a few steps each engine supplies (its hooks).

Definition (docs/design.md): points are unit vectors; each point is assigned to the
centroid at the smallest great-circle distance (the largest dot product, ties to the
lowest cluster number); a centroid is the normalised (weighted) mean of its members' unit
vectors, and a cluster left empty keeps its previous centroid. Initialisation is
k-means++ (first centre drawn with probability proportional to weight, each next one
proportional to weight x squared distance to the nearest chosen centre), drawn from a
host NumPy generator so that every engine draws the same centres from the same seed.
Lloyd iterations stop after ``max_iter`` or when no centroid moves more than ``tol``
radians (a negative ``tol`` runs all ``max_iter``). With ``n_init`` > 1, initialisation i
uses the i-th child of ``SeedSequence(seed)`` and the lowest inertia wins (the first one
on ties).

The algorithm is written once, here, as scikit-learn writes its tree queries once over
the distance bounds of KDTree and BallTree: :func:`spherical_kmeans` validates the
arguments, runs the initialisations (:func:`kmeans_plus_plus`, :func:`lloyd`), keeps the
best and builds the :class:`KMeansResult`. An engine gives it a :class:`KMeansBackend`,
its points and the steps that touch them:

| hook                 | ArrayKMeans (NumPy, CuPy) | gpu (fused kernels)    | dask          |
|----------------------|---------------------------|------------------------|---------------|
| seeding_mass         | pruned angle update       | kmeanspp_nearest       | ArrayKMeans   |
| centres_at           | rows of ``xyz``           | rows of the index      | ArrayKMeans   |
| cluster_sums         | assign + accumulate       | assign_accumulate      | per partition |
| update               | centroids_from_sums       | kmeans_update          | ArrayKMeans   |
| labels_and_inertia   | assign + angles           | kmeans_labels          | per partition |

The host engines (numpy-brute, sklearn, cpu) use :class:`ArrayKMeans` as it is;
cupy-broadcast replaces its ``accumulate`` (a one-hot GEMM); cuML replaces ``iterate``,
the whole Lloyd run, because cuML's KMeans runs its own loop.

Long runs can be stopped: ``should_stop`` (a callable returning True when the caller has
gone, e.g. its deadline passed) is checked before each initialisation, every 16 k-means++
draws and before each Lloyd iteration, and :class:`KMeansStopped` is raised when it says
so. It is passed explicitly, or set for the calling thread with :func:`stopping_when`,
which is how the query layer reaches every engine's k-means without a parameter in the
engine interface. Each iteration and initialisation is logged at DEBUG on
``geonear.kmeans``, with its step in the record's ``kmeans_step`` attribute.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from geonear.geometry import angle_between, unit_vectors_to_latlon
from geonear.service.engines.base import KMeansResult

log = logging.getLogger("geonear.kmeans")

#: Bound on the (rows x k) similarity block held at once, in elements: large on a GPU,
#: small enough on the host to stay in cache (1M points, k = 64, 2 cores: an assignment
#: 0.089 s in blocks of 2**24, 0.052 s in blocks of 2**20).
_BLOCK_ELEMENTS = 1 << 24
_HOST_BLOCK_ELEMENTS = 1 << 20
#: A point whose dot product with a new centre is below its best so far by more than
#: this is farther from the new centre (float64 dot products err by about 1e-15).
_DOT_MARGIN = 1e-12
#: k-means++ draws between stop checks: each draw is one pass over the points.
_DRAWS_PER_CHECK = 16

ShouldStop = Callable[[], bool] | None


class KMeansStopped(Exception):
    """``should_stop`` returned True: the caller no longer wants the answer."""


_should_stop: contextvars.ContextVar[ShouldStop] = contextvars.ContextVar(
    "geonear_kmeans_should_stop", default=None
)


@contextlib.contextmanager
def stopping_when(should_stop: ShouldStop) -> Iterator[None]:
    """Within the block, k-means in this thread stops once ``should_stop()`` is True."""
    token = _should_stop.set(should_stop)
    try:
        yield
    finally:
        _should_stop.reset(token)


def check_stop(should_stop: ShouldStop = None) -> None:
    """Raise KMeansStopped when ``should_stop`` (or the thread's, see stopping_when) says so."""
    should_stop = should_stop or _should_stop.get()
    if should_stop is not None and should_stop():
        raise KMeansStopped("k-means was stopped: the call was cancelled or its deadline passed")


# -- the hooks ---------------------------------------------------------------------------
class KMeansBackend(ABC):
    """An engine's points as k-means sees them, and the steps that touch them.

    Arrays are in the namespace ``xp`` (NumPy or CuPy); "rows" are dataset rows, and
    every per-point answer is in row order, whatever order the engine keeps its points
    in. The driver calls the hooks; it never reads the points itself.

    Parameters
    ----------
    n_points : int
        Number of points.
    weights : ndarray of float, shape (n_points,), optional
        Weight of every row: finite, >= 0 and not all 0 (checked here).
    earth_radius_m : float
        Sphere radius for the inertia, metres.
    """

    #: Array namespace of the hooks' arrays (numpy or cupy).
    xp: Any = np

    def __init__(self, n_points: int, weights: Any, earth_radius_m: float) -> None:
        self.n_points = int(n_points)
        self.earth_radius_m = float(earth_radius_m)
        checked = check_weights(weights, self.n_points)
        #: Per-row weights in ``xp`` (float64), or None for all 1.
        self.weights: Any = None if checked is None else self.xp.asarray(checked)

    @abstractmethod
    def seeding_mass(self, centre_row: int, first: bool) -> Any:
        """k-means++: add the centre at ``centre_row`` (the first one when ``first``) and
        return every row's weight x squared angle (radians) to its nearest centre so far,
        (n_points,) float64 in row order: the distribution of the next draw."""

    @abstractmethod
    def centres_at(self, rows: np.ndarray) -> Any:
        """The unit vectors of ``rows`` (int64 host array), (len(rows), 3) float64, a new
        array."""

    @abstractmethod
    def cluster_sums(self, centroids: Any) -> Any:
        """One Lloyd assignment: every point to its nearest of ``centroids`` (k, 3), and
        each cluster's (weighted) sum of member unit vectors, in whatever form ``update``
        reads (float64 (k, 3) for the default ``update``)."""

    def update(self, centroids: Any, sums: Any) -> tuple[Any, float]:
        """(new centroids (k, 3), the largest angle a centroid moved, radians) from
        ``cluster_sums``: normalised sums; an empty cluster keeps its centroid. Never
        changes ``centroids`` in place."""
        xp = self.xp
        new = centroids_from_sums(sums, centroids, xp)
        return new, float(xp.max(angle_between(centroids, new, xp=xp)))

    @abstractmethod
    def labels_and_inertia(self, centroids: Any) -> tuple[Any, float]:
        """(cluster of every row, int32 (n_points,); sum of the (weighted) squared
        great-circle metres of every point to its centroid)."""

    def iterate(
        self, centroids: Any, *, max_iter: int, tol: float, should_stop: ShouldStop = None
    ) -> tuple[Any, int]:
        """Lloyd iterations from ``centroids``: (centroids, iterations run).

        :func:`lloyd` over this backend's steps; a backend whose library runs the loop
        itself replaces this method (and can then be stopped only between runs).
        """
        return lloyd(self, centroids, max_iter=max_iter, tol=tol, should_stop=should_stop)

    def to_host(self, a: Any) -> np.ndarray:
        """``a`` as a host NumPy array."""
        return a.get() if hasattr(a, "get") else np.asarray(a)


class ArrayKMeans(KMeansBackend):
    """The hooks as array code over unit vectors held in memory (host or one device).

    Parameters
    ----------
    xyz : ndarray of float64, shape (n, 3)
        Unit vectors of the points, in row order, in namespace ``xp``.
    weights, earth_radius_m
        As :class:`KMeansBackend`.
    xp : module
        ``numpy`` or ``cupy``.
    """

    def __init__(self, xyz: Any, weights: Any, earth_radius_m: float, xp: Any = np) -> None:
        self.xp = xp
        super().__init__(int(xyz.shape[0]), weights, earth_radius_m)
        self.xyz = xyz
        # k-means++ state: each point's squared angle to, and largest dot product with,
        # the centres chosen so far.
        self._nearest_sq: Any = None
        self._nearest_dot: Any = None
        self._coords: tuple[Any, Any, Any] | None = None

    def seeding_mass(self, centre_row: int, first: bool) -> Any:
        # Only points whose dot product with the new centre comes near their best so far
        # can be nearer to it, so only they are measured (the same nearest_sq as
        # measuring every point; a draw costs half as much).
        xp, xyz = self.xp, self.xyz
        centre = xyz[centre_row]
        if first:
            self._coords = (
                xp.ascontiguousarray(xyz[:, 0]),
                xp.ascontiguousarray(xyz[:, 1]),
                xp.ascontiguousarray(xyz[:, 2]),
            )
            self._nearest_sq = angle_between(xyz, centre[None, :], xp=xp) ** 2
            self._nearest_dot = self._dots(centre)
        else:
            dot = self._dots(centre)
            near = xp.flatnonzero(dot > self._nearest_dot - _DOT_MARGIN)
            angle = angle_between(xyz[near], centre[None, :], xp=xp)
            self._nearest_sq[near] = xp.minimum(self._nearest_sq[near], angle * angle)
            self._nearest_dot = xp.maximum(self._nearest_dot, dot)
        return self._nearest_sq if self.weights is None else self.weights * self._nearest_sq

    def _dots(self, centre: Any) -> Any:
        assert self._coords is not None
        x, y, z = self._coords
        return x * centre[0] + y * centre[1] + z * centre[2]

    def centres_at(self, rows: np.ndarray) -> Any:
        return self.xyz[self.xp.asarray(rows)].copy()

    def assign(self, centroids: Any) -> Any:
        """Cluster of every point, int32 (n,): the centroid with the largest dot product."""
        xp, xyz = self.xp, self.xyz
        n, k = self.n_points, int(centroids.shape[0])
        labels = xp.empty(n, dtype=xp.int32)
        step = max(1, (_HOST_BLOCK_ELEMENTS if xp is np else _BLOCK_ELEMENTS) // max(k, 1))
        for start in range(0, n, step):
            stop = min(n, start + step)
            labels[start:stop] = xp.argmax(xyz[start:stop] @ centroids.T, axis=1)
        return labels

    def accumulate(self, labels: Any, k: int) -> Any:
        """(Weighted) sums of each cluster's member unit vectors, float64 (k, 3)."""
        return cluster_sums(self.xyz, labels, self.weights, k, self.xp)

    def cluster_sums(self, centroids: Any) -> Any:
        return self.accumulate(self.assign(centroids), int(centroids.shape[0]))

    def labels_and_inertia(self, centroids: Any) -> tuple[Any, float]:
        labels = self.assign(centroids)
        angle = angle_between(self.xyz, centroids[labels], xp=self.xp)
        sq = (self.earth_radius_m * angle) ** 2
        if self.weights is not None:
            sq = sq * self.weights
        return labels, float(sq.sum())


def check_weights(weights: Any, n_points: int) -> np.ndarray | None:
    """``weights`` as float64 (n_points,) on the host, or None; ValueError if unusable."""
    if weights is None:
        return None
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n_points,):
        raise ValueError(f"weights must have one value a point, shape ({n_points},); got {w.shape}")
    if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise ValueError("weights must be finite, >= 0, and not all 0")
    return w


def cluster_sums(xyz: Any, labels: Any, weights: Any, k: int, xp: Any) -> Any:
    """(Weighted) sums of each cluster's member unit vectors, shape (k, 3)."""
    return xp.stack(
        [
            xp.bincount(
                labels, weights=xyz[:, d] if weights is None else xyz[:, d] * weights, minlength=k
            )
            for d in range(3)
        ],
        axis=1,
    )


def centroids_from_sums(sums: Any, centroids: Any, xp: Any) -> Any:
    """Centroids from cluster sums (k, 3): normalised; a cluster left empty stays put."""
    norms = xp.sqrt((sums * sums).sum(axis=1))
    empty = norms == 0
    safe = xp.where(empty, 1.0, norms)
    new = sums / safe[:, None]
    return xp.where(empty[:, None], centroids, new)


# -- the driver ----------------------------------------------------------------------------
def kmeans_plus_plus(
    backend: KMeansBackend, k: int, rng: np.random.Generator, should_stop: ShouldStop = None
) -> Any:
    """k initial centroids (k, 3) drawn by k-means++ from ``rng`` (see the module docstring)."""
    xp, n = backend.xp, backend.n_points
    by_weight = xp.cumsum(
        xp.ones(n, dtype=xp.float64) if backend.weights is None else backend.weights
    )
    chosen = [_draw(by_weight, rng, xp)]
    for i in range(1, k):
        if i % _DRAWS_PER_CHECK == 0:
            check_stop(should_stop)
        mass = xp.cumsum(backend.seeding_mass(chosen[-1], first=i == 1))
        # With fewer distinct points than clusters every distance is 0: draw by weight.
        chosen.append(_draw(mass if float(mass[-1]) > 0.0 else by_weight, rng, xp))
    return backend.centres_at(np.array(chosen, dtype=np.int64))


def seed_kmeans_plus_plus(
    xyz: Any,
    k: int,
    weights: Any,
    rng: np.random.Generator,
    xp: Any,
    should_stop: ShouldStop = None,
) -> Any:
    """k-means++ centres (k, 3) of unit vectors ``xyz`` (n, 3) in ``xp``: the driver's
    draws (:func:`kmeans_plus_plus`), for callers that hold plain arrays."""
    backend = ArrayKMeans(xyz, _host(weights), 1.0, xp)
    return kmeans_plus_plus(backend, k, rng, should_stop)


def _host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a


def _draw(cumulative: Any, rng: np.random.Generator, xp: Any) -> int:
    """Index drawn with probability proportional to the increments of ``cumulative``."""
    total = float(cumulative[-1])
    target = rng.random() * total
    idx = int(xp.searchsorted(cumulative, xp.asarray(target), side="right"))
    return min(idx, int(cumulative.shape[0]) - 1)


def lloyd(
    backend: KMeansBackend,
    centroids: Any,
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    should_stop: ShouldStop = None,
) -> tuple[Any, int]:
    """Lloyd iterations from ``centroids`` (k, 3); returns (centroids, iterations run).

    Stops after ``max_iter``, once no centroid moved more than ``tol`` radians, or with
    KMeansStopped before an iteration when ``should_stop`` says so.
    """
    n_iter = 0
    for n_iter in range(1, max_iter + 1):
        check_stop(should_stop)
        centroids, shift = backend.update(centroids, backend.cluster_sums(centroids))
        log.debug(
            "k-means iteration %d: centroids moved up to %.3g rad",
            n_iter,
            shift,
            extra={"kmeans_step": "iteration"},
        )
        if shift <= tol:
            break
    return centroids, n_iter


def check_kmeans_arguments(n_points: int, k: int, n_init: int, max_iter: int, tol: float) -> None:
    """ValueError naming the valid range of the first argument out of it."""
    if not 1 <= k <= n_points:
        raise ValueError(f"k must be between 1 and the number of points ({n_points}), got {k}")
    if n_init < 1:
        raise ValueError(f"n_init must be at least 1, got {n_init}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be at least 1, got {max_iter}")
    if math.isnan(tol):
        raise ValueError("tol must be a number of radians (negative: run every iteration)")


def spherical_kmeans(
    backend: KMeansBackend,
    k: int,
    *,
    seed: int = 0,
    n_init: int = 1,
    max_iter: int = 100,
    tol: float = 1e-6,
    should_stop: ShouldStop = None,
) -> KMeansResult:
    """Spherical k-means of ``backend``'s points (see the module docstring).

    Returns host NumPy results. Raises ValueError for arguments out of range and
    KMeansStopped when ``should_stop`` (or the thread's) returns True.
    """
    check_kmeans_arguments(backend.n_points, k, n_init, max_iter, tol)
    xp = backend.xp
    best: tuple[float, Any, Any, int] | None = None
    for i, child in enumerate(np.random.SeedSequence(seed).spawn(n_init)):
        try:
            check_stop(should_stop)
            start = kmeans_plus_plus(backend, k, np.random.default_rng(child), should_stop)
            centroids, n_iter = backend.iterate(
                start, max_iter=max_iter, tol=tol, should_stop=should_stop
            )
        except KMeansStopped:
            log.debug(
                "k-means stopped in initialisation %d of %d",
                i + 1,
                n_init,
                extra={"kmeans_step": "stopped"},
            )
            raise
        labels, inertia = backend.labels_and_inertia(centroids)
        log.debug(
            "k-means initialisation %d of %d: %d iterations, inertia %.6g m^2",
            i + 1,
            n_init,
            n_iter,
            inertia,
            extra={"kmeans_step": "initialisation"},
        )
        if best is None or inertia < best[0]:
            best = (inertia, centroids, labels, n_iter)
    assert best is not None
    inertia, centroids, labels, n_iter = best
    lat, lon = unit_vectors_to_latlon(centroids, xp=xp)
    return KMeansResult(
        centroid_lat=backend.to_host(lat),
        centroid_lon=backend.to_host(lon),
        sizes=backend.to_host(xp.bincount(labels, minlength=k)).astype(np.int64),
        labels=backend.to_host(labels).astype(np.int32, copy=False),
        inertia_m2=inertia,
        n_iter=n_iter,
    )
