"""Spherical k-means, written once for NumPy and CuPy (``xp`` is the array namespace).

Definition (DESIGN.md): points are unit vectors; each point is assigned to the centroid
at the smallest great-circle distance (the largest dot product, ties to the lowest
cluster number); a centroid is the normalised (weighted) mean of its members' unit
vectors, and a cluster left empty keeps its previous centroid. Initialisation is
k-means++ (first centre drawn with probability proportional to weight, each next one
proportional to weight x squared distance to the nearest chosen centre), drawn from a
host NumPy generator so that every engine draws the same centres from the same seed.
Lloyd iterations stop after ``max_iter`` or when no centroid moves more than ``tol``
radians. With ``n_init`` > 1, initialisation i uses the i-th child of
``SeedSequence(seed)`` and the lowest inertia wins (the first one on ties).

Long runs can be stopped: ``should_stop`` (a callable returning True when the caller
has gone, e.g. its deadline passed) is checked between Lloyd iterations and between
k-means++ draws, and :class:`KMeansStopped` is raised when it says so. It is passed
explicitly, or set for the calling thread with :func:`stopping_when`, which is how the
query layer reaches every engine's k-means without a parameter in the engine interface.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from geonear.service.engines.base import KMeansResult
from geonear.service.geometry import angle_between, unit_vectors_to_latlon

#: Bound on the (rows x k) similarity block held at once, in elements: large on a GPU,
#: small enough on the host to stay in cache (1M points, k = 64, 2 cores: an assignment
#: 0.089 s in blocks of 2**24, 0.052 s in blocks of 2**20).
_BLOCK_ELEMENTS = 1 << 24
_HOST_BLOCK_ELEMENTS = 1 << 20
#: A point whose dot product with a new centre is below its best so far by more than
#: this is farther from the new centre (float64 dot products err by about 1e-15).
_DOT_MARGIN = 1e-12

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


def _assign(xyz: Any, centroids: Any, xp: Any) -> Any:
    """Cluster of every point: the centroid with the largest dot product."""
    n, k = xyz.shape[0], centroids.shape[0]
    labels = xp.empty(n, dtype=xp.int32)
    step = max(1, (_HOST_BLOCK_ELEMENTS if xp is np else _BLOCK_ELEMENTS) // max(k, 1))
    for start in range(0, n, step):
        stop = min(n, start + step)
        labels[start:stop] = xp.argmax(xyz[start:stop] @ centroids.T, axis=1)
    return labels


def _update(xyz: Any, labels: Any, weights: Any, centroids: Any, xp: Any) -> Any:
    """Normalised weighted mean of each cluster's members; empty clusters stay put."""
    sums = cluster_sums(xyz, labels, weights, centroids.shape[0], xp)
    return centroids_from_sums(sums, centroids, xp)


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


def seed_kmeans_plus_plus(
    xyz: Any,
    k: int,
    weights: Any,
    rng: np.random.Generator,
    xp: Any,
    should_stop: ShouldStop = None,
) -> Any:
    """k initial centroids (k, 3) drawn by k-means++ from ``rng`` (see the module docstring)."""
    n = xyz.shape[0]
    w = xp.ones(n, dtype=xp.float64) if weights is None else weights
    chosen = [_draw(xp.cumsum(w), rng, xp)]
    nearest_sq = angle_between(xyz, xyz[chosen[0]][None, :], xp=xp) ** 2
    # Each point's largest dot product with a centre so far: only points whose dot with
    # a new centre comes near it can be nearer to that one, so only they are measured
    # (the same nearest_sq as measuring every point; a draw costs half as much).
    x, y, z = (xp.ascontiguousarray(xyz[:, d]) for d in range(3))

    def dots(centre: Any) -> Any:
        return x * centre[0] + y * centre[1] + z * centre[2]

    nearest_dot = dots(xyz[chosen[0]])
    for i in range(1, k):
        if i % 16 == 0:  # each draw is one pass over the points; check now and then
            check_stop(should_stop)
        mass = xp.cumsum(w * nearest_sq)
        # With fewer distinct points than clusters every distance is 0: draw by weight.
        idx = _draw(mass if float(mass[-1]) > 0.0 else xp.cumsum(w), rng, xp)
        chosen.append(idx)
        centre = xyz[idx]
        dot = dots(centre)
        near = xp.flatnonzero(dot > nearest_dot - _DOT_MARGIN)
        angle = angle_between(xyz[near], centre[None, :], xp=xp)
        nearest_sq[near] = xp.minimum(nearest_sq[near], angle * angle)
        nearest_dot = xp.maximum(nearest_dot, dot)
    return xyz[xp.asarray(np.array(chosen, dtype=np.int64))].copy()


def _draw(cumulative: Any, rng: np.random.Generator, xp: Any) -> int:
    """Index drawn with probability proportional to the increments of ``cumulative``."""
    total = float(cumulative[-1])
    target = rng.random() * total
    idx = int(xp.searchsorted(cumulative, xp.asarray(target), side="right"))
    return min(idx, int(cumulative.shape[0]) - 1)


def _inertia_m2(
    xyz: Any, labels: Any, centroids: Any, weights: Any, earth_radius_m: float, xp: Any
) -> float:
    angle = angle_between(xyz, centroids[labels], xp=xp)
    sq = (earth_radius_m * angle) ** 2
    if weights is not None:
        sq = sq * weights
    return float(sq.sum())


def lloyd(
    xyz: Any,
    centroids: Any,
    *,
    weights: Any = None,
    max_iter: int = 100,
    tol: float = 1e-6,
    xp: Any = np,
    should_stop: ShouldStop = None,
) -> tuple[Any, Any, int]:
    """Lloyd iterations from given centroids (k, 3); returns (centroids, labels, n_iter)."""
    n_iter = 0
    for n_iter in range(1, max_iter + 1):  # noqa: B007 - n_iter is returned
        check_stop(should_stop)
        labels = _assign(xyz, centroids, xp)
        new = _update(xyz, labels, weights, centroids, xp)
        shift = float(xp.max(angle_between(centroids, new, xp=xp)))
        centroids = new
        if shift <= tol:
            break
    return centroids, _assign(xyz, centroids, xp), n_iter


def spherical_kmeans(
    xyz: Any,
    k: int,
    *,
    weights: Any = None,
    seed: int = 0,
    n_init: int = 1,
    max_iter: int = 100,
    tol: float = 1e-6,
    earth_radius_m: float,
    xp: Any = np,
    should_stop: ShouldStop = None,
) -> KMeansResult:
    """Spherical k-means of unit vectors ``xyz`` (n, 3) in namespace ``xp``.

    Returns host NumPy results; see the module docstring for the definition. Raises
    KMeansStopped when ``should_stop`` returns True.
    """
    n = int(xyz.shape[0])
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of points ({n}), got {k}")
    best: tuple[float, Any, Any, int] | None = None
    for child in np.random.SeedSequence(seed).spawn(max(1, n_init)):
        rng = np.random.default_rng(child)
        start = seed_kmeans_plus_plus(xyz, k, weights, rng, xp, should_stop)
        centroids, labels, n_iter = lloyd(
            xyz, start, weights=weights, max_iter=max_iter, tol=tol, xp=xp, should_stop=should_stop
        )
        inertia = _inertia_m2(xyz, labels, centroids, weights, earth_radius_m, xp)
        if best is None or inertia < best[0]:
            best = (inertia, centroids, labels, n_iter)
    assert best is not None
    inertia, centroids, labels, n_iter = best
    lat, lon = unit_vectors_to_latlon(centroids, xp=xp)
    sizes = xp.bincount(labels, minlength=k)
    return KMeansResult(
        centroid_lat=_to_host(lat),
        centroid_lon=_to_host(lon),
        sizes=_to_host(sizes).astype(np.int64),
        labels=_to_host(labels).astype(np.int32),
        inertia_m2=inertia,
        n_iter=n_iter,
    )


def _to_host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
