"""Pieces every query kind shares: checking query points and answer sizes, cutting
answers into slices and shaping result tables.

A neighbour answer's size is known before the search: queries x min(k, rows) for KNN,
the engine's count for radius. A call beyond ``max_result_rows`` is refused then; a
larger one is searched and sent a slice of queries at a time, so that what a call holds
is bounded by its slice, not by its answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa

from geonear.service.batching import Batcher
from geonear.service.engines import ENGINES
from geonear.service.errors import (
    Cancelled,
    ColumnNotFound,
    InvalidInput,
    LimitExceeded,
    ResultTooLarge,
)
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion
from geonear.service.validation import RESERVED, check_coordinates

T = TypeVar("T")

#: Result rows of one slice of a streamed answer: about 20 MB held on the server while
#: the slice is searched, assembled and sent (~150 bytes a row). 100k queries at k=10 on
#: 1,000 points through the Python client, 2 shared cores: the server's peak grew by
#: 155 MB as one slice, 45 MB in slices of 2**17 rows, for about 7% more server CPU
#: (2**15: 35 MB, more per slice; 2**19: 100 MB, no faster).
SLICE_ROWS = 1 << 17
#: Result rows of queries one device engine call searches for a streamed KNN answer,
#: which is then cut into SLICE_ROWS slices to assemble and send. The engine's own answer
#: costs 16 bytes a row (16 MB here) against about 150 for an assembled slice, and a
#: device engine pays a fixed cost a call: on an H100, 100k queries at k = 10 took 1.2 ms
#: in one call and about 50 ms as eight calls of one slice each. A host engine searches
#: one slice a call, the next one ahead (``searched_ahead``) while this one is assembled
#: and sent.
SEARCH_ROWS = 8 * SLICE_ROWS
#: Most result rows of one batched engine call. The batcher asks the largest k of a
#: batch for all its queries, so only requests whose answer averages at most
#: BATCH_ROWS / max_points rows a query are batched (k <= 16 at 8192 points a batch).
BATCH_ROWS = SLICE_ROWS


def check_queries(lat: np.ndarray, lon: np.ndarray, limits: Limits) -> None:
    if lat.shape[0] > limits.max_query_points:
        raise LimitExceeded(
            f"{lat.shape[0]} query points exceed max_query_points={limits.max_query_points} "
            "(setting GEONEAR_MAX_QUERY_POINTS); send them in several requests"
        )
    check_coordinates(lat, lon, "query points")


def check_result_rows(
    rows: int, limits: Limits, what: str, advice: str = "send fewer query points per call"
) -> None:
    """Refuse an answer of ``rows`` result rows beyond ``max_result_rows``, before any work."""
    cap = limits.result_rows()
    if rows > cap:
        raise ResultTooLarge(
            f"{what} would hold {rows} result rows, more than max_result_rows={cap} "
            f"(setting GEONEAR_MAX_RESULT_ROWS); {advice}",
            setting="GEONEAR_MAX_RESULT_ROWS",
        )


def fixed_slices(
    n_queries: int, rows_per_query: int, slice_rows: int = SLICE_ROWS
) -> list[tuple[int, int]]:
    """(start, stop) of the query slices of an answer of ``rows_per_query`` rows a query:
    ``slice_rows`` rows a slice, at least one query; one empty slice for no queries."""
    step = max(1, slice_rows // max(1, rows_per_query))
    return [(a, min(n_queries, a + step)) for a in range(0, max(1, n_queries), step)]


def search_rows(dataset: DatasetVersion) -> int:
    """Result rows one engine call searches for a streamed answer (see SEARCH_ROWS)."""
    spec = ENGINES.get(dataset.engine)
    return SEARCH_ROWS if spec is not None and spec.device_kind == "gpu" else SLICE_ROWS


def searched_ahead(
    bounds: Sequence[tuple[int, int]], search: Callable[[int, int], T]
) -> Iterator[tuple[int, int, T]]:
    """``(start, stop, search(start, stop))`` for each of ``bounds`` in order, the next
    one searched on a thread of its own while the caller works on this one (assembles
    and encodes it): one search ahead at most, so a call holds two searches' answers.
    Closing the iterator early waits for the search in flight."""
    searched = ((start, stop, search(start, stop)) for start, stop in bounds)
    return searched if len(bounds) <= 1 else made_ahead(searched)


def made_ahead(items: Iterator[T]) -> Iterator[T]:
    """The items, the next one made on a thread of its own while the caller works on
    this one: one ahead at most. Closing early waits for the item in flight and closes
    ``items``."""
    done = object()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="geonear-search")
    try:
        pending = pool.submit(next, items, done)
        while True:
            item = pending.result()
            if item is done:
                return
            pending = pool.submit(next, items, done)
            yield item  # type: ignore[misc]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(items, "close", None)
        if close is not None:
            close()


def counted_slices(counts: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of consecutive query slices of about SLICE_ROWS result rows each,
    ``counts`` being each query's rows; a query of more rows is a slice of its own."""
    n = int(counts.shape[0])
    if n == 0:
        return [(0, 0)]
    first_row = np.cumsum(counts) - counts
    slice_of = first_row // SLICE_ROWS
    cuts = (np.flatnonzero(np.diff(slice_of)) + 1).tolist()
    bounds = [0, *cuts, n]
    return list(itertools.pairwise(bounds))


def batchable(batcher: Batcher | None, n_queries: int, rows: int) -> Batcher | None:
    """The batcher, where a request of ``rows`` result rows may share its engine call."""
    if batcher is None or n_queries >= batcher.max_points:
        return None
    return batcher if rows * batcher.max_points <= BATCH_ROWS * max(1, n_queries) else None


def check_columns(dataset: DatasetVersion, columns: Sequence[str]) -> list[str]:
    """The requested attribute columns, each present in the dataset."""
    names = dataset.table.column_names
    out = []
    for name in columns:
        if name in ("id", "query_index", "rank", "distance_m"):
            raise InvalidInput(
                f"column {name!r} is always returned; ask for attributes, lat or lon"
            )
        if name not in names:
            raise ColumnNotFound(
                f"dataset {dataset.name!r} has no column {name!r}; it has "
                f"{', '.join(n for n in names if n not in RESERVED) or 'no attributes'}"
            )
        out.append(name)
    return out


#: Layouts of a streamed answer (the proto's ResultLayout), by their metadata names.
LAYOUTS = ("rows", "per_query")


def _metadata(dataset: DatasetVersion, earth_radius_m: float, layout: str) -> dict[str, str]:
    return {
        "geonear.dataset": dataset.name,
        "geonear.version": str(dataset.version),
        "geonear.earth_radius_m": repr(earth_radius_m),
        "geonear.layout": layout,
    }


def take_columns(
    dataset: DatasetVersion,
    names: Sequence[str],
    rows: np.ndarray | slice,
    *,
    narrow_ids: bool = False,
    ids: np.ndarray | None = None,
) -> dict[str, pa.Array | pa.ChunkedArray]:
    """Columns ``names`` at dataset ``rows``: where the index holds them, else the host
    table; integer ids by one NumPy gather of the id column's view (``narrow_ids``: of
    the ids in the dataset's ``narrow_id_type``, for an answer sent narrow), or ``ids``
    where the engine gathered them at ``rows`` (in that type: ``knn_with_ids``). ``rows``
    a slice (consecutive rows): every column is a view, no gather."""
    taken: dict[str, pa.Array | pa.ChunkedArray] = {}
    wide = dataset.int_ids
    if "id" in names and wide is not None:
        if ids is None:
            narrow = dataset.narrow_ids if narrow_ids else None
            ids = _at(wide if narrow is None else narrow, rows)
        elif not narrow_ids:
            ids = ids.astype(wide.dtype, copy=False)
        taken["id"] = pa.array(ids)
    if "lat" in names:
        taken["lat"] = pa.array(_at(dataset.lat, rows), type=pa.float64())
    if "lon" in names:
        taken["lon"] = pa.array(_at(dataset.lon, rows), type=pa.float64())
    wanted = [name for name in names if name not in taken]
    if isinstance(rows, slice):
        start, stop, _ = rows.indices(dataset.rows)
        for name in wanted:
            taken[name] = dataset.table.column(name).slice(start, stop - start)
        return taken
    if wanted:
        taken.update(dataset.index.take_columns(wanted, rows))
    rest = [name for name in wanted if name not in taken]
    if rest:
        at = pa.array(rows, type=pa.int64())
        for name in rest:
            taken[name] = dataset.table.column(name).take(at)
    return taken


def _at(values: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
    """``values[rows]``: a view for a slice; for row numbers ``np.take``, which releases
    the GIL and beat fancy indexing by a fifth (5M random rows of 1M int32 ids: 9.2 ->
    8.0 ms on the 2-core host; a 1M x 5 per-query join's assembly 19-22 -> 16-17 ms)."""
    return values[rows] if isinstance(rows, slice) else np.take(values, rows)


def label_tables(
    dataset: DatasetVersion,
    rows: np.ndarray | None,
    labels: np.ndarray,
    label_type: pa.DataType,
    is_active: Callable[[], bool] = lambda: True,
) -> Iterator[pa.Table]:
    """``id`` and ``cluster`` of each clustered point (dataset ``rows``, None: every row),
    in row order, SLICE_ROWS rows a table: k-means and DBSCAN labels."""
    n = int(labels.shape[0])
    for start in range(0, max(1, n), SLICE_ROWS):
        if not is_active():
            raise Cancelled("the call was cancelled; sending the labels stopped")
        stop = min(n, start + SLICE_ROWS)
        if rows is None:  # a slice of the id column, no copy
            ids = dataset.table.column("id").slice(start, stop - start)
        else:
            ids = take_columns(dataset, ("id",), rows[start:stop])["id"]
        yield pa.table({"id": ids, "cluster": pa.array(labels[start:stop], label_type)})


@dataclass(frozen=True)
class NeighbourRows:
    """Neighbour result rows in query order, nearest first per query.

    ``rows`` are dataset row numbers; ``table()`` adds ids and attribute columns.
    ``offsets``, where known (radius), start each query's rows: query q's are
    ``offsets[q]:offsets[q + 1]``.
    """

    dataset: DatasetVersion
    query_index: np.ndarray  # int64
    rank: np.ndarray  # int32
    rows: np.ndarray  # int64
    distances_m: np.ndarray  # float64
    columns: tuple[str, ...] = ()
    offsets: np.ndarray | None = None
    #: The ids at ``rows`` where the engine gathered them (``NeighbourGrid``'s).
    gathered_ids: np.ndarray | None = None

    @property
    def count(self) -> int:
        return int(self.rows.shape[0])

    def ids(self) -> pa.Array | pa.ChunkedArray:
        return take_columns(self.dataset, ("id",), self.rows)["id"]

    def table(
        self, earth_radius_m: float, layout: str = "rows", *, narrow_ids: bool = False
    ) -> pa.Table:
        """The rows in ``layout``: "rows" gives query_index, rank, id, distance_m, then
        the requested attributes; "per_query" (needs ``offsets``) one list of each a
        query. ``narrow_ids``: integer ids in the dataset's narrow id type."""
        names = ("id", *self.columns)
        taken = take_columns(
            self.dataset, names, self.rows, narrow_ids=narrow_ids, ids=self.gathered_ids
        )
        distances = pa.array(self.distances_m, type=pa.float64())
        if layout == "per_query":
            if self.offsets is None:
                raise ValueError("a per-query table needs the queries' offsets")
            offsets = pa.array(self.offsets, type=pa.int32())
            data = {
                "id": pa.ListArray.from_arrays(offsets, _one_chunk(taken["id"])),
                "distance_m": pa.ListArray.from_arrays(offsets, distances),
            }
            for name in self.columns:
                data[name] = pa.ListArray.from_arrays(offsets, _one_chunk(taken[name]))
        else:
            data = {
                "query_index": pa.array(self.query_index, type=pa.int64()),
                "rank": pa.array(self.rank, type=pa.int32()),
                "id": taken["id"],
                "distance_m": distances,
            }
            for name in self.columns:
                data[name] = taken[name]
        return pa.table(data).replace_schema_metadata(
            _metadata(self.dataset, earth_radius_m, layout)
        )


@dataclass(frozen=True)
class NeighbourGrid:
    """KNN neighbours of a slice of queries as the engine gives them: (n, k') row numbers
    (-1 where a query has fewer) and distances, query ``first_query + i`` in row i."""

    dataset: DatasetVersion
    indices: np.ndarray  # int64 (n, k')
    distances_m: np.ndarray  # float64 (n, k')
    first_query: int = 0
    columns: tuple[str, ...] = ()
    #: (n, k') ids at ``indices`` in the dataset's ``narrow_id_type`` where the engine
    #: gathered them (``PointIndex.knn_with_ids``; any value where ``indices`` is -1).
    gathered_ids: np.ndarray | None = None
    #: Whether every query is known to have k' neighbours (no -1 in ``indices``): an
    #: answer without a distance bound. The tables then skip looking for missing ones,
    #: which reads every row number (a 1M x 5 per-query join's 40 MB of them, on the
    #: GPU host 10 ms of its assembly, and nothing else reads them there).
    full: bool = False

    def neighbour_rows(self) -> NeighbourRows:
        valid = None if self.full else self.indices >= 0
        n, width = self.indices.shape
        query_index: np.ndarray
        rank: np.ndarray
        ids = self.gathered_ids
        # Where every query has k' neighbours, the layout gives their positions.
        if valid is None or valid.all():
            query_index = np.repeat(np.arange(n, dtype=np.int64), width)
            rank = np.tile(np.arange(width, dtype=np.int32), n)
            rows, distances = self.indices.reshape(-1), self.distances_m.reshape(-1)
            ids = None if ids is None else ids.reshape(-1)
        else:  # 100k queries at k = 10: 15.7 ms this way, 1.5 ms the other
            query_index, rank = np.nonzero(valid)
            rows, distances = self.indices[valid], self.distances_m[valid]
            ids = None if ids is None else ids[valid]
        if self.first_query:
            query_index += self.first_query
        return NeighbourRows(
            self.dataset,
            query_index.astype(np.int64, copy=False),
            rank.astype(np.int32, copy=False),
            rows,
            distances,
            self.columns,
            gathered_ids=ids,
        )

    def table(
        self, earth_radius_m: float, layout: str = "rows", *, narrow_ids: bool = False
    ) -> pa.Table:
        """As ``NeighbourRows.table``; "per_query" gives fixed-size lists of k', null
        where a query has fewer neighbours, without materialising query_index or rank."""
        if layout != "per_query":
            return self.neighbour_rows().table(earth_radius_m, layout, narrow_ids=narrow_ids)
        n, width = self.indices.shape
        ids = self.gathered_ids
        full = self.full
        if width == 0:
            # No point searched (a filter that selects none): lists of one null entry,
            # as Arrow's IPC has no use for lists of none.
            width, indices, ids = 1, np.full((n, 1), -1, dtype=np.int64), None
            distances_m, full = np.full((n, 1), np.inf), False
        else:
            indices, distances_m = self.indices, self.distances_m
        missing = None if full else indices < 0
        if missing is not None and missing.any():
            mask = missing.ravel()
            rows = np.where(missing, 0, indices).ravel()
        else:
            mask, rows = None, indices.ravel()
        names = ("id", *self.columns)
        if mask is not None and mask.all():
            schema = self.dataset.table.schema
            taken = {name: pa.nulls(rows.shape[0], schema.field(name).type) for name in names}
        else:
            gathered = None if ids is None else ids.ravel()
            taken = take_columns(self.dataset, names, rows, narrow_ids=narrow_ids, ids=gathered)
        data = {"id": taken["id"], "distance_m": pa.array(distances_m.ravel(), mask=mask)}
        for name in self.columns:
            data[name] = taken[name]
        valid = None if mask is None else pa.array(~mask)
        lists = {}
        for name, values in data.items():
            values = _one_chunk(values)
            if valid is not None and name != "distance_m":
                values = pa.compute.if_else(valid, values, pa.scalar(None, values.type))
            lists[name] = pa.FixedSizeListArray.from_arrays(values, width)
        return pa.table(lists).replace_schema_metadata(
            _metadata(self.dataset, earth_radius_m, layout)
        )


def _one_chunk(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks()
    return values
