"""Client-side validation of point batches before anything is sent to a server.

:class:`PointValidator` checks mapped batches (columns id, lat, lon, then attributes) one
at a time: coordinates that are missing, not numbers, NaN, infinite or out of range, and
ids that are missing or repeated. Rows are numbered from 0 in source order (the ids that
row numbers become). With ``skip_invalid`` the bad rows are dropped and counted;
otherwise validation goes on counting through the whole input and then raises
:class:`InvalidPoints`, whose message says how many rows are bad and shows the first few.

Duplicate ids are found in one pass with sorted runs of the ids seen so far (a
log-structured merge), 8 bytes per integer id and 16 per string id, never a Python set.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from geonear.loaders.columns import ColumnError

#: Bad rows shown in a message.
SHOW = 5
_NUMBER = r"^\s*[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|inf|infinity|nan)\s*$"
#: A number written with a decimal comma ("40,7"), as some locales write them.
_DECIMAL_COMMA = re.compile(r"^\s*[+-]?\d+,\d+\s*$")

# Reasons a row is bad, in the order they are checked.
MISSING, NOT_A_NUMBER, NAN, INFINITE, OUT_OF_RANGE = 1, 2, 3, 4, 5
MISSING_ID, DUPLICATE_ID = 6, 7
_REASONS = {
    MISSING: "missing coordinate",
    NOT_A_NUMBER: "not a number",
    NAN: "NaN",
    INFINITE: "infinite",
    OUT_OF_RANGE: "out of range",
    MISSING_ID: "missing id",
    DUPLICATE_ID: "duplicate id",
}


@dataclass(frozen=True)
class BadRow:
    """One rejected row: its 0-based row number, why, and its values as read."""

    row: int
    reason: str
    lat: Any
    lon: Any
    id: Any = None

    def __str__(self) -> str:
        where = f"row {self.row}: "
        if self.reason.endswith(" id"):
            return where + f"id={self.id!r} ({self.reason})"
        return where + f"lat={self.lat!r} lon={self.lon!r} ({self.reason})"


@dataclass
class ValidationReport:
    """Counts of one validated stream (final once the stream is exhausted)."""

    rows_read: int = 0
    rows_kept: int = 0
    bad_rows: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    examples: list[BadRow] = field(default_factory=list)

    @property
    def rows_dropped(self) -> int:
        return self.rows_read - self.rows_kept

    def summary(self) -> str:
        """``(2 out of range, 1 not a number); first: row 4: ...``."""
        kinds = ", ".join(f"{n:,} {r}" for r, n in self.reasons.most_common())
        shown = "; ".join(str(b) for b in self.examples)
        return f"({kinds}); first: {shown}"


class InvalidPoints(ValueError):
    """Input rows that cannot be stored; ``report`` counts them and shows the first few."""

    def __init__(self, message: str, report: ValidationReport) -> None:
        super().__init__(message)
        self.report = report


class EmptyInput(InvalidPoints):
    """The input holds no rows (or none left after dropping invalid ones)."""


def _as_text(value: Any) -> Any:
    return value if value is None or isinstance(value, str | int | float) else str(value)


def coordinates_to_float(
    column: pa.Array | pa.ChunkedArray, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """(values float64, reason per row) of a coordinate column.

    Numbers are cast; text is parsed where it is a number and flagged NOT_A_NUMBER
    elsewhere; nulls (and empty text) are MISSING. Other types raise ColumnError.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    n = len(column)
    reason = np.zeros(n, dtype=np.uint8)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        text = pc.utf8_trim_whitespace(column)
        empty = pc.fill_null(pc.equal(text, ""), True)
        is_number = pc.fill_null(pc.match_substring_regex(text, _NUMBER, ignore_case=True), False)
        reason[np.asarray(pc.and_(pc.invert(is_number), pc.invert(empty)))] = NOT_A_NUMBER
        reason[np.asarray(empty)] = MISSING
        column = pc.cast(pc.if_else(is_number, text, pa.scalar(None, pa.string())), pa.float64())
    elif (
        pa.types.is_floating(column.type)
        or pa.types.is_integer(column.type)
        or pa.types.is_decimal(column.type)
    ):
        column = pc.cast(column, pa.float64())
        if column.null_count:
            reason[np.asarray(column.is_null())] = MISSING
    else:
        raise ColumnError(
            f"{name} column has type {column.type}; coordinates must be numbers (degrees)"
        )
    values = np.asarray(column.fill_null(np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)
    return values, reason


def _range_reasons(values: np.ndarray, reason: np.ndarray, limit: float) -> None:
    ok = reason == 0
    reason[ok & np.isnan(values)] = NAN
    reason[ok & np.isinf(values)] = INFINITE
    reason[(reason == 0) & (np.abs(values) > limit)] = OUT_OF_RANGE


class _SeenIds:
    """Ids seen so far as sorted runs merged like a log-structured merge tree.

    Integer ids are their own keys. String ids are keyed by a 64-bit hash; a hash seen
    before is confirmed by comparing the strings, kept as Arrow arrays with their rows.
    """

    def __init__(self) -> None:
        self._keys: list[np.ndarray] = []
        self._rows: list[np.ndarray] = []  # only for string ids
        self._strings: list[tuple[pa.Array, np.ndarray]] = []  # (ids, their rows)
        self._string_starts: list[int] = []

    def _string_at(self, row: int) -> str:
        ids, rows = self._strings[bisect.bisect_right(self._string_starts, row) - 1]
        return ids[int(np.searchsorted(rows, row))].as_py()

    def add(self, ids: pa.Array, rows: np.ndarray) -> np.ndarray:
        """Mark ``ids`` (at source ``rows``) seen; True where an id was seen before."""
        is_text = pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)
        if is_text:
            values = ids.to_numpy(zero_copy_only=False)
            keys = pd.util.hash_array(np.asarray(values, dtype=object))
            # Within the batch, pandas compares the strings themselves.
            repeated = pd.Series(values).duplicated(keep="first").to_numpy()
        else:
            keys = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64)
            repeated = pd.Series(keys).duplicated(keep="first").to_numpy()
        repeated = repeated.copy()
        run_rows_list: list[np.ndarray | None] = list(self._rows) or [None] * len(self._keys)
        for run, run_rows in zip(self._keys, run_rows_list, strict=True):
            at = np.searchsorted(run, keys)
            hit = (at < run.shape[0]) & (run[np.minimum(at, run.shape[0] - 1)] == keys)
            if is_text and hit.any():
                assert run_rows is not None
                for i in np.flatnonzero(hit & ~repeated):
                    # Equal hashes of different strings are rare; compare to be exact.
                    first = int(at[i])
                    same = False
                    while first < run.shape[0] and run[first] == keys[i]:
                        if self._string_at(int(run_rows[first])) == values[i]:
                            same = True
                            break
                        first += 1
                    hit[i] = same
            repeated |= hit
        new = ~repeated
        if is_text:
            order = np.argsort(keys[new], kind="stable")
            self._keys.append(keys[new][order])
            self._rows.append(rows[new][order])
        else:
            self._keys.append(np.sort(keys[new]))
        if is_text:
            self._strings.append((ids, rows))
            self._string_starts.append(int(rows[0]) if rows.size else 0)
        self._merge()
        return repeated

    def _merge(self) -> None:
        while len(self._keys) > 1 and self._keys[-1].shape[0] >= self._keys[-2].shape[0]:
            keys = np.concatenate([self._keys.pop(-2), self._keys.pop()])
            if not self._rows:
                # Two sorted runs: a stable (merge) sort in place is linear and needs no
                # index array, which keeps the peak to about twice the ids' bytes.
                keys.sort(kind="stable")
                self._keys.append(keys)
                continue
            order = np.argsort(keys, kind="stable")
            self._keys.append(keys[order])
            rows = np.concatenate([self._rows.pop(-2), self._rows.pop()])
            self._rows.append(rows[order])


class PointValidator:
    """Validates mapped batches one by one; see the module docstring.

    Parameters
    ----------
    skip_invalid : bool
        Drop bad rows (and count them) instead of failing.
    check_ids : bool
        Check ids for nulls and duplicates (off when ids are row numbers).
    what : str
        The source, for messages.
    id_column : str, optional
        The source column the ids come from, for messages.
    id_detected : bool
        Whether that column was picked by detection rather than named by the caller;
        repeated values then most likely mean it is not an id at all.
    """

    def __init__(
        self,
        *,
        skip_invalid: bool = False,
        check_ids: bool = True,
        what: str = "the input",
        id_column: str | None = None,
        id_detected: bool = False,
    ) -> None:
        self.skip_invalid = skip_invalid
        self.check_ids = check_ids
        self.what = what
        self.id_column = id_column
        self.id_detected = id_detected
        self.report = ValidationReport()
        self._seen = _SeenIds()

    @property
    def failed(self) -> bool:
        """True once a bad row was found and bad rows are not being skipped."""
        return self.report.bad_rows > 0 and not self.skip_invalid

    def validate(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The batch with float64 lat/lon, bad rows removed (and recorded).

        ``batch`` has columns id (optional), lat, lon, then attributes; its rows follow
        those of the previous batch.
        """
        first_row = self.report.rows_read
        n = batch.num_rows
        names = batch.schema.names
        lat_raw, lon_raw = batch.column(names.index("lat")), batch.column(names.index("lon"))
        lat, lat_reason = coordinates_to_float(lat_raw, "lat")
        lon, lon_reason = coordinates_to_float(lon_raw, "lon")
        _range_reasons(lat, lat_reason, 90.0)
        _range_reasons(lon, lon_reason, 180.0)
        reason = np.where(lat_reason > 0, lat_reason, lon_reason)
        rows = np.arange(first_row, first_row + n, dtype=np.int64)
        has_id = "id" in names
        if has_id and self.check_ids:
            ids = batch.column(names.index("id"))
            null = np.asarray(ids.is_null().to_numpy(zero_copy_only=False), dtype=bool)
            reason[(reason == 0) & null] = MISSING_ID
            ok = reason == 0
            if ok.any():
                kept_ids = ids.filter(pa.array(ok))
                repeated = self._seen.add(kept_ids, rows[ok])
                reason[np.flatnonzero(ok)[repeated]] = DUPLICATE_ID
        bad = reason > 0
        self.report.rows_read += n
        if bad.any():
            self._record(batch, bad, reason, rows, lat_raw, lon_raw, has_id)
        keep = ~bad
        self.report.rows_kept += int(keep.sum())
        columns = [pa.array(lat), pa.array(lon)]
        out = batch.set_column(names.index("lat"), "lat", columns[0])
        out = out.set_column(names.index("lon"), "lon", columns[1])
        return out.filter(pa.array(keep)) if bad.any() else out

    def _record(
        self,
        batch: pa.RecordBatch,
        bad: np.ndarray,
        reason: np.ndarray,
        rows: np.ndarray,
        lat_raw: Any,
        lon_raw: Any,
        has_id: bool,
    ) -> None:
        report = self.report
        idx = np.flatnonzero(bad)
        report.bad_rows += idx.size
        report.reasons.update(_REASONS[int(r)] for r in reason[idx])
        ids = batch.column(batch.schema.names.index("id")) if has_id else None
        for i in idx[: max(0, SHOW - len(report.examples))]:
            i = int(i)
            report.examples.append(
                BadRow(
                    row=int(rows[i]),
                    reason=_describe(int(reason[i]), lat_raw, lon_raw, i),
                    lat=_as_text(lat_raw[i].as_py()),
                    lon=_as_text(lon_raw[i].as_py()),
                    id=None if ids is None else _as_text(ids[i].as_py()),
                )
            )

    def finish(self) -> ValidationReport:
        """The final report; raises InvalidPoints or EmptyInput when the input is unusable."""
        report = self.report
        if report.rows_read == 0:
            raise EmptyInput(f"{self.what} holds no rows", report)
        if report.bad_rows and not self.skip_invalid:
            raise InvalidPoints(
                f"{self.what}: {report.bad_rows:,} of {report.rows_read:,} rows are invalid "
                f"{report.summary()}. {self._advice()} Nothing was stored.",
                report,
            )
        if report.rows_kept == 0:
            raise EmptyInput(
                f"{self.what}: all {report.rows_read:,} rows are invalid "
                f"{report.summary()}; nothing was stored",
                report,
            )
        return report

    def _advice(self) -> str:
        """What to do about the bad rows, for people."""
        # Dropping rows is no fix for an id column that repeats values: it needs another id.
        reasons = self.report.reasons
        duplicates = reasons.get(_REASONS[DUPLICATE_ID], 0)
        advice = []
        if duplicates:
            which = f"column {self.id_column!r}" if self.id_column else "the id column"
            picked = " was taken as the id but" if self.id_detected else ""
            advice.append(
                f"Ids must be unique: {which}{picked} repeats values. Number the rows as "
                "ids with --row-ids (id=False), or name a unique column with --id COLUMN "
                "(id='COLUMN')."
            )
        if sum(reasons.values()) > duplicates:
            text = (
                "Latitude must be a finite number in [-90, 90] and longitude in "
                "[-180, 180] degrees, ids present; fix these rows or drop them with "
                "--skip-invalid (skip_invalid=True)."
            )
            shown = [v for b in self.report.examples for v in (b.lat, b.lon)]
            if any(_DECIMAL_COMMA.match(str(v)) for v in shown):
                text += " Numbers need a decimal point: 40.7, not 40,7."
            advice.append(text)
        return " ".join(advice)


def _describe(code: int, lat_raw: Any, lon_raw: Any, i: int) -> str:
    """``lat out of range`` etc.: which coordinate is at fault (lat checked first)."""
    if code in (MISSING_ID, DUPLICATE_ID):
        return _REASONS[code]
    lat_v, lon_v = lat_raw[i].as_py(), lon_raw[i].as_py()
    for name, value, limit in (("lat", lat_v, 90.0), ("lon", lon_v, 180.0)):
        if _coordinate_reason(value, limit) == code:
            suffix = f" [-{limit:g}, {limit:g}]" if code == OUT_OF_RANGE else ""
            return f"{name} {_REASONS[code]}{suffix}"
    return _REASONS[code]


def _coordinate_reason(value: Any, limit: float) -> int:
    if value is None or (isinstance(value, str) and not value.strip()):
        return MISSING
    try:
        number = float(value)
    except (TypeError, ValueError):
        return NOT_A_NUMBER
    if np.isnan(number):
        return NAN
    if np.isinf(number):
        return INFINITE
    return OUT_OF_RANGE if abs(number) > limit else 0
