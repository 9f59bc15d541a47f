"""A dataset's ids and attributes on the device: a cuDF table beside the GPU index.

With cuDF installed the GPU engine copies the id and attribute columns to the device once,
when a dataset version is built (``DeviceTable.from_arrow``). A large result with attribute
columns gathers its rows there and comes back as one Arrow table (``take``), instead of
pyarrow's single-thread ``take`` over the host table. Measured on an H200 (1M-row table,
int64 id, a string and an int64 attribute; docs/benchmarks.md): the three columns at
262,144 rows took 4.4 ms on the device and 7.3 ms on the host, and 171 against 304 ms at
10M rows; but a cuDF call costs 1.5-2.5 ms whatever its size, and the ids alone were
faster on the host up to several million rows (3.5 against 4.4 ms at 1M). So the device
gathers results of at least ``DEVICE_TAKE_FROM`` rows that ask for attributes; the rest
use the host table.

Filters (``where``) are evaluated on the same table (``filter_mask``) where it holds
their columns: the selected rows come back as row numbers, and the columns never leave
the device.

The host Arrow table stays the dataset's record (persistence, GetDataset, uploads that
append), so answers never depend on where the rows were gathered: a column whose Arrow
type does not survive the round trip through cuDF unchanged (checked when the table is
built on a sample of rows) is left out of the device table and gathered on the host.

cuDF is imported here only, when the GPU engine first keeps a table (or a test asks
``cudf_available``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger("geonear.gpu")

#: Results of at least this many rows, with attribute columns, are gathered on the device.
DEVICE_TAKE_FROM = 262_144
#: Rows round-tripped through cuDF to check that every column keeps its type and values.
_CHECK_ROWS = 256


_cudf: Any = None  # the cudf module once probed; False when it is missing


def cudf_available() -> bool:
    """Whether cuDF imports here (probed once; a broken install is logged, not raised)."""
    global _cudf
    if _cudf is None:
        try:
            import cudf

            _cudf = cudf
        except ImportError:
            _cudf = False
        except Exception as exc:  # a CUDA or library mismatch fails in many ways
            log.warning("cuDF cannot be used (%s): ids and attributes stay on the host", exc)
            _cudf = False
    return _cudf is not False


class DeviceTable:
    """Columns of a dataset version held on the device, in row order.

    Attributes
    ----------
    columns : frozenset of str
        The columns on the device; the rest of the host table is gathered on the host.
    host_only : tuple of str
        Columns left on the host because cuDF would change their type or values.
    nbytes : int
        Device memory of the columns.
    """

    def __init__(self, frame: Any, types: dict[str, pa.DataType], host_only: tuple[str, ...]):
        self._frame = frame
        self._types = types
        self.columns = frozenset(types)
        self.host_only = host_only
        self.nbytes = int(frame.memory_usage(index=False).sum()) if types else 0

    @classmethod
    def from_arrow(cls, table: pa.Table) -> DeviceTable | None:
        """The columns of ``table`` cuDF holds unchanged; None without cuDF or columns.

        A column cuDF cannot hold (a type it lacks) or would change stays on the host;
        running out of device memory is raised (the upload fails, RESOURCE_EXHAUSTED).
        """
        if not cudf_available() or table.num_columns == 0:
            return None
        frame, host_only = _to_device(table)
        expected = table.slice(0, _CHECK_ROWS)
        types = {}
        for name in frame.columns if frame is not None else ():
            field = table.schema.field(name)
            if _round_trips(frame[[name]].head(_CHECK_ROWS), field, expected.column(name)):
                types[name] = field.type
            else:
                host_only.append(name)
        if host_only:
            log.info("columns kept on the host (cuDF would change them): %s", host_only)
        if not types:
            return None
        return cls(frame[list(types)], types, tuple(host_only))

    def take(self, names: Sequence[str], rows: np.ndarray) -> dict[str, pa.ChunkedArray]:
        """The device columns among ``names`` at dataset rows ``rows`` (int64), as Arrow.

        One gather on the device and one copy back; columns keep the host table's types.
        """
        on_device = [n for n in names if n in self.columns]
        if not on_device:
            return {}
        import cupy

        taken = self._frame[on_device].take(cupy.asarray(rows, dtype=cupy.int64))
        result = taken.to_arrow(preserve_index=False)
        out = {}
        for name in on_device:
            column = result.column(name)
            if column.type != self._types[name]:
                column = column.cast(self._types[name])
            out[name] = column
        return out

    def filter_mask(self, where: Sequence[Sequence[Any]]) -> Any:
        """A checked filter (``geonear.service.queries.filters``) evaluated on the device:
        a CuPy bool array with a value a row, or None where a column it names is not on
        the device or not of a type compared here exactly as on the host (see
        :func:`_device_comparable`); the caller then evaluates it on the host.

        Semantics are the host's (pyarrow): a null never matches, not even ``!=`` or
        ``not in``; NaN is a value, unequal to every other.
        """
        predicates = [p for group in where for p in group]
        if not all(
            p.column in self.columns and _device_comparable(self._types[p.column], p.kind)
            for p in predicates
        ):
            return None
        import cupy

        n = len(self._frame)
        selected = cupy.zeros(n, dtype=bool)
        for group in where:
            both = cupy.ones(n, dtype=bool)
            for p in group:
                both &= self._predicate_mask(p)
            selected |= both
        return selected

    def _predicate_mask(self, p: Any) -> Any:
        import cupy

        column = self._frame[p.column]
        if p.constant == "none":
            return cupy.zeros(len(column), dtype=bool)
        if p.kind == "float":
            column = column.astype("float64")  # exact: the values are doubles
        if p.constant is None and p.op in _COMPARE:  # a null compares as null: no match
            (value,) = p.values
            return _COMPARE[p.op](column, value).fillna(False).values
        valid = column.notna().values
        if p.kind == "float":
            valid = valid | cupy.isnan(column.to_cupy(na_value=0.0))  # NaN: a value, not null
        if p.constant == "all":
            return valid
        found = column.isin(list(p.values)).fillna(False).values & valid
        return found if p.op == "in" else valid & ~found


_COMPARE = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _device_comparable(t: pa.DataType, kind: str) -> bool:
    """Whether a device column of Arrow type ``t`` compares with a filter's values of
    ``kind`` as the host does: integers up to int64 (uint64 bounds may exceed int64),
    floats, bools and plain strings (byte order, as Arrow). Times and dictionaries stay
    on the host: their units and categories would need the host's casts."""
    if kind == "int":
        return pa.types.is_integer(t) and t != pa.uint64()
    if kind == "float":
        return pa.types.is_floating(t) and t != pa.float16()
    if kind == "bool":
        return pa.types.is_boolean(t)
    if kind == "string":
        return pa.types.is_string(t) or pa.types.is_large_string(t)
    return False


def _to_device(table: pa.Table) -> tuple[Any, list[str]]:
    """(cuDF frame of the columns cuDF takes, or None; names of those it refused)."""
    try:
        return _cudf.DataFrame.from_arrow(table), []
    except MemoryError:
        raise
    except Exception:  # a type cuDF lacks: take the columns one by one
        pass
    columns, refused = {}, []
    for name in table.column_names:
        try:
            columns[name] = _cudf.DataFrame.from_arrow(table.select([name]))[name]
        except MemoryError:
            raise
        except Exception:
            refused.append(name)
    return (_cudf.DataFrame(columns) if columns else None), refused


def _round_trips(head: Any, field: pa.Field, expected: pa.ChunkedArray) -> bool:
    """Whether a column's first rows come back from cuDF with the host's type and values."""
    try:
        back = head.to_arrow(preserve_index=False).column(field.name)
        if back.type != field.type:
            back = back.cast(field.type)
    except MemoryError:
        raise
    except Exception:
        return False
    return bool(back.equals(expected))
