"""DBSCAN over a dataset: the request checked, ``where`` applied, the stop wired in.

The clustering is ``geonear.service.analytics.dbscan``; this module decides which
points it sees (those a filter selects), which index it searches, and turns its errors
into the service's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from geonear.service.analytics.dbscan import (
    DbscanResult,
    DbscanStopped,
    TooManyNeighbours,
)
from geonear.service.analytics.dbscan import dbscan as dbscan_points
from geonear.service.engines import Capability, engine_spec
from geonear.service.errors import Cancelled, InvalidInput, LimitExceeded
from geonear.service.queries.common import check_result_rows
from geonear.service.queries.filters import PointSelection, all_points
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion

#: A core point needing more neighbours than this is no density anyone means; the bound
#: keeps the refusal explicit instead of a run that can only find noise.
MAX_MIN_SAMPLES = 1_000_000


@dataclass(frozen=True)
class DbscanAnswer:
    """The clustering of ``dataset``'s points that ``rows`` names (None: all of them)."""

    dataset: DatasetVersion
    rows: np.ndarray | None
    result: DbscanResult


def dbscan(
    dataset: DatasetVersion,
    eps_m: float,
    min_samples: int,
    *,
    points: PointSelection | None = None,
    return_labels: bool = False,
    earth_radius_m: float,
    limits: Limits,
    should_stop: Callable[[], bool] | None = None,
) -> DbscanAnswer:
    """DBSCAN of the points ``points`` selects; Cancelled once ``should_stop()`` is True.

    Labels (one row a selected point) beyond ``max_result_rows`` are refused before the
    clustering starts; an ``eps_m`` whose neighbourhoods hold more than
    ``max_dbscan_pairs`` (point, neighbour) pairs, before any neighbour list is made.
    """
    if not (np.isfinite(eps_m) and eps_m > 0):
        raise InvalidInput(f"eps_m must be a finite number of metres > 0, got {eps_m}")
    if not 1 <= min_samples <= MAX_MIN_SAMPLES:
        raise InvalidInput(
            f"min_samples must be between 1 and {MAX_MIN_SAMPLES}, got {min_samples}"
        )
    selection = points or all_points(dataset)
    if return_labels:
        check_result_rows(
            selection.n_points,
            limits,
            f"the labels of {dataset.name!r}",
            "ask for the summary only, or select fewer points with where",
        )
    rows = selection.rows
    lat, lon = dataset.lat, dataset.lon
    if rows is not None:
        lat, lon = lat[rows], lon[rows]
    # DBSCAN searches the engine's own index where it lives in this process and answers
    # radius queries; with any other (Dask's partitions, cuML's) it builds a cKDTree.
    spec = engine_spec(dataset.engine)
    index = selection.index if spec.local_index and spec.can(Capability.RADIUS) else None
    try:
        result = dbscan_points(
            lat,
            lon,
            float(eps_m),
            int(min_samples),
            index=index,
            earth_radius_m=earth_radius_m,
            max_neighbour_pairs=limits.max_dbscan_pairs,
            should_stop=should_stop,
        )
    except TooManyNeighbours as exc:
        raise LimitExceeded(
            f"{exc} (max_dbscan_pairs={exc.limit}, setting GEONEAR_MAX_DBSCAN_PAIRS)"
        ) from exc
    except DbscanStopped as exc:
        raise Cancelled(str(exc)) from exc
    return DbscanAnswer(dataset, rows, result)
