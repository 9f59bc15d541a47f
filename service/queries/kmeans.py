"""Spherical k-means over a dataset."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from geonear.service.engines import Capability, KMeansResult, require
from geonear.service.engines.spherical_kmeans import KMeansStopped, stopping_when
from geonear.service.errors import Cancelled, InvalidInput, LimitExceeded
from geonear.service.queries.common import check_result_rows
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion, column_numpy
from geonear.service.validation import RESERVED

#: Initialisations are prepared up front (one seed each), so their number is bounded.
MAX_N_INIT = 1000


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
    limits: Limits,
    should_stop: Callable[[], bool] | None = None,
) -> KMeansResult:
    """Spherical k-means of ``dataset``; stops with Cancelled when ``should_stop()`` is True.

    With ``return_labels`` the answer has a row a dataset row, refused beyond
    ``max_result_rows`` before the clustering starts.
    """
    require(dataset.engine, Capability.KMEANS, "k-means")
    if k > limits.max_k:
        raise LimitExceeded(f"k={k} exceeds max_k={limits.max_k} (setting GEONEAR_MAX_K)")
    if return_labels:
        check_result_rows(
            dataset.rows, limits, f"the labels of {dataset.name!r}", "ask for the summary only"
        )
    if not 1 <= k <= dataset.rows:
        raise InvalidInput(f"k must be between 1 and the dataset's {dataset.rows} rows, got {k}")
    if not 1 <= n_init <= MAX_N_INIT or max_iter < 1 or not (np.isfinite(tol) and tol >= 0):
        raise InvalidInput(
            f"need 1 <= n_init <= {MAX_N_INIT}, max_iter >= 1 and tol >= 0; got "
            f"n_init={n_init}, max_iter={max_iter}, tol={tol}"
        )
    weights = _weights(dataset, weight_column) if weight_column else None
    try:
        with stopping_when(should_stop):
            return dataset.index.kmeans(
                k, weights=weights, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol
            )
    except KMeansStopped as exc:
        raise Cancelled(str(exc)) from exc


def _weights(dataset: DatasetVersion, name: str) -> np.ndarray:
    if name in RESERVED or name not in dataset.table.column_names:
        raise InvalidInput(f"weight column {name!r} is not an attribute of {dataset.name!r}")
    col = dataset.table.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) or col.null_count:
        raise InvalidInput(f"weight column {name!r} must be numeric without nulls")
    w = column_numpy(dataset.table, name).astype(np.float64)
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


def label_table(dataset: DatasetVersion, result: KMeansResult) -> pa.Table:
    return pa.table(
        {"id": dataset.table.column("id"), "cluster": pa.array(result.labels, pa.int32())}
    )
