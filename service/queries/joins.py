"""Joins of two stored datasets: every left point's neighbours among the right points.

The left dataset's points are the queries of a KNN or radius search over the right
dataset (or the points of it a filter selects), all in the server: nothing crosses the
wire but the answer. The search is the one Knn and Radius run (``knn_slices``,
``radius_slices`` over the left points), so a join is exact as they are, searched and
sent a slice of left points at a time, and refused beyond ``max_result_rows`` before
its search. A dataset may be joined with itself.

Result columns, in left row order and nearest first: left_id, rank, right_id,
distance_m, then the requested left and right columns. A column asked of both sides,
or named as one of the join's own, gets the suffix ``_left`` or ``_right``, as
geopandas' ``sjoin`` names them. The per_query layout has one row per left point:
left_id, right_id and distance_m as lists, the left columns, the right columns as lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from geonear.service.errors import ColumnNotFound, InvalidInput
from geonear.service.queries.common import NeighbourGrid, NeighbourRows, take_columns
from geonear.service.queries.filters import PointSelection
from geonear.service.queries.knn import KnnQuery, knn_query, knn_slices
from geonear.service.queries.radius import RadiusQuery, radius_query, radius_slices
from geonear.service.settings import Limits
from geonear.service.store import DatasetVersion
from geonear.wire import Narrowing, narrowest_integer

#: Columns every join answer has; a requested column of one of these names is suffixed.
JOIN_COLUMNS = ("left_id", "rank", "right_id", "distance_m")
#: Columns no side may be asked for: the ids come as left_id and right_id, and the
#: others name parts of a neighbour answer (as Knn refuses them).
_NOT_ASKED = ("id", "query_index", "rank", "distance_m")
SUFFIXES = ("_left", "_right")


@dataclass(frozen=True)
class JoinSides:
    """The two datasets of a join and the columns asked of each, with their names in
    the answer."""

    left: DatasetVersion
    right: DatasetVersion
    left_columns: tuple[str, ...]
    right_columns: tuple[str, ...]
    left_names: tuple[str, ...]
    right_names: tuple[str, ...]

    def queries(self) -> tuple[Any, Any]:
        """The left points as the search's queries (on the device for a device engine:
        ``PointIndex.query_degrees``)."""
        return self.left.index.query_degrees(self.left.lat, self.left.lon)

    def narrow_types(self, max_rank: int) -> dict[str, Narrowing]:
        """The types the answer's integer columns travel in when a request asks for
        ``narrow_integers``: each side's ids in its dataset's range, ranks up to
        ``max_rank`` (the attribute columns keep their own)."""
        types = {"rank": Narrowing(narrowest_integer(0, max(0, max_rank)), pa.int32())}
        for name, dataset in (("left_id", self.left), ("right_id", self.right)):
            if dataset.narrow_id_type is not None:
                types[name] = Narrowing(dataset.narrow_id_type)
        return types

    def metadata(self, earth_radius_m: float, layout: str) -> dict[str, str]:
        return {
            "geonear.left_dataset": self.left.name,
            "geonear.left_version": str(self.left.version),
            "geonear.right_dataset": self.right.name,
            "geonear.right_version": str(self.right.version),
            "geonear.earth_radius_m": repr(earth_radius_m),
            "geonear.layout": layout,
        }


def join_sides(
    left: DatasetVersion,
    right: DatasetVersion,
    left_columns: Sequence[str] = (),
    right_columns: Sequence[str] = (),
) -> JoinSides:
    """The sides, their columns checked and named; raises on a missing or refused
    column, or on names that still clash after suffixing."""
    lefts = _checked(left, left_columns, "left")
    rights = _checked(right, right_columns, "right")

    def named(names: tuple[str, ...], other: tuple[str, ...], suffix: str) -> tuple[str, ...]:
        return tuple(
            name + suffix if name in other or name in ("left_id", "right_id") else name
            for name in names
        )

    left_names = named(lefts, rights, SUFFIXES[0])
    right_names = named(rights, lefts, SUFFIXES[1])
    every = [*JOIN_COLUMNS, *left_names, *right_names]
    clashes = sorted({name for name in every if every.count(name) > 1})
    if clashes:
        raise InvalidInput(
            f"join columns {', '.join(map(repr, clashes))} would appear twice in the answer "
            f"even with the suffixes {' and '.join(SUFFIXES)}; ask for fewer columns"
        )
    return JoinSides(left, right, lefts, rights, left_names, right_names)


def _checked(dataset: DatasetVersion, columns: Sequence[str], side: str) -> tuple[str, ...]:
    names = dataset.table.column_names
    out: list[str] = []
    for name in columns:
        if name in _NOT_ASKED:
            raise InvalidInput(
                f"{side} column {name!r} cannot be asked for: the answer has left_id, rank, "
                "right_id and distance_m; ask for attributes, lat or lon"
            )
        if name not in names:
            raise ColumnNotFound(
                f"{side} dataset {dataset.name!r} has no column {name!r}; it has "
                f"{', '.join(n for n in names if n != 'id')}"
            )
        if name in out:
            raise InvalidInput(f"{side} column {name!r} is asked for twice")
        out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class KnnJoin:
    sides: JoinSides
    query: KnnQuery


@dataclass(frozen=True)
class RadiusJoin:
    sides: JoinSides
    query: RadiusQuery


def knn_join(
    sides: JoinSides,
    k: int,
    *,
    max_distance_m: float | None = None,
    points: PointSelection | None = None,
    limits: Limits,
) -> KnnJoin:
    """A checked KNN join: left rows x min(k, right points searched) result rows at most,
    refused beyond ``max_result_rows`` before the search."""
    lat, lon = sides.queries()
    query = knn_query(
        sides.right,
        lat,
        lon,
        k,
        max_distance_m=max_distance_m,
        columns=sides.right_columns,
        points=points,
        stored_queries=True,
        limits=limits,
    )
    return KnnJoin(sides, query)


def radius_join(
    sides: JoinSides,
    radius_m: float,
    *,
    points: PointSelection | None = None,
    limits: Limits,
) -> RadiusJoin:
    """A checked radius join, its pairs counted and refused beyond ``max_result_rows``
    before any is gathered."""
    lat, lon = sides.queries()
    query = radius_query(
        sides.right,
        lat,
        lon,
        radius_m,
        columns=sides.right_columns,
        points=points,
        stored_queries=True,
        limits=limits,
    )
    return RadiusJoin(sides, query)


@dataclass(frozen=True)
class JoinSlice:
    """The answer for left rows ``first_left`` to ``first_left + n_left``."""

    sides: JoinSides
    found: NeighbourGrid | NeighbourRows
    first_left: int
    n_left: int

    def table(
        self, earth_radius_m: float, layout: str = "rows", *, narrow_ids: bool = False
    ) -> pa.Table:
        """The slice's rows in ``layout`` (``narrow_ids`` as ``NeighbourRows.table``)."""
        sides = self.sides
        right = self.found.table(earth_radius_m, layout, narrow_ids=narrow_ids)
        if layout == "per_query":
            left_rows: np.ndarray | slice = slice(self.first_left, self.first_left + self.n_left)
            data = {"right_id": right.column("id"), "distance_m": right.column("distance_m")}
        else:
            left_rows = right.column("query_index").to_numpy()
            data = {
                "rank": right.column("rank"),
                "right_id": right.column("id"),
                "distance_m": right.column("distance_m"),
            }
        names = ("id", *sides.left_columns)
        taken = take_columns(sides.left, names, left_rows, narrow_ids=narrow_ids)
        out = {"left_id": taken["id"], **data}
        for name, shown in zip(sides.left_columns, sides.left_names, strict=True):
            out[shown] = taken[name]
        for name, shown in zip(sides.right_columns, sides.right_names, strict=True):
            out[shown] = right.column(name)
        return pa.table(out).replace_schema_metadata(sides.metadata(earth_radius_m, layout))


def knn_join_slices(join: KnnJoin) -> Iterator[JoinSlice]:
    """The join a slice of left points at a time, each searched as it is asked for."""
    for grid in knn_slices(join.query):
        yield JoinSlice(join.sides, grid, grid.first_query, int(grid.indices.shape[0]))


def radius_join_slices(join: RadiusJoin) -> Iterator[JoinSlice]:
    """The join a slice of left points at a time (about SLICE_ROWS pairs each)."""
    first = 0
    for rows in radius_slices(join.query):
        assert rows.offsets is not None
        n = int(rows.offsets.shape[0]) - 1
        yield JoinSlice(join.sides, rows, first, n)
        first += n
