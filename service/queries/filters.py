"""Attribute filters (``where``) and areas (``within``): which of a dataset's points a
query searches.

A filter has the form pyarrow and Dask take as ``filters=``: a list of
``(column, op, value)`` predicates, ANDed, or a list of such lists, ORed. The ops are
``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in`` and ``not in`` (``value`` a
collection); any stored column may be named, ``id``, ``lat`` and ``lon`` included.
Values are typed against their column (:func:`check_filter`): numbers against integer
and floating columns (exactly: ``n < 2.5`` on integers is ``n <= 2``), strings against
string columns, booleans against bool columns, timestamps (or ISO 8601 strings) against
timestamp and date columns; anything else is INVALID_ARGUMENT naming the column. A null
never matches, not even ``!=`` or ``not in``.

An area (a box or a spherical polygon, ``geonear.service.analytics.areas``) selects the
points inside it; with a filter too, the points both select (AND). Everything below
holds for either or both: "the selected points" are those.

The rule for answering a filtered query: a temporary index of the selected points,
always. The dataset's own engine builds it (``engine.build_index(lat[rows], lon[rows])``
with ``rows = np.flatnonzero(mask)``), the query searches it, and the row numbers it
gives map back through ``rows``; when every point is selected the dataset's own index
serves, and when none is, an index of no points. Why: it is exact on every engine with
no engine changed (each engine's search is exact already, so the k nearest of the
selected points are exactly the reference's, which a post-filter of the k nearest
cannot promise), and it was the faster way at every selectivity measured. The other
way, the full index searched for k' = ceil(k / s x 1.25) + 8 neighbours (s the selected
fraction), masked, and searched wider for the queries left short, is exact too and
saves the build; ``benchmarks/filter_rule.py`` times both on one engine. On the cpu
engine (1M points, 100k queries, k = 10, 2-core host) the temporary index took 772,
591, 293 and 218 ms at 90%, 50%, 25% and 10% selected, the masked search 1,066, 1,264,
2,312 and 5,212 ms: a k-d tree of the selected points builds faster than the wider
search runs, even at 90%. On the GPU engine the build is cheaper still (a tenth of 1M
points in 0.7 ms, an H100, against 1.5 ms for the unfiltered search of 100k queries).
So the rule chosen by selectivity is the same at every selectivity.

Where the filter is evaluated: on the GPU engine's device table (cuDF) when it holds
every column the filter names in a type compared there exactly as here (integers up to
int64, floats, bools, strings); only the selected row numbers come back to the host.
Otherwise, and on every host engine, on the host table with pyarrow (:func:`row_mask`).

Built indexes are kept per (dataset version, filter, area) in a small LRU bounded by
entries and bytes (:class:`FilteredIndexes`), so repeated filtered queries don't rebuild. A
version never changes, so an entry never goes stale; the entries of a version go when
nothing holds the version any more.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from geonear.service.analytics.areas import Area
from geonear.service.engines import Engine, Neighbours, PointIndex, RadiusNeighbours
from geonear.service.errors import InvalidInput
from geonear.service.settings import physical_memory_bytes
from geonear.service.store import DatasetVersion, column_numpy

#: Most predicates of one filter: each costs a pass over the dataset's column, so a
#: request of a million of them would hold a thread for hours.
MAX_PREDICATES = 1000
#: The ops of a predicate; "=" is taken for "==", as pyarrow takes it.
OPS = ("==", "!=", "<", "<=", ">", ">=", "in", "not in")
_ORDERING = ("<", "<=", ">", ">=")
_COMPARE = {
    "==": pc.equal,
    "!=": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_SHOWN_COLUMNS = 20


@dataclass(frozen=True)
class Predicate:
    """``column op value``; ``values`` holds the one value of a comparison, or the
    collection of ``in`` / ``not in``."""

    column: str
    op: str
    values: tuple[Any, ...]


#: Conjunctions (tuples of predicates, ANDed), ORed.
Filter = tuple[tuple[Predicate, ...], ...]

_SHAPE = "where: give a list of (column, op, value) tuples, ANDed, or a list of such lists, ORed"


def parse_filter(where: Any) -> Filter | None:
    """A filter in pyarrow's ``filters=`` form, checked for shape; None for no filter.

    ``where`` is None, a list of ``(column, op, value)`` tuples (ANDed), or a list of
    such lists (ORed); an empty list is no filter. Raises InvalidInput on a bad shape,
    op or value (the values are typed against the columns by :func:`check_filter`).
    """
    if where is None:
        return None
    if isinstance(where, str | bytes) or not isinstance(where, Sequence):
        raise InvalidInput(f"{_SHAPE}; got {type(where).__name__}")
    items = list(where)
    if not items:
        return None
    # pyarrow's rule: a first item whose first item is a column name is one predicate.
    first = items[0]
    flat = isinstance(first, Sequence) and len(first) > 0 and isinstance(first[0], str)
    groups = [items] if flat else items
    conjunctions = []
    for group in groups:
        if isinstance(group, str | bytes) or not isinstance(group, Sequence):
            raise InvalidInput(f"{_SHAPE}; got {group!r}")
        if not group:
            raise InvalidInput("where: a conjunction (inner list) needs at least one predicate")
        conjunctions.append(tuple(_predicate(p) for p in group))
    count = sum(len(group) for group in conjunctions)
    if count > MAX_PREDICATES:
        raise InvalidInput(
            f"where: {count} predicates, more than a filter may hold ({MAX_PREDICATES}); "
            "use 'in' with a list for many values of one column"
        )
    return tuple(conjunctions)


def _predicate(item: Any) -> Predicate:
    if isinstance(item, str | bytes) or not isinstance(item, Sequence) or len(item) != 3:
        raise InvalidInput(f"where: a predicate is a (column, op, value) tuple; got {item!r}")
    column, op, value = item
    if not isinstance(column, str) or not column:
        raise InvalidInput(f"where: a predicate's column is a name; got {column!r}")
    op = "==" if op == "=" else op
    if not isinstance(op, str) or op.lower() not in OPS:
        raise InvalidInput(
            f"where: unknown op {op!r} on {column!r}; choose one of {', '.join(OPS)}"
        )
    op = op.lower()
    if op in ("in", "not in"):
        if isinstance(value, str | bytes) or not _is_collection(value):
            raise InvalidInput(
                f"where: {column!r} {op} takes a list of values; got {_shown(value)}"
            )
        return Predicate(column, op, tuple(_plain(v, column) for v in value))
    if _is_collection(value) and not isinstance(value, str | bytes):
        raise InvalidInput(
            f"where: {column!r} {op} takes one value; use 'in' for a list (got {_shown(value)})"
        )
    return Predicate(column, op, (_plain(value, column),))


def _is_collection(value: Any) -> bool:
    return isinstance(value, list | tuple | set | frozenset | np.ndarray)


def _plain(value: Any, column: str) -> Any:
    """A NumPy scalar as its Python value; datetime64 kept (its unit matters)."""
    if isinstance(value, np.datetime64):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if value is None:
        raise InvalidInput(f"where: {column!r} compared with null; a null never matches")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dt.date | np.datetime64):
        return "a timestamp"
    return f"a {type(value).__name__}"


# -- typing against the columns -------------------------------------------------------
@dataclass(frozen=True)
class _Checked:
    """A predicate typed against its column: ``values`` are of the column's kind, or
    ``constant`` says the answer is known without them ("all" non-null rows, "none")."""

    column: str
    kind: str  # int, float, string, bool, time
    op: str
    values: tuple[Any, ...]
    constant: str | None = None


CheckedFilter = tuple[tuple[_Checked, ...], ...]


def _column_kind(t: pa.DataType) -> str | None:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    return None


def check_filter(dataset: DatasetVersion, where: Filter) -> CheckedFilter:
    """``where`` typed against ``dataset``'s columns; InvalidInput names what is wrong.

    Two filters that select the same points by the same comparisons check to equal
    values (``n == 1.0`` and ``n == 1`` on an integer column), which key the LRU.
    """
    schema = dataset.table.schema
    return tuple(tuple(_check(dataset.name, schema, p) for p in group) for group in where)


def _check(name: str, schema: pa.Schema, p: Predicate) -> _Checked:
    if p.column not in schema.names:
        shown = schema.names[:_SHOWN_COLUMNS]
        more = ", ..." if len(schema.names) > _SHOWN_COLUMNS else ""
        raise InvalidInput(
            f"where: dataset {name!r} has no column {p.column!r}; it has {', '.join(shown)}{more}"
        )
    t = schema.field(p.column).type
    kind = _column_kind(t)
    if kind is None:
        raise InvalidInput(
            f"where: column {p.column!r} holds {t}, which filters cannot compare; filter "
            "on integer, floating, string, bool, timestamp or date columns"
        )
    if kind == "bool" and p.op in _ORDERING:
        raise InvalidInput(f"where: bool column {p.column!r} takes ==, !=, in or not in")
    if kind == "int":
        return _check_int(p, t)
    typed = tuple(_typed(p, kind, t, v) for v in p.values)
    if p.op in ("in", "not in"):
        typed = tuple(sorted(set(typed)))
    return _Checked(p.column, kind, p.op, typed)


def _refuse(p: Predicate, t: pa.DataType, value: Any, hint: str) -> InvalidInput:
    return InvalidInput(
        f"where: column {p.column!r} holds {t}; {p.op} {_shown(value)} "
        f"({_kind_name(value)}) cannot be compared with it: {hint}"
    )


def _number(p: Predicate, t: pa.DataType, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _refuse(p, t, value, "give a number")
    if isinstance(value, float) and math.isnan(value):
        raise InvalidInput(f"where: {p.column!r} {p.op} NaN: NaN never compares; give a number")
    return value


def _typed(p: Predicate, kind: str, t: pa.DataType, value: Any) -> Any:
    if kind == "float":
        number = _number(p, t, value)
        try:
            return float(number)
        except OverflowError:  # an integer beyond any double: beyond every value
            return math.copysign(math.inf, number)
    if kind == "string":
        if not isinstance(value, str):
            raise _refuse(p, t, value, "give a string")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise _refuse(p, t, value, "give true or false")
        return value
    return _nanoseconds(p, t, value)


def _nanoseconds(p: Predicate, t: pa.DataType, value: Any) -> int:
    """A timestamp value as nanoseconds since 1970-01-01 UTC."""
    if isinstance(value, np.datetime64):
        if np.isnat(value):
            raise InvalidInput(f"where: {p.column!r} {p.op} NaT: NaT never matches")
        return int(value.astype("datetime64[ns]").astype(np.int64))
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            raise _refuse(
                p, t, value, "give an ISO 8601 date or time (2024-05-01, 2024-05-01T12:00Z)"
            ) from None
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time())
    if not isinstance(value, dt.datetime):
        raise _refuse(p, t, value, "give a timestamp or an ISO 8601 string")
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    delta = value - _EPOCH
    nanos = int(getattr(value, "nanosecond", 0))  # pandas' Timestamp carries them
    return (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000 + nanos


def _check_int(p: Predicate, t: pa.DataType) -> _Checked:
    """Integer columns: every number compared exactly, as an integer bound or a constant."""
    value_type = t.value_type if pa.types.is_dictionary(t) else t
    info = np.iinfo(value_type.to_pandas_dtype())
    lo, hi = int(info.min), int(info.max)
    numbers = [_number(p, t, v) for v in p.values]
    if p.op in ("in", "not in"):
        kept = sorted({int(v) for v in numbers if _integral(v) and lo <= v <= hi})
        return _Checked(p.column, "int", p.op, tuple(kept))
    (v,) = numbers
    if p.op in ("==", "!="):
        if _integral(v) and lo <= v <= hi:
            return _Checked(p.column, "int", p.op, (int(v),))
        return _Checked(p.column, "int", p.op, (), "none" if p.op == "==" else "all")
    if math.isinf(v):
        below = (v > 0) == (p.op in ("<", "<="))  # x < inf, x > -inf: every row
        return _Checked(p.column, "int", p.op, (), "all" if below else "none")
    # x < v  <=>  x <= ceil(v) - 1;  x <= v  <=>  x <= floor(v);
    # x > v  <=>  x >= floor(v) + 1; x >= v  <=>  x >= ceil(v).
    if p.op == "<":
        op, bound = "<=", math.ceil(v) - 1
    elif p.op == "<=":
        op, bound = "<=", math.floor(v)
    elif p.op == ">":
        op, bound = ">=", math.floor(v) + 1
    else:
        op, bound = ">=", math.ceil(v)
    if op == "<=":
        if bound >= hi:
            return _Checked(p.column, "int", op, (), "all")
        if bound < lo:
            return _Checked(p.column, "int", op, (), "none")
    else:
        if bound <= lo:
            return _Checked(p.column, "int", op, (), "all")
        if bound > hi:
            return _Checked(p.column, "int", op, (), "none")
    return _Checked(p.column, "int", op, (bound,))


def _integral(v: int | float) -> bool:
    return isinstance(v, int) or (math.isfinite(v) and v == math.floor(v))


# -- the mask -----------------------------------------------------------------------
def row_mask(dataset: DatasetVersion, where: CheckedFilter) -> np.ndarray:
    """The rows of ``dataset`` that ``where`` (checked) selects, bool of shape (rows,)."""
    table = dataset.table
    columns: dict[str, pa.ChunkedArray] = {}
    selected = np.zeros(table.num_rows, dtype=bool)
    for group in where:
        both = np.ones(table.num_rows, dtype=bool)
        for p in group:
            if p.column not in columns:
                columns[p.column] = _comparable(table.column(p.column), p)
            both &= _predicate_mask(columns[p.column], p)
        selected |= both
    return selected


def _comparable(column: pa.ChunkedArray, p: _Checked) -> pa.ChunkedArray:
    """The column in a type its checked values compare with."""
    t = column.type
    if pa.types.is_dictionary(t):
        column = column.cast(t.value_type)
        t = t.value_type
    if p.kind == "float" and t != pa.float64():
        # Exact, and the values are doubles: float32 0.1 is not the double 0.1.
        return column.cast(pa.float64())
    if p.kind == "time":
        tz = t.tz if pa.types.is_timestamp(t) else None
        try:
            column = column.cast(pa.timestamp("ns", tz=tz))
        except pa.ArrowInvalid as exc:
            raise InvalidInput(
                f"where: column {p.column!r} holds times beyond what nanoseconds reach "
                f"(1677-2262): {exc}"
            ) from exc
    return column


def _scalar_type(column: pa.ChunkedArray, p: _Checked) -> pa.DataType:
    return pa.float64() if p.kind == "float" else column.type


def _predicate_mask(column: pa.ChunkedArray, p: _Checked) -> np.ndarray:
    if p.constant == "none":
        return np.zeros(len(column), dtype=bool)
    if p.constant == "all":
        return _numpy(pc.is_valid(column))
    value_type = _scalar_type(column, p)
    if p.op in ("in", "not in"):
        found = _numpy(pc.is_in(column, value_set=pa.array(p.values, type=value_type)))
        return found if p.op == "in" else _numpy(pc.is_valid(column)) & ~found
    (value,) = p.values
    hit = _COMPARE[p.op](column, pa.scalar(value, type=value_type))
    return _numpy(hit.fill_null(False))


def _numpy(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=bool)


# -- the points searched ------------------------------------------------------------
@dataclass(frozen=True)
class PointSelection:
    """The points a query searches and an index over exactly them.

    ``rows`` is the dataset row of each indexed point, None where the index is the
    dataset's own (no filter, or every point selected).
    """

    index: PointIndex
    rows: np.ndarray | None = None

    @property
    def n_points(self) -> int:
        return int(self.index.n_points)

    def dataset_rows(self, found: np.ndarray, *, full: bool = False) -> np.ndarray:
        """Dataset rows of the index rows ``found``; -1 (no neighbour) stays -1. ``full``:
        the caller knows ``found`` has no -1 (a full KNN answer, ``NeighbourGrid.full``, or
        a radius answer, which lists found neighbours only), so none is looked for."""
        if self.rows is None or found.size == 0:
            return found
        if full:
            return self.rows[found]
        rows = self.rows[np.maximum(found, 0)]
        return np.where(found >= 0, rows, -1) if (found < 0).any() else rows


def all_points(dataset: DatasetVersion) -> PointSelection:
    return PointSelection(dataset.index)


class NoPoints(PointIndex):
    """The index of a filter that selects nothing: every answer is empty."""

    n_points = 0

    @property
    def host_bytes(self) -> int:
        return 0

    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        n = int(np.shape(lat)[0])
        return Neighbours(np.empty((n, 0)), np.empty((n, 0), dtype=np.int64))

    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        n = int(np.shape(lat)[0])
        return RadiusNeighbours(
            np.zeros(n + 1, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0)
        )

    def radius_count(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> np.ndarray:
        return np.zeros(int(np.shape(lat)[0]), dtype=np.int64)

    def kmeans(self, k: int, **options: Any) -> Any:
        raise InvalidInput("the filter selects no points to cluster")


#: Filtered indexes kept at once.
CACHE_ENTRIES = 8
#: Bytes they may hold together: a sixteenth of the host's memory, at least 256 MiB.
#: An index larger than that is built for its query and not kept.
CACHE_MIN_BYTES = 256 << 20


def default_cache_bytes() -> int:
    return max(CACHE_MIN_BYTES, physical_memory_bytes() // 16)


#: What keys a selection's index: dataset version (its id), checked filter, area.
_Key = tuple[int, CheckedFilter | None, Area | None]


@dataclass(frozen=True)
class _Entry:
    rows: np.ndarray | None  # None: every row (the dataset's own index serves)
    index: PointIndex | None  # None with rows None
    nbytes: int


class FilteredIndexes:
    """Indexes of the points filters and areas select, per (dataset version, filter,
    area), in an LRU.

    Bounded by ``max_entries`` and ``max_bytes`` (host and device bytes of the indexes
    and their row maps). Concurrent queries with one new filter build its index once.
    """

    def __init__(
        self, engine: Engine, max_entries: int = CACHE_ENTRIES, max_bytes: int | None = None
    ) -> None:
        self.engine = engine
        self.max_entries = max_entries
        self.max_bytes = default_cache_bytes() if max_bytes is None else max_bytes
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._building: dict[_Key, threading.Lock] = {}
        self._watched: dict[int, weakref.ref[DatasetVersion]] = {}
        self._gone: list[int] = []
        self._lock = threading.Lock()
        self.builds = 0  # indexes built, for tests and logs

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def select(
        self, dataset: DatasetVersion, where: Filter | None, area: Area | None = None
    ) -> PointSelection:
        """The points of ``dataset`` that ``where`` selects and ``area`` holds (None:
        no condition), with their index."""
        if where is None and area is None:
            return all_points(dataset)
        checked = None if where is None else check_filter(dataset, where)
        key = (id(dataset), checked, area)
        entry = self._lookup(key)
        if entry is None:
            with self._lock:
                building = self._building.setdefault(key, threading.Lock())
            with building:
                entry = self._lookup(key)
                if entry is None:
                    entry = self._build(dataset, checked, area)
                    self._keep(dataset, key, entry)
            with self._lock:
                self._building.pop(key, None)
        if entry.rows is None:
            return all_points(dataset)
        assert entry.index is not None
        return PointSelection(entry.index, entry.rows)

    def _lookup(self, key: _Key) -> _Entry | None:
        with self._lock:
            self._forget_gone()
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def _build(
        self, dataset: DatasetVersion, checked: CheckedFilter | None, area: Area | None
    ) -> _Entry:
        rows = _rows(dataset, checked, area)
        if rows.shape[0] == dataset.rows:
            return _Entry(None, None, 0)
        if rows.shape[0] == 0:
            return _Entry(rows, NoPoints(), 0)
        lat = column_numpy(dataset.table, "lat")[rows]
        lon = column_numpy(dataset.table, "lon")[rows]
        index = self.engine.build_index(lat, lon)
        self.builds += 1
        return _Entry(rows, index, int(rows.nbytes + index.host_bytes + index.device_bytes))

    def _keep(self, dataset: DatasetVersion, key: _Key, entry: _Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            if key[0] not in self._watched:
                # The callback runs when the version is freed; its entries go at the next
                # lookup (a callback takes no lock: it may run inside a locked section).
                gone = self._gone

                def forget(_: object, version: int = key[0]) -> None:
                    gone.append(version)

                self._watched[key[0]] = weakref.ref(dataset, forget)
            self._entries[key] = entry
            total = sum(e.nbytes for e in self._entries.values())
            while len(self._entries) > self.max_entries or total > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                total -= evicted.nbytes

    def _forget_gone(self) -> None:
        while self._gone:
            gone = self._gone.pop()
            self._watched.pop(gone, None)
            for key in [k for k in self._entries if k[0] == gone]:
                del self._entries[key]


def _rows(dataset: DatasetVersion, checked: CheckedFilter | None, area: Area | None) -> np.ndarray:
    """Rows that ``checked`` selects and ``area`` holds, in row order (at least one set)."""
    rows = None if checked is None else _filter_rows(dataset, checked)
    if area is None:
        assert rows is not None
        return rows
    # The area tests only the rows the filter kept: a polygon's test costs per point.
    return dataset.index.area_rows(dataset.lat, dataset.lon, area, rows)


def _filter_rows(dataset: DatasetVersion, checked: CheckedFilter) -> np.ndarray:
    """Rows ``checked`` selects, evaluated where the index keeps the columns (the GPU
    engine's device table), else on the host table."""
    rows = dataset.index.filter_rows(checked)
    return np.flatnonzero(row_mask(dataset, checked)) if rows is None else rows


def selected_rows(
    dataset: DatasetVersion, where: Filter | None, area: Area | None = None
) -> np.ndarray | None:
    """Row numbers of the points ``where`` selects and ``area`` holds, in row order;
    None for all of them."""
    if where is None and area is None:
        return None
    checked = None if where is None else check_filter(dataset, where)
    rows = _rows(dataset, checked, area)
    return None if rows.shape[0] == dataset.rows else rows
