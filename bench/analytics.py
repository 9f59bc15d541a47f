"""``geonear bench`` for the server-side analytics: joins, counts, filtered KNN, DBSCAN and
areas, each engine through a server of its own, beside peers on the same points.

Each engine of ``--engines`` (default ``cpu,gpu``) runs in a ``geonear serve --engine NAME
--memory-only`` process of its own on a free loopback port (``geonear.bench.served.served_engine``,
as for ``geonear bench --served``). The Python client (``geonear.connect``) uploads the
points, then times the op's call as a user makes it: the answer streamed back and
decoded (an Arrow table, or a ``DbscanOutcome`` with its labels). Peers run in this
process on the same points. Rows, columns and the results document are ``geonear
bench``'s (``geonear.bench.report``): for an engine "build s" is the upload of the searched
dataset (sent, checked and indexed), for a peer its own structure; "cold" is the first
call, "warm" the ``--repeat`` calls after it.

| op           | geonear call, timed                          | peers                          |
|--------------|----------------------------------------------|--------------------------------|
| knn-join     | knn_join(left, right, k): N x N points, the  | BallTree(haversine).query;     |
|              | rows layout, then layout="per_query"         | geopandas sjoin_nearest        |
| count-within | count_within(right, r, left=left): N x N     | BallTree.query_radius(counts)  |
| filtered-knn | knn(points, queries, k) unfiltered, then     | (one in-process index build    |
|              | where bucket < 10 (10%) and < 1 (1%)         | of the selected points)        |
| dbscan       | dbscan(points, eps_m, min_samples), labels   | scikit-learn DBSCAN(haversine, |
|              |                                              | ball_tree); cuML DBSCAN on     |
|              |                                              | unit vectors (chord, float32)  |
| within       | within(points, polygon): a star of 64 edges  | -                              |

Peers that would take long (BallTree, sjoin_nearest, scikit-learn's DBSCAN) run on at
most ``--peer-points`` left points (dbscan: points) and their times are scaled to all,
as ``geonear bench`` scales its brute-force engines; the row's note says so. A peer
that is not installed here is skipped with the reason.

The joins and counts make one more call after the timed ones, on a plain stub, and put
where its time went in the engine's first row's note: the server's stages (its
``geonear-timing`` trailer: decode, search, assemble, encode) and the client's receiving
and decoding, ms.

Every engine's answer is checked: joins and filtered KNN against the float64 reference
(numpy-brute) on the first left points or queries, counts against the reference's at
the radius -/+ 1 mm, DBSCAN against scikit-learn's clusters (up to relabelling) and
against the cpu engine's labels, within against a point-in-polygon test of its own.
"""

from __future__ import annotations

import functools
import gc
import importlib
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import grpc
import numpy as np
import pyarrow as pa

import geonear
from geonear.bench import report
from geonear.bench.command import (
    DEFAULT_ENGINES,
    PEER_POINTS,
    SERVED_ENGINES,
    WORK_UNITS,
    BenchConfig,
    BenchData,
    EngineResult,
    make_data,
    reference_queries,
    synchroniser,
    timed,
)
from geonear.bench.exactness import (
    TIE_M,
    StarPolygon,
    count_exactness,
    dbscan_exactness,
    knn_exactness,
    label_agreement,
    neighbours_from_rows,
    within_exactness,
)
from geonear.bench.served import received_with_stages, served_engine
from geonear.geometry import EARTH_RADIUS_M, unit_vectors
from geonear.service.engines import (
    EngineUnavailable,
    Neighbours,
    create_engine,
    engine_names,
    gpu_available,
    runnable_engine_names,
)
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

__all__ = ["ANALYTICS_BENCHES", "run_analytics"]

#: Seconds one call may take (a 1M x 1M join on the CPU takes tens of seconds).
CALL_TIMEOUT_S = 3600.0
#: Neighbours a point has on average at count-within's radius (uniform points) and at
#: dbscan's eps, when ``--radius-m`` does not set them.
COUNT_NEIGHBOURS = 10
DBSCAN_NEIGHBOURS = 20
#: Points whose neighbour counts set dbscan's eps.
CALIBRATION_POINTS = 2000
#: Points of ``--op within`` checked against the reference when ``--ref-queries`` is not given.
WITHIN_REFERENCE_POINTS = 1_000_000
#: The polygon of ``--op within``: a star of 64 great-circle edges about 12 and 7 degrees
#: of arc from its centre, holding about 0.7% of uniform points.
WITHIN_POLYGON = StarPolygon(
    centre_lat=30.0, centre_lon=15.0, vertices=64, outer_deg=12.0, inner_deg=7.0
)
#: The filters of ``--op filtered-knn``, on a column ``bucket`` uniform in 0..99.
SELECTIVITIES = (("where 10%", 10), ("where 1%", 1))
#: A GPU engine built in this process (filtered-knn's build of the selected points)
#: reserves this much device memory, leaving the card to the servers.
_IN_PROCESS_POOL_BYTES = 1 << 30


def _no_sync() -> None:
    return None


def _time_calls(
    row: EngineResult,
    call: Callable[[], Any],
    repeat: int,
    sync: Callable[[], None] = _no_sync,
) -> Any:
    """The cold call, then ``repeat`` warm ones, into ``row`` (times multiplied by
    ``row.scale``); returns the last answer."""
    row.cold_s, out = timed(sync, call)
    warm = []
    for _ in range(repeat):
        out = None  # let the previous answer go before the next one is made
        seconds, out = timed(sync, call)
        warm.append(seconds)
    row.repeats = len(warm)
    row.cold_s *= row.scale
    row.warm_min_s = min(warm) * row.scale
    row.warm_median_s = statistics.median(warm) * row.scale
    return out


def _points_table(lat: np.ndarray, lon: np.ndarray, **columns: np.ndarray) -> pa.Table:
    """Points whose ids are their row numbers, so answers index the bench's arrays."""
    ids = np.arange(lat.shape[0], dtype=np.int64)
    return pa.table({"id": ids, "lat": lat, "lon": lon, **columns})


def _upload_s(client: Any, name: str, table: pa.Table) -> float:
    return timed(_no_sync, lambda: client.upload(name, table))[0]


def _upload_sides(client: Any, d: BenchData) -> float:
    """The queries as dataset ``left``, the points as ``right``: seconds of the latter
    (the searched dataset's build)."""
    client.upload("left", _points_table(d.q_lat, d.q_lon))
    return _upload_s(client, "right", _points_table(d.lat, d.lon))


def _import_peer(module: str, package: str) -> Any:
    """``module``, or EngineUnavailable naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EngineUnavailable(f"{package} is not installed here ({exc})") from exc


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy()


def _list_values(table: pa.Table, name: str, width: int) -> np.ndarray:
    """A per-query list column of ``width`` values a row, as a (rows, width) array."""
    values = table.column(name).combine_chunks().flatten()
    return values.to_numpy(zero_copy_only=False).reshape(-1, width)


class AnalyticsBench:
    """One op's data, reference and calls; a subclass per op.

    The runner calls :meth:`prepare` for each engine before its server starts,
    :meth:`served` with a client of that server, each of :meth:`peers`, then
    :meth:`finish` with every row, for checks that need them all.
    """

    op = ""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.data = make_data(config)
        self.n = int(self.data.lat.shape[0])
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}

    @property
    def unit(self) -> str:
        return WORK_UNITS[self.op]

    def server_settings(self) -> dict[str, str]:
        """``GEONEAR_*`` settings the op's servers need."""
        return {}

    def prepare(self, engine: str) -> None:
        """Work of ``engine`` in this process, done before its server takes the device."""

    def served(self, client: Any, engine: str) -> list[EngineResult]:
        raise NotImplementedError

    def staged_requests(self) -> list[tuple[str, Any]]:
        """(RPC name, request) of each of the op's timed calls, as the Python client sends
        it, in the order of ``served``'s rows: one more call of each, whose server stages
        (the ``geonear-timing`` trailer) go in that row's notes; none where the op has
        none to report."""
        return []

    def peers(self) -> list[tuple[str, Callable[[], EngineResult]]]:
        return []

    def finish(self, rows: list[EngineResult]) -> None:
        """Checks across rows, once every row ran."""

    def sklearn_peer(self) -> str | None:
        """The row the "vs sklearn" column divides by."""
        return None

    def data_doc(self) -> dict[str, Any]:
        return {
            "description": self.data.description,
            "n_points": self.n,
            "n_queries": int(self.data.q_lat.shape[0]),
            "ref_queries": self.reference_count(),
            **self.extra,
        }

    def reference_count(self) -> int:
        return reference_queries(self.config, self.n, int(self.data.q_lat.shape[0]))

    def peer_row(self, name: str, available: int) -> tuple[EngineResult, int]:
        """A peer's row and how many of ``available`` points it runs on (``--peer-points``)."""
        row = EngineResult(engine=name, device="cpu")
        m = min(available, self.config.peer_points or PEER_POINTS)
        row.queries_run = m
        row.scale = available / m
        if m < available:
            row.notes.append(
                f"timed on {m:,} of {available:,} points, times scaled x{row.scale:,.3g}"
            )
        return row, m


# -- knn-join --------------------------------------------------------------------------


class KnnJoinBench(AnalyticsBench):
    """knn_join of two stored datasets of N points each (left: the queries)."""

    op = "knn-join"

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        d = self.data
        self.width = min(config.k, self.n)
        r = self.reference_count()
        reference = create_engine("numpy-brute").build_index(d.lat, d.lon)
        self.reference = reference.knn(d.q_lat[:r], d.q_lon[:r], config.k)
        self.notes.append(
            f"exactness checked on the first {r:,} left points against the float64 "
            "reference (numpy-brute's great-circle formula)"
        )

    def sklearn_peer(self) -> str:
        return "sklearn-balltree"

    def staged_requests(self) -> list[tuple[str, Any]]:
        return [
            (
                "KnnJoin",
                pb.KnnJoinRequest(
                    left_dataset="left",
                    right_dataset="right",
                    k=self.config.k,
                    layout=layout,
                    narrow_integers=True,
                ),
            )
            for layout in (pb.ROWS, pb.PER_QUERY)
        ]

    def served(self, client: Any, engine: str) -> list[EngineResult]:
        """Two rows: the answer in the rows layout (``engine``), then in the per-query
        layout (``engine per_query``: one row a left point, 12 bytes a neighbour instead
        of 17 with ids below 2^31, the answer's integers sent narrow as the client asks)."""
        d, k = self.data, self.config.k
        row = EngineResult(engine=engine)
        row.build_s = _upload_sides(client, d)
        table = _time_calls(
            row, lambda: client.knn_join("left", "right", k, as_arrow=True), self.config.repeat
        )
        out = neighbours_from_rows(
            _column(table, "left_id"),
            _column(table, "rank"),
            _column(table, "right_id"),
            _column(table, "distance_m"),
            (self.n, self.width),
        )
        row.exactness, row.exact = knn_exactness(out, self.reference, data=d)
        row.exactness["result_rows"] = table.num_rows
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        del table, out

        per_query = EngineResult(engine=f"{engine} per_query", build_s=row.build_s)
        table = _time_calls(
            per_query,
            lambda: client.knn_join("left", "right", k, layout="per_query", as_arrow=True),
            self.config.repeat,
        )
        in_order = np.array_equal(_column(table, "left_id"), np.arange(self.n))
        out = Neighbours(
            _list_values(table, "distance_m", self.width),
            _list_values(table, "right_id", self.width),
        )
        per_query.exactness, per_query.exact = knn_exactness(out, self.reference, data=d)
        per_query.exactness["in_left_order"] = in_order
        per_query.exact = bool(per_query.exact and in_order)
        per_query.exactness["result_rows"] = table.num_rows
        per_query.throughput = self.n / max(per_query.warm_median_s or 0.0, 1e-12)
        return [row, per_query]

    def peers(self) -> list[tuple[str, Callable[[], EngineResult]]]:
        return [("sklearn-balltree", self._balltree), ("geopandas-sjoin", self._sjoin_nearest)]

    def _balltree(self) -> EngineResult:
        neighbors = _import_peer("sklearn.neighbors", "scikit-learn")
        d = self.data
        row, m = self.peer_row("sklearn-balltree", self.n)
        right = np.radians(np.column_stack([d.lat, d.lon]))
        left = np.radians(np.column_stack([d.q_lat[:m], d.q_lon[:m]]))
        row.build_s, tree = timed(_no_sync, lambda: neighbors.BallTree(right, metric="haversine"))
        angles, rows = _time_calls(row, lambda: tree.query(left, k=self.width), self.config.repeat)
        out = Neighbours(angles * EARTH_RADIUS_M, rows)
        row.exactness, row.exact = knn_exactness(out, self.reference, data=d)
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        row.notes.append("BallTree(metric='haversine').query, one core")
        return row

    def _sjoin_nearest(self) -> EngineResult:
        gpd = _import_peer("geopandas", "geopandas")
        d = self.data
        row, m = self.peer_row("geopandas-sjoin", self.n)

        def frames() -> tuple[Any, Any]:
            # No CRS: sjoin_nearest measures in the coordinates' own plane (degrees).
            right = gpd.GeoDataFrame(geometry=gpd.points_from_xy(d.lon, d.lat))
            _ = right.sindex  # built here, once; the joins reuse it
            left = gpd.GeoDataFrame(geometry=gpd.points_from_xy(d.q_lon[:m], d.q_lat[:m]))
            return left, right

        row.build_s, (left, right) = timed(_no_sync, frames)
        joined = _time_calls(row, lambda: gpd.sjoin_nearest(left, right), self.config.repeat)
        # One row per left point (the first of equally near ones), in left order.
        nearest = joined[~joined.index.duplicated()].sort_index()["index_right"].to_numpy()
        r = min(self.reference.indices.shape[0], nearest.shape[0])
        same = float(np.mean(nearest[:r] == self.reference.indices[:r, 0])) if r else 1.0
        row.exactness = {"planar_nearest_is_nearest": same, "result_rows": len(joined)}
        row.exact = None
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        row.notes.append(
            "not exact, planar: nearest in degrees, k=1 (sjoin_nearest has no k); "
            f"the great-circle nearest for {same:.1%} of the checked points"
        )
        return row


# -- count-within ----------------------------------------------------------------------


def ten_neighbours_radius_m(n: int, neighbours: int = COUNT_NEIGHBOURS) -> float:
    """The radius holding ``neighbours`` of ``n`` uniform points on average, metres.

    A cap of angular radius theta holds the share (1 - cos theta) / 2 of the sphere.
    """
    cos_theta = max(-1.0, 1.0 - 2.0 * neighbours / max(n, 1))
    return EARTH_RADIUS_M * math.acos(cos_theta)


class CountWithinBench(AnalyticsBench):
    """count_within of every point of one stored dataset against another (N x N)."""

    op = "count-within"

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        d = self.data
        self.radius_m = config.radius_m or ten_neighbours_radius_m(self.n)
        r = self.reference_count()
        reference = create_engine("numpy-brute").build_index(d.lat, d.lon)
        self.low = reference.radius_count(d.q_lat[:r], d.q_lon[:r], self.radius_m - TIE_M)
        self.high = reference.radius_count(d.q_lat[:r], d.q_lon[:r], self.radius_m + TIE_M)
        self.extra["radius_m"] = self.radius_m
        how = (
            "set by --radius-m"
            if config.radius_m
            else (f"about {COUNT_NEIGHBOURS} neighbours a point for uniform points")
        )
        self.notes.append(
            f"radius {self.radius_m:,.0f} m ({how}); counts of the first {r:,} left points "
            "checked against the float64 reference's at the radius -/+ 1 mm"
        )

    def sklearn_peer(self) -> str:
        return "sklearn-balltree"

    def staged_requests(self) -> list[tuple[str, Any]]:
        request = pb.CountWithinRequest(
            dataset="right", left_dataset="left", radius_m=self.radius_m, narrow_integers=True
        )
        return [("CountWithin", request)]

    def served(self, client: Any, engine: str) -> list[EngineResult]:
        d = self.data
        row = EngineResult(engine=engine)
        row.build_s = _upload_sides(client, d)
        table = _time_calls(
            row,
            lambda: client.count_within(
                "right", radius_m=self.radius_m, left="left", as_arrow=True
            ),
            self.config.repeat,
        )
        row.exactness, row.exact = count_exactness(
            _column(table, "count"), self.low, self.high, self.n
        )
        in_order = np.array_equal(_column(table, "left_id"), np.arange(self.n))
        row.exactness["in_left_order"] = in_order
        row.exact = bool(row.exact and in_order)
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        return [row]

    def peers(self) -> list[tuple[str, Callable[[], EngineResult]]]:
        return [("sklearn-balltree", self._balltree)]

    def _balltree(self) -> EngineResult:
        neighbors = _import_peer("sklearn.neighbors", "scikit-learn")
        d = self.data
        row, m = self.peer_row("sklearn-balltree", self.n)
        right = np.radians(np.column_stack([d.lat, d.lon]))
        left = np.radians(np.column_stack([d.q_lat[:m], d.q_lon[:m]]))
        row.build_s, tree = timed(_no_sync, lambda: neighbors.BallTree(right, metric="haversine"))
        angle = self.radius_m / EARTH_RADIUS_M
        counts = _time_calls(
            row, lambda: tree.query_radius(left, angle, count_only=True), self.config.repeat
        )
        row.exactness, row.exact = count_exactness(counts, self.low, self.high, m)
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        row.notes.append("BallTree(metric='haversine').query_radius(count_only=True), one core")
        return row


# -- filtered-knn ----------------------------------------------------------------------


class FilteredKnnBench(AnalyticsBench):
    """knn of the queries, unfiltered and with ``where`` at 10% and 1% selectivity.

    Served, because ``where`` is evaluated by the server. The target reads "within 2x
    the unfiltered time plus one index build of the selected points": each filtered row
    has ``bound_s`` = 2 x its engine's unfiltered warm median + ``selected_build_s``
    (one build of an index of the selected points by the same engine, timed in this
    process, fastest of the repeats), and ``bound_ratio`` = its cold call over that
    bound. The cold call is the one that pays for the server's index of the selected
    points; the server keeps that index for the same filter, so the warm calls reuse it.
    """

    op = "filtered-knn"

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        d = self.data
        rng = np.random.default_rng([config.seed, 2])
        self.bucket = rng.integers(0, 100, self.n).astype(np.int32)
        r = self.reference_count()
        reference = create_engine("numpy-brute")
        self.selected: dict[str, np.ndarray] = {"": np.arange(self.n)}
        for label, below in SELECTIVITIES:
            self.selected[label] = np.flatnonzero(self.bucket < below)
        self.references: dict[str, Neighbours] = {}
        for label, rows in self.selected.items():
            found = reference.build_index(d.lat[rows], d.lon[rows]).knn(
                d.q_lat[:r], d.q_lon[:r], config.k
            )
            mapped = np.where(found.indices >= 0, rows[np.maximum(found.indices, 0)], -1)
            self.references[label] = Neighbours(found.distances_m, mapped)
        self.build_s: dict[str, dict[str, float | None]] = {}
        self.notes.append(
            f"exactness checked on the first {r:,} queries against the float64 reference "
            "over the selected points; bound = 2 x the engine's unfiltered warm median + "
            "sel build s (one build of an index of the selected points by the same engine, "
            "in this process); ÷ bound = the filtered cold call (the one that builds the "
            "server's index of the selected points) over the bound; warm calls reuse that "
            "index"
        )

    def prepare(self, engine: str) -> None:
        """One build of an index of each selection's points, by ``engine``, here."""
        self.build_s[engine] = {label: None for label, _ in SELECTIVITIES}
        options = {"pool_size_bytes": _IN_PROCESS_POOL_BYTES} if engine == "gpu" else {}
        try:
            local = create_engine(engine, **options)
            local.warm_up()
        except EngineUnavailable:
            return
        for label, _ in SELECTIVITIES:
            self.build_s[engine][label] = self._fastest_build(local, self.selected[label])
        gc.collect()  # the indexes built here go before the server builds its own

    def _fastest_build(self, engine: Any, rows: np.ndarray) -> float:
        sync = synchroniser(engine)
        lat, lon = self.data.lat[rows], self.data.lon[rows]
        times = [
            timed(sync, lambda: engine.build_index(lat, lon))[0]
            for _ in range(max(2, self.config.repeat))
        ]
        return min(times)

    def served(self, client: Any, engine: str) -> list[EngineResult]:
        d, k = self.data, self.config.k
        rows = []
        build_s = _upload_s(client, "points", _points_table(d.lat, d.lon, bucket=self.bucket))
        unfiltered_s = None
        filters: list[tuple[str, list[tuple[str, str, int]] | None]] = [("", None)]
        filters += [(label, [("bucket", "<", below)]) for label, below in SELECTIVITIES]
        for label, where in filters:
            row = EngineResult(engine=f"{engine} {label}".strip())
            if where is None:
                row.build_s = build_s
            call = functools.partial(
                client.knn, "points", d.q_lat, d.q_lon, k, where=where, as_arrow=True
            )
            table = _time_calls(row, call, self.config.repeat)
            selected = self.selected[label]
            reference = self.references[label]
            out = neighbours_from_rows(
                _column(table, "query_index"),
                _column(table, "rank"),
                _column(table, "id"),
                _column(table, "distance_m"),
                (d.q_lat.shape[0], reference.indices.shape[1]),
            )
            row.exactness, row.exact = knn_exactness(out, reference, data=d)
            row.exactness["selected_share"] = selected.size / max(self.n, 1)
            row.throughput = d.q_lat.shape[0] / max(row.warm_median_s or 0.0, 1e-12)
            if where is None:
                unfiltered_s = row.warm_median_s
            else:
                self._bound(row, engine, label, unfiltered_s)
            rows.append(row)
        return rows

    def _bound(
        self, row: EngineResult, engine: str, label: str, unfiltered_s: float | None
    ) -> None:
        built = self.build_s.get(engine, {}).get(label)
        row.exactness["selected_build_s"] = built
        if built is None or unfiltered_s is None or row.cold_s is None:
            row.notes.append(f"no bound: {engine} cannot build an index in this process")
            return
        bound = 2.0 * unfiltered_s + built
        row.exactness["bound_s"] = bound
        row.exactness["bound_ratio"] = row.cold_s / bound
        row.exactness["warm_bound_ratio"] = (row.warm_median_s or 0.0) / bound


# -- dbscan ----------------------------------------------------------------------------


def radius_for_neighbours(
    lat: np.ndarray, lon: np.ndarray, neighbours: float, seed: int
) -> tuple[float, float]:
    """The radius at which points have ``neighbours`` others on average, and that mean.

    Measured on ``CALIBRATION_POINTS`` of the points (counted against all of them) with
    the cpu engine: bracketed from the median distance to the ``neighbours``-th nearest,
    then bisected (geometrically) on the mean count.
    """
    n = lat.shape[0]
    index = create_engine("cpu").build_index(lat, lon)
    rng = np.random.default_rng([seed, 4])
    sample = np.sort(rng.permutation(n)[: min(n, CALIBRATION_POINTS)])
    s_lat, s_lon = lat[sample], lon[sample]

    def mean_others(radius_m: float) -> float:
        return float(index.radius_count(s_lat, s_lon, radius_m).mean()) - 1.0

    k = min(n, int(neighbours) + 1)
    start = float(np.median(index.knn(s_lat, s_lon, k).distances_m[:, -1]))
    low = high = max(start, 1.0)
    while mean_others(low) > neighbours and low > 1e-3:
        low /= 2.0
    while mean_others(high) < neighbours and high < math.pi * EARTH_RADIUS_M:
        high *= 2.0
    for _ in range(40):
        middle = math.sqrt(low * high)
        if mean_others(middle) < neighbours:
            low = middle
        else:
            high = middle
    return high, mean_others(high)


class DbscanBench(AnalyticsBench):
    """dbscan of N points (clustered by default), eps giving about 20 neighbours a point.

    Exactness: scikit-learn's DBSCAN on at most ``--peer-points`` points is the
    reference. On all points when N fits; else on a seeded subset, at the eps that gives
    the subset the same mean neighbours, and each engine answers the same subset (a
    column ``subset`` and ``where``) in a call of its own, untimed.
    """

    op = "dbscan"

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        d, n = self.data, self.n
        if config.radius_m:
            self.eps_m = config.radius_m
            self.mean_neighbours = self._mean_at(d.lat, d.lon, self.eps_m)
        else:
            self.eps_m, self.mean_neighbours = radius_for_neighbours(
                d.lat, d.lon, DBSCAN_NEIGHBOURS, config.seed
            )
        m = min(n, config.peer_points or PEER_POINTS)
        rng = np.random.default_rng([config.seed, 3])
        self.subset = np.arange(n) if m == n else np.sort(rng.permutation(n)[:m])
        self.subset_eps_m = self.eps_m
        if m < n:
            self.subset_eps_m, _ = radius_for_neighbours(
                d.lat[self.subset], d.lon[self.subset], self.mean_neighbours, config.seed
            )
        self.labels: dict[str, np.ndarray] = {}
        self.subset_labels: dict[str, np.ndarray] = {}
        self.reference: tuple[np.ndarray, np.ndarray] | None = None
        self.extra.update(
            eps_m=self.eps_m,
            mean_neighbours=self.mean_neighbours,
            min_samples=config.min_samples,
            checked_points=int(m),
            subset_eps_m=self.subset_eps_m,
        )
        how = "set by --radius-m" if config.radius_m else "chosen for"
        self.notes.append(
            f"eps {self.eps_m:,.0f} m ({how} {self.mean_neighbours:.1f} neighbours a point "
            f"on average), min_samples {config.min_samples}"
        )
        subset = (
            "all the points"
            if m == n
            else (
                f"{m:,} of the points at eps {self.subset_eps_m:,.0f} m (the same mean "
                "neighbours), each engine answering them in an untimed call with where"
            )
        )
        self.notes.append(
            f"clusters checked against scikit-learn's DBSCAN(haversine) on {subset}: the "
            "same noise and core points in the same groups up to relabelling (labels = is "
            "the share of points agreeing); every engine's labels must also be the cpu "
            "engine's; cuml-dbscan (float32 unit vectors, eps the chord 2 sin(eps/2R)) is "
            "compared with the cpu engine's labels, not judged"
        )

    def reference_count(self) -> int:
        return int(self.subset.size)

    def _mean_at(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> float:
        index = create_engine("cpu").build_index(lat, lon)
        rng = np.random.default_rng([self.config.seed, 4])
        sample = np.sort(rng.permutation(lat.shape[0])[:CALIBRATION_POINTS])
        return float(index.radius_count(lat[sample], lon[sample], radius_m).mean()) - 1.0

    def sklearn_peer(self) -> str:
        return "sklearn-dbscan"

    def server_settings(self) -> dict[str, str]:
        # The pairs within eps are about n x (mean + 1); the sample may miss dense spots.
        pairs = int(4 * self.n * (self.mean_neighbours + 1))
        return {"GEONEAR_MAX_DBSCAN_PAIRS": str(max(1 << 26, pairs))}

    def served(self, client: Any, engine: str) -> list[EngineResult]:
        d, c = self.data, self.config
        row = EngineResult(engine=engine)
        in_subset = np.zeros(self.n, dtype=np.int8)
        in_subset[self.subset] = 1
        row.build_s = _upload_s(client, "points", _points_table(d.lat, d.lon, subset=in_subset))
        outcome = _time_calls(
            row, lambda: client.dbscan("points", self.eps_m, c.min_samples), c.repeat
        )
        self.labels[engine] = self._by_row(outcome.labels, self.n)
        if self.subset.size == self.n:
            self.subset_labels[engine] = self.labels[engine]
        else:
            check = client.dbscan(
                "points", self.subset_eps_m, c.min_samples, where=[("subset", "==", 1)]
            )
            by_row = self._by_row(check.labels, self.n)
            self.subset_labels[engine] = by_row[self.subset]
        row.exactness = {
            "n_clusters": outcome.n_clusters,
            "noise_share": outcome.n_noise / max(self.n, 1),
        }
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        return [row]

    @staticmethod
    def _by_row(labels: Any, n: int) -> np.ndarray:
        """Labels (id, cluster) as an array by row; -2 where a row has none."""
        out = np.full(n, -2, dtype=np.int64)
        ids = labels["id"].to_numpy()
        out[ids] = labels["cluster"].to_numpy()
        return out

    def peers(self) -> list[tuple[str, Callable[[], EngineResult]]]:
        return [("sklearn-dbscan", self._sklearn), ("cuml-dbscan", self._cuml)]

    def _sklearn(self) -> EngineResult:
        cluster = _import_peer("sklearn.cluster", "scikit-learn")
        d, c = self.data, self.config
        row, m = self.peer_row("sklearn-dbscan", self.n)
        points = np.radians(np.column_stack([d.lat[self.subset], d.lon[self.subset]]))
        if m < self.n:
            row.notes[-1] += f", at eps {self.subset_eps_m:,.0f} m"

        def fit() -> Any:
            return cluster.DBSCAN(
                eps=self.subset_eps_m / EARTH_RADIUS_M,
                min_samples=c.min_samples,
                metric="haversine",
                algorithm="ball_tree",
            ).fit(points)

        model = _time_calls(row, fit, c.repeat)
        core = np.zeros(m, dtype=bool)
        core[model.core_sample_indices_] = True
        self.reference = (np.asarray(model.labels_, np.int64), core)
        row.exactness = {
            "n_clusters": int(np.unique(model.labels_[model.labels_ >= 0]).size),
            "noise_share": float(np.mean(model.labels_ == -1)),
        }
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        row.notes.append("the reference of the cluster check; one core")
        return row

    def _cuml(self) -> EngineResult:
        ok, why = gpu_available()
        if not ok:
            raise EngineUnavailable(f"needs a GPU: {why}")
        cuml = _import_peer("cuml", "cuML (pip install 'geonear[gpu]')")
        import cupy  # only here, on a GPU host: importing geonear never imports CuPy

        d, c = self.data, self.config
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        row = EngineResult(engine="cuml-dbscan", device=f"gpu: {name}")
        xyz = cupy.asarray(unit_vectors(d.lat, d.lon).astype(np.float32))
        chord = 2.0 * math.sin(self.eps_m / (2.0 * EARTH_RADIUS_M))

        def fit() -> Any:
            return cuml.DBSCAN(
                eps=chord, min_samples=c.min_samples, metric="euclidean", output_type="cupy"
            ).fit(xyz)

        model = _time_calls(row, fit, c.repeat, sync=cupy.cuda.Device().synchronize)
        labels = cupy.asnumpy(model.labels_).astype(np.int64)
        self.labels["cuml-dbscan"] = labels
        row.exactness = {
            "n_clusters": int(np.unique(labels[labels >= 0]).size),
            "noise_share": float(np.mean(labels == -1)),
        }
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        row.notes.append("float32 unit vectors on the device (the copy there not timed)")
        return row

    def finish(self, rows: list[EngineResult]) -> None:
        engines = [r for r in rows if r.status == "ok" and r.engine in self.subset_labels]
        cpu = self.labels.get("cpu")
        for row in engines:
            if self.reference is not None:
                check, exact = dbscan_exactness(self.subset_labels[row.engine], *self.reference)
                row.exactness["check"] = check
                row.exactness["label_agreement"] = check["label_agreement"]
                row.exact = exact
            if cpu is not None and row.engine != "cpu":
                same = float(np.mean(self.labels[row.engine] == cpu))
                row.exactness["same_as_cpu"] = same
                row.exact = bool(row.exact is not False and same == 1.0)
            if self.reference is None:
                row.notes.append("not checked: scikit-learn's DBSCAN did not run")
        cuml_row = next((r for r in rows if r.engine == "cuml-dbscan" and r.status == "ok"), None)
        if cuml_row is not None and cpu is not None:
            cuml_row.exactness["label_agreement"] = label_agreement(self.labels["cuml-dbscan"], cpu)
        timed = {r.engine: r.warm_median_s for r in rows if r.status == "ok" and r.warm_median_s}
        if "cuml-dbscan" in timed:
            for row in engines:
                if row.engine in timed:
                    ratio = timed["cuml-dbscan"] / timed[row.engine]
                    row.notes.append(f"{ratio:.3g}x cuml-dbscan")


# -- within ----------------------------------------------------------------------------


class WithinBench(AnalyticsBench):
    """within(polygon) over N points: a star polygon of great-circle edges."""

    op = "within"

    def __init__(self, config: BenchConfig) -> None:
        super().__init__(config)
        self.polygon = WITHIN_POLYGON
        self.checked = min(self.n, config.ref_queries or WITHIN_REFERENCE_POINTS)
        p = self.polygon
        self.extra["polygon"] = (
            f"star of {p.vertices} edges around ({p.centre_lat:g}, {p.centre_lon:g}), "
            f"{p.inner_deg:g}-{p.outer_deg:g} degrees of arc"
        )
        self.notes.append(
            f"polygon: {self.extra['polygon']}; the points returned checked on the first "
            f"{self.checked:,} points against a point-in-polygon test of the bench's own "
            "(the star as triangles from its centre; points within 1e-8 rad of an edge may "
            "be either side)"
        )

    def reference_count(self) -> int:
        return self.checked

    def served(self, client: Any, engine: str) -> list[EngineResult]:
        d = self.data
        row = EngineResult(engine=engine)
        row.build_s = _upload_s(client, "points", _points_table(d.lat, d.lon))
        shape = self.polygon.geojson()
        table = _time_calls(
            row, lambda: client.within("points", polygon=shape, as_arrow=True), self.config.repeat
        )
        row.exactness, row.exact = within_exactness(
            _column(table, "id"), self.polygon, d, self.checked
        )
        row.throughput = self.n / max(row.warm_median_s or 0.0, 1e-12)
        return [row]


#: The bench of each analytics op.
ANALYTICS_BENCHES: dict[str, type[AnalyticsBench]] = {
    bench.op: bench
    for bench in (KnnJoinBench, CountWithinBench, FilteredKnnBench, DbscanBench, WithinBench)
}


# -- the run ---------------------------------------------------------------------------


def _served_rows(bench: AnalyticsBench, engine: str) -> list[EngineResult]:
    """``engine``'s rows, through a server of its own; a skipped or error row on failure."""
    if engine not in runnable_engine_names():
        return [EngineResult(engine, status="skipped", reason=f"needs a GPU: {gpu_available()[1]}")]
    try:
        bench.prepare(engine)
        with (
            served_engine(engine, settings=bench.server_settings()) as target,
            geonear.connect(target, timeout_s=CALL_TIMEOUT_S) as client,
        ):
            device = client.server_info().device
            rows = bench.served(client, engine)
            for row, staged in zip(rows, bench.staged_requests(), strict=False):
                row.notes.append(_stages_note(target, *staged))
    except EngineUnavailable as exc:
        return [EngineResult(engine, status="skipped", reason=str(exc))]
    except geonear.GeoNearError as exc:
        status = "skipped" if exc.code.name == "UNIMPLEMENTED" else "error"
        return [EngineResult(engine, status=status, reason=str(exc))]
    except Exception as exc:  # one failing engine must not hide the others' results
        return [EngineResult(engine, status="error", reason=f"{type(exc).__name__}: {exc}")]
    for row in rows:
        row.device = device
    return rows


def _stages_note(target: str, method: str, request: Any) -> str:
    """One more call of ``method`` on a plain stub: where its time went, the server's
    stages (its ``geonear-timing`` trailer) and the client's receiving and decoding."""
    client: dict[str, float] = {}
    with grpc.insecure_channel(target) as channel:
        call = getattr(pb_grpc.GeoNearStub(channel), method)(request, timeout=CALL_TIMEOUT_S)
        _, server = received_with_stages(call, client)
    return "one more call, ms: " + "; ".join(
        f"{side} " + ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in stages.items())
        for side, stages in (("server", server), ("client", client))
    )


def _peer_row(name: str, peer: Callable[[], EngineResult]) -> EngineResult:
    try:
        return peer()
    except EngineUnavailable as exc:
        return EngineResult(name, status="skipped", reason=str(exc))
    except Exception as exc:
        return EngineResult(name, status="error", reason=f"{type(exc).__name__}: {exc}")


def _add_speedups(rows: Sequence[EngineResult], sklearn: str | None) -> None:
    """vs cpu: the cpu row of the same variant ("cpu where 10%" for "gpu where 10%")."""
    timed = {r.engine: r.warm_median_s for r in rows if r.status == "ok" and r.warm_median_s}
    baseline = timed.get(sklearn) if sklearn else None
    for row in rows:
        if row.engine not in timed:
            continue
        cpu = timed.get(" ".join(["cpu", *row.engine.split(" ")[1:]]))
        row.speedup_vs_cpu = cpu / timed[row.engine] if cpu else None
        row.speedup_vs_sklearn = baseline / timed[row.engine] if baseline else None


def _check_engines(config: BenchConfig) -> tuple[str, ...]:
    engines = SERVED_ENGINES if config.engines == DEFAULT_ENGINES else config.engines
    unknown = [name for name in engines if name not in engine_names()]
    if unknown:
        raise ValueError(
            f"unknown engine(s) {', '.join(unknown)}; --op {config.op} serves one of "
            f"{', '.join(engine_names())} (its peers are added by themselves)"
        )
    return tuple(dict.fromkeys(engines))


def run_analytics(
    config: BenchConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run an analytics op of ``config``; the results document (``geonear.bench.report``'s layout).

    Engines named in ``config.engines`` (``DEFAULT_ENGINES``: cpu and gpu) run through
    servers, then the op's peers in this process.
    """
    say = progress or (lambda _text: None)
    engines = _check_engines(config)
    say(f"{config.op}: data and reference")
    bench = ANALYTICS_BENCHES[config.op](config)
    rows: list[EngineResult] = []
    for engine in engines:
        say(f"{config.op}: {engine} served")
        rows += _served_rows(bench, engine)
        gc.collect()
    for name, peer in bench.peers():
        say(f"{config.op}: {name}")
        rows.append(_peer_row(name, peer))
        gc.collect()
    bench.finish(rows)
    _add_speedups(rows, bench.sklearn_peer())
    return report.results_document(
        config=asdict(config),
        command=config.command(),
        data=bench.data_doc(),
        throughput_unit=bench.unit,
        results=[asdict(r) for r in rows],
        notes=[
            "engines: each through a geonear serve process of its own, timed at the "
            "Python client with the answer received and decoded; build s: the upload of "
            "the searched dataset (sent, checked, indexed); peers: in this process",
            *bench.notes,
        ],
    )
