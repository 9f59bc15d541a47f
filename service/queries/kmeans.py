"""Spherical k-means over a dataset: all of its points, or those a filter and an area
select (``geonear.service.queries.filters``), clustered as a dataset of only them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from geonear.service.engines import Capability, KMeansResult, require
from geonear.service.engines.spherical_kmeans import KMeansStopped, stopping_when
from geonear.service.errors import Cancelled, InvalidInput, LimitExceeded
from geonear.service.queries.common import check_result_rows
from geonear.service.queries.filters import PointSelection, all_points
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion, column_numpy
from geonear.service.validation import RESERVED

#: Initialisations are prepared up front (one seed each), so their number is bounded.
MAX_N_INIT = 1000


@dataclass(frozen=True)
class KMeansAnswer:
    """The clustering of ``dataset``'s points that ``rows`` names (None: all of them)."""

    dataset: DatasetVersion
    rows: np.ndarray | None
    result: KMeansResult


def kmeans(
    dataset: DatasetVersion,
    k: int,
    *,
    seed: int = 0,
    n_init: int = 1,
    max_iter: int = 100,
    tol: float = 1e-6,
    weight_column: str = "",
    return_labels: bool = False,
    points: PointSelection | None = None,
    limits: Limits,
    should_stop: Callable[[], bool] | None = None,
) -> KMeansAnswer:
    """Spherical k-means of the points ``points`` selects (None: every point of
    ``dataset``); stops with Cancelled when ``should_stop()`` is True.

    The points are clustered on their selection's own index, so the answer is the one a
    dataset of only them gives. With ``return_labels`` the answer has a row a clustered
    point, refused beyond ``max_result_rows`` before the clustering starts.
    """
    require(dataset.engine, Capability.KMEANS, "k-means")
    if k > limits.max_k:
        raise LimitExceeded(f"k={k} exceeds max_k={limits.max_k} (setting GEONEAR_MAX_K)")
    selection = points or all_points(dataset)
    n = selection.n_points
    if return_labels:
        check_result_rows(
            n,
            limits,
            f"the labels of {dataset.name!r}",
            "ask for the summary only, or select fewer points with where or within",
        )
    if not 1 <= k <= n:
        what = f"dataset's {n} rows" if selection.rows is None else f"{n} points selected"
        raise InvalidInput(f"k must be between 1 and the {what}, got {k}")
    if not 1 <= n_init <= MAX_N_INIT or max_iter < 1 or not (np.isfinite(tol) and tol >= 0):
        raise InvalidInput(
            f"need 1 <= n_init <= {MAX_N_INIT}, max_iter >= 1 and tol >= 0; got "
            f"n_init={n_init}, max_iter={max_iter}, tol={tol}"
        )
    rows = selection.rows
    weights = _weights(dataset, weight_column, rows) if weight_column else None
    try:
        with stopping_when(should_stop):
            result = selection.index.kmeans(
                k, weights=weights, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol
            )
    except KMeansStopped as exc:
        raise Cancelled(str(exc)) from exc
    return KMeansAnswer(dataset, rows, result)


def _weights(dataset: DatasetVersion, name: str, rows: np.ndarray | None) -> np.ndarray:
    """The weight of each clustered point (the dataset's ``rows``; None: every row)."""
    if name in RESERVED or name not in dataset.table.column_names:
        raise InvalidInput(f"weight column {name!r} is not an attribute of {dataset.name!r}")
    col = dataset.table.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) or col.null_count:
        raise InvalidInput(f"weight column {name!r} must be numeric without nulls")
    w = column_numpy(dataset.table, name).astype(np.float64)
    if rows is not None:
        w = w[rows]
    if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
        raise InvalidInput(f"weights in {name!r} must be finite, >= 0, and not all 0")
    return w


def centroid_table(result: KMeansResult) -> pa.Table:
    return pa.table(
        {
            "cluster": pa.array(np.arange(result.sizes.shape[0]), pa.int32()),
            "lat": pa.array(result.centroid_lat, pa.float64()),
            "lon": pa.array(result.centroid_lon, pa.float64()),
            "size": pa.array(result.sizes, pa.int64()),
        }
    )
