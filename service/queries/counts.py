"""Counts within a radius: how many dataset points lie within radius_m of each query.

Only the counts are made and sent, never the points: each comes from the index's exact
``radius_count`` (the same points a radius query returns), so a count costs the
search and nothing of the gathering. The queries are points sent with the request, or
every point of a second stored dataset (``left``); the answer is a table of
``query_index`` (or ``left_id``) and ``count``, made a table of COUNT_SEARCH queries
(one engine call) at a time and sent in messages of about 512 KiB.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from geonear.service.engines import Capability, require
from geonear.service.errors import Cancelled, InvalidInput
from geonear.service.queries.common import (
    check_queries,
    check_result_rows,
    take_columns,
)
from geonear.service.queries.filters import PointSelection, all_points
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion
from geonear.wire import Narrowing, narrowed, narrowest_integer

#: Queries counted in one engine call (8 bytes of answer each, 64 MB at most), sent as
#: one table (views of the ids and the counts, cut into messages by the encoder): a
#: device engine pays a fixed cost a call, which 1M left points in slices paid eight
#: times, and a table costs about 0.15 ms of the server's thread to make and encode.
COUNT_SEARCH = 1 << 23


@dataclass(frozen=True)
class CountQuery:
    """A checked count request: points of ``dataset`` (those ``points`` selects) within
    ``radius_m`` of each query, the queries being ``left``'s points where it is set."""

    dataset: DatasetVersion
    lat: np.ndarray
    lon: np.ndarray
    radius_m: float
    points: PointSelection
    left: DatasetVersion | None = None

    @property
    def n_queries(self) -> int:
        return int(self.lat.shape[0])


def count_query(
    dataset: DatasetVersion,
    lat: np.ndarray,
    lon: np.ndarray,
    radius_m: float,
    *,
    points: PointSelection | None = None,
    left: DatasetVersion | None = None,
    limits: Limits,
) -> CountQuery:
    """The request, checked; an answer beyond ``max_result_rows`` rows (one a query) is
    refused before any counting. The points of a stored ``left`` dataset were checked
    when they were stored: ``max_query_points`` bounds request messages, not them."""
    require(dataset.engine, Capability.RADIUS, "counting points within a radius")
    if not (np.isfinite(radius_m) and radius_m >= 0):
        raise InvalidInput(f"radius_m must be a finite number >= 0, got {radius_m}")
    if left is None:
        check_queries(lat, lon, limits)
        what = f"counts for {lat.shape[0]} queries"
    else:
        what = f"counts for the {left.rows} points of {left.name!r}"
    check_result_rows(int(lat.shape[0]), limits, what)
    return CountQuery(dataset, lat, lon, float(radius_m), points or all_points(dataset), left)


def count_tables(
    query: CountQuery,
    earth_radius_m: float,
    is_active: Callable[[], bool] = lambda: True,
    *,
    narrow: bool = False,
) -> Iterator[pa.Table]:
    """The answer a table of COUNT_SEARCH queries at a time (one engine call each):
    query_index (or left_id) and count. ``narrow``: the integer columns travel in the
    smallest types that hold them (``narrow_integers``), the counts in one that holds
    the largest of the answer's when one engine call counts them all, else the number
    of points searched."""
    n = query.n_queries
    types: dict[str, Narrowing] = {}
    if n == 0:
        yield _table(query, 0, 0, np.zeros(0, dtype=np.int64), earth_radius_m, types)
        return
    for start in range(0, n, COUNT_SEARCH):
        if not is_active():
            raise Cancelled("the call was cancelled; its counting stopped")
        stop = min(n, start + COUNT_SEARCH)
        counts = query.points.index.radius_count(
            query.lat[start:stop], query.lon[start:stop], query.radius_m
        )
        if narrow and start == 0:
            types = _narrow_types(query, int(counts.max()) if stop == n else None)
        yield _table(query, start, stop, counts, earth_radius_m, types)


def _narrow_types(query: CountQuery, largest: int | None) -> dict[str, Narrowing]:
    """The answer's types with ``narrow``, ``largest`` the largest count where known."""
    bound = query.points.n_points if largest is None else largest
    types = {"count": Narrowing(narrowest_integer(0, bound))}
    if query.left is None:
        types["query_index"] = Narrowing(narrowest_integer(0, query.n_queries - 1))
    elif query.left.narrow_id_type is not None:
        types["left_id"] = Narrowing(query.left.narrow_id_type)
    return types


def _table(
    query: CountQuery,
    start: int,
    stop: int,
    counts: np.ndarray,
    earth_radius_m: float,
    types: dict[str, Narrowing],
) -> pa.Table:
    metadata = {
        "geonear.dataset": query.dataset.name,
        "geonear.version": str(query.dataset.version),
        "geonear.earth_radius_m": repr(earth_radius_m),
    }
    if query.left is None:
        name = "query_index"
        key = pa.array(np.arange(start, stop, dtype=_sent(types, name).to_pandas_dtype()))
    else:
        # A view of the ids (the kept narrow ones when sent narrow): no cast, no gather.
        rows = slice(start, stop)
        key = take_columns(query.left, ("id",), rows, narrow_ids="left_id" in types)["id"]
        name = "left_id"
        metadata["geonear.left_dataset"] = query.left.name
        metadata["geonear.left_version"] = str(query.left.version)
    # Made in the type it travels in (``narrowed`` then keeps it): one NumPy cast.
    count = pa.array(np.asarray(counts, dtype=_sent(types, "count").to_pandas_dtype()))
    table = pa.table({name: key, "count": count}).replace_schema_metadata(metadata)
    return narrowed(table, types) if types else table


def _sent(types: dict[str, Narrowing], name: str) -> pa.DataType:
    """The type column ``name`` travels in: its narrow one where ``types`` has one."""
    return types[name].sent if name in types else pa.int64()
