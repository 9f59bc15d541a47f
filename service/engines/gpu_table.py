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

The host Arrow table stays the dataset's record (persistence, GetDataset, uploads that
append), so answers never depend on where the rows were gathered: a column whose Arrow
type does not survive the round trip through cuDF unchanged (checked when the table is
built on a sample of rows) is left out of the device table and gathered on the host.

cuDF is imported here only, when the GPU engine first keeps a table (or a test asks
``cudf_available``).
"""

from __future__ import annotations

import logging
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
