"""The gRPC servicer: decodes requests, calls the domain functions, encodes answers.

Nothing here computes; every RPC is a few lines around ``geonear.service.queries`` and
the store. Errors propagate: the interceptor is the one seam that maps them to statuses
(``geonear.service.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pyarrow as pa

from geonear._version import __version__
from geonear.service.analytics.areas import Area
from geonear.service.batching import Batcher
from geonear.service.calls import CallScope, RequestFeed, in_thread, produced
from geonear.service.engines import Engine, engine_spec, runnable_engine_names
from geonear.service.engines.base import MatrixDtype
from geonear.service.errors import Cancelled, CompactTooLarge, InvalidInput, LimitExceeded
from geonear.service.host_memory import release_freed_memory
from geonear.service.queries import dbscan as dbscan_query
from geonear.service.queries import kmeans as kmeans_query
from geonear.service.queries.common import NeighbourGrid, NeighbourRows, label_tables
from geonear.service.queries.counts import count_query, count_tables
from geonear.service.queries.filters import (
    OPS,
    Filter,
    FilteredIndexes,
    PointSelection,
    parse_filter,
    selected_rows,
)
from geonear.service.queries.joins import (
    JoinSides,
    JoinSlice,
    join_sides,
    knn_join,
    knn_join_slices,
    radius_join,
    radius_join_slices,
)
from geonear.service.queries.knn import knn, knn_query, knn_slices
from geonear.service.queries.matrix import distance_tiles
from geonear.service.queries.radius import (
    INLINE_COUNT_QUERIES,
    radius,
    radius_query,
    radius_slices,
)
from geonear.service.queries.within import (
    bbox_area,
    polygon_area,
    within_query,
    within_tables,
)
from geonear.service.settings import Limits, ServerSettings
from geonear.service.store import DatasetStore, DatasetVersion
from geonear.service.timing import TIMING_KEY, StageTimes
from geonear.service.validation import (
    check_dataset_name,
    ids_are_row_numbers,
    normalise_upload,
)
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import (
    ANSWER_BATCH_BYTES,
    BatchDecoder,
    EncodedArrowData,
    Narrowing,
    narrowed,
    points_from_message,
    table_to_messages,
    tables_to_encoded,
    tables_to_messages,
)

log = logging.getLogger("geonear.servicer")

_MODES = {
    pb.UPLOAD_MODE_UNSPECIFIED: "create",
    pb.CREATE: "create",
    pb.REPLACE: "replace",
    pb.APPEND: "append",
}
_LAYOUTS = {
    pb.RESULT_LAYOUT_UNSPECIFIED: "rows",
    pb.ROWS: "rows",
    pb.PER_QUERY: "per_query",
}
#: Messages (about BATCH_BYTES each) made ahead of the sender: a slice or two.
PREFETCH_MESSAGES = 8
_DTYPES: dict[int, MatrixDtype] = {
    pb.MATRIX_DTYPE_UNSPECIFIED: "float64",
    pb.FLOAT64: "float64",
    pb.FLOAT32: "float32",
}
_FILTER_OPS = {
    pb.FILTER_OP_EQ: "==",
    pb.FILTER_OP_NE: "!=",
    pb.FILTER_OP_LT: "<",
    pb.FILTER_OP_LE: "<=",
    pb.FILTER_OP_GT: ">",
    pb.FILTER_OP_GE: ">=",
    pb.FILTER_OP_IN: "in",
    pb.FILTER_OP_NOT_IN: "not in",
}
assert sorted(_FILTER_OPS.values()) == sorted(OPS)


#: Most result rows of a KnnCompact/RadiusCompact answer (about 1.5 MB of protobuf).
COMPACT_MAX_ROWS = 65_536


def _refuse_columns(request: pb.KnnRequest | pb.RadiusRequest, rpc: str, streaming: str) -> None:
    if request.columns:
        raise InvalidInput(f"{rpc} returns no attribute columns; call {streaming} for them")


def _check_compact(result_rows: int, streaming_rpc: str) -> None:
    """Refuse, before the search, a compact answer of more than COMPACT_MAX_ROWS rows."""
    if result_rows > COMPACT_MAX_ROWS:
        raise CompactTooLarge(
            f"{result_rows} result rows exceed the {COMPACT_MAX_ROWS} of a compact "
            f"answer; call {streaming_rpc}, which streams any number"
        )


def dataset_info(d: DatasetVersion) -> pb.DatasetInfo:
    min_lat, min_lon, max_lat, max_lon = d.bounding_box()
    return pb.DatasetInfo(
        name=d.name,
        version=d.version,
        rows=d.rows,
        host_bytes=d.host_bytes,
        device_bytes=d.index.device_bytes,
        columns=[pb.Column(name=f.name, arrow_type=str(f.type)) for f in d.table.schema],
        bounding_box=pb.BoundingBox(
            min_lat=min_lat, min_lon=min_lon, max_lat=max_lat, max_lon=max_lon
        ),
        engine=d.engine,
        id_type=d.id_type,
        created_unix_s=d.created_unix_s,
    )


def _filter_value(value: pb.Value, column: str) -> Any:
    kind = value.WhichOneof("kind")
    if kind is None:
        raise InvalidInput(f"where: a value compared with {column!r} has no kind set")
    if kind == "timestamp_value":
        stamp = value.timestamp_value
        return np.datetime64(stamp.seconds * 10**9 + stamp.nanos, "ns")
    return getattr(value, kind)


def _where(message: Any) -> Filter | None:
    """The ``where`` field of a request as the domain's filter; None when unset or empty."""
    if not message.HasField("where"):
        return None
    groups = []
    for conjunction in message.where.any_of:
        predicates = []
        for p in conjunction.all_of:
            op = _FILTER_OPS.get(p.op)
            if op is None:
                raise InvalidInput(
                    f"where: predicate on {p.column!r} has op {p.op}; set one of the FilterOp "
                    "values"
                )
            listed = op in ("in", "not in")
            operand = p.WhichOneof("operand")
            if operand != ("values" if listed else "value"):
                raise InvalidInput(
                    f"where: {p.column!r} {op} takes "
                    + ("a ValueList in `values`" if listed else "one Value in `value`")
                )
            value: Any = (
                [_filter_value(v, p.column) for v in p.values.values]
                if listed
                else _filter_value(p.value, p.column)
            )
            predicates.append((p.column, op, value))
        groups.append(predicates)
    return parse_filter(groups)


def _area(message: Any, oneof: str) -> Area:
    """The box or polygon set in ``message``'s oneof ``oneof`` (an Area's or a
    WithinRequest's: the same fields)."""
    kind = message.WhichOneof(oneof)
    if kind == "bbox":
        b = message.bbox
        return bbox_area(b.min_lat, b.min_lon, b.max_lat, b.max_lon)
    if kind == "polygon_geojson":
        return polygon_area(geojson=message.polygon_geojson)
    if kind == "polygon_wkb":
        return polygon_area(wkb=message.polygon_wkb)
    raise InvalidInput("give an area: bbox, polygon_geojson or polygon_wkb")


def _within(message: Any) -> Area | None:
    """The ``within`` field of a request as the domain's area; None when unset."""
    if not message.HasField("within"):
        return None
    try:
        return _area(message.within, "kind")
    except InvalidInput as exc:
        raise InvalidInput(f"within: {exc}", **exc.metadata) from exc


def _selects(message: Any) -> bool:
    """Whether a request restricts the points it searches (``where`` or ``within``)."""
    return message.HasField("where") or message.HasField("within")


def _encoded(tables: Iterator[pa.Table], timing: StageTimes) -> Iterator[EncodedArrowData]:
    """``tables`` as one Arrow stream of ArrowData messages in their wire format (a
    response stream of ArrowData), each message's encoding timed."""
    return timing.timed(tables_to_encoded(tables, ANSWER_BATCH_BYTES), "encode", nested=True)


def _label_messages(tables: Iterator[pa.Table], timing: StageTimes) -> Iterator[pb.ArrowData]:
    """``tables`` as ArrowData messages to nest in KMeans and DBSCAN responses, timed."""
    return timing.timed(tables_to_messages(tables, ANSWER_BATCH_BYTES), "encode", nested=True)


def _more_points(message: pb.KnnRequest | pb.RadiusRequest | None) -> pb.Points | None:
    """The query points of a streamed request's later message (None at the stream's end)."""
    if message is None:
        return None
    others = [field.name for field, _ in message.ListFields() if field.name != "queries"]
    if others:
        raise InvalidInput(
            "after the first message, a streamed request carries only query points; "
            f"this one also sets {', '.join(others)}"
        )
    return message.queries


class _Upload:
    """One Upload call's batches as they arrive, checked one message at a time."""

    def __init__(self, store: DatasetStore, limits: Limits) -> None:
        self.store = store
        self.limits = limits
        self.header: pb.UploadHeader | None = None
        self.decoder = BatchDecoder()
        self.batches: list[pa.RecordBatch] = []
        self.rows = self.received_bytes = 0

    def add(self, message: pb.UploadRequest) -> None:
        if self.header is None:
            if not message.HasField("header"):
                raise InvalidInput("the first Upload message must carry the header")
            self.header = message.header
            check_dataset_name(self.header.dataset)
        elif message.HasField("header"):
            raise InvalidInput("only the first Upload message may carry a header")
        batch = self.decoder.decode(message.data) if message.HasField("data") else None
        if batch is None:
            return
        self.rows += batch.num_rows
        if self.rows > self.limits.max_upload_rows:
            raise LimitExceeded(
                f"upload exceeds max_upload_rows={self.limits.max_upload_rows} "
                "(setting GEONEAR_MAX_UPLOAD_ROWS); upload in parts with mode append",
                setting="GEONEAR_MAX_UPLOAD_ROWS",
            )
        # Refuse an upload far beyond the memory budget before all of it arrives.
        self.received_bytes += batch.nbytes
        self.store.check_host_budget(self.header.dataset, self.received_bytes)
        self.batches.append(batch)

    def commit(self, scope: CallScope) -> tuple[DatasetVersion, int]:
        """Store what came: the new version and the rows received.

        The received batches are views of the messages' bytes, which outlive the change
        (the store releases freed memory as it commits); below the mmap threshold they
        lie on the heap, so their memory is released again once they are freed, whether
        the change was stored or refused.
        """
        try:
            return self._store(scope), self.rows
        except BaseException as exc:
            # The refused change's frames would hold the batches until it is answered.
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            self.batches = []
            release_freed_memory()

    def _store(self, scope: CallScope) -> DatasetVersion:
        header = self.header
        if header is None:
            raise InvalidInput("the Upload stream was empty")
        if self.decoder.schema is None:
            raise InvalidInput("the Upload stream carried no Arrow schema")
        if not scope.is_active():
            raise Cancelled("the upload was cancelled; nothing was stored")
        mode = _MODES.get(header.mode)
        if mode is None:
            raise InvalidInput(f"unknown upload mode {header.mode}")
        table = pa.Table.from_batches(self.batches, schema=self.decoder.schema)
        # Row numbers as ids are given by the store, under its lock: an append's
        # first number depends on the dataset as the append commits.
        row_numbers = ids_are_row_numbers(table, header.id_column)
        table = normalise_upload(table, header.lat_column, header.lon_column, header.id_column)
        return self.store.upload(header.dataset, mode, table, row_numbers=row_numbers)


class GeoNearServicer(pb_grpc.GeoNearServicer):
    def __init__(
        self,
        store: DatasetStore,
        settings: ServerSettings,
        backend: str,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        self.worker_index, self.worker_processes = worker
        self.store = store
        self.settings = settings
        self.limits = settings.limits
        self.engine: Engine = store.engine
        self.backend = backend
        self.batcher = (
            Batcher(settings.batch_max_points, settings.batch_max_delay_us)
            if settings.batching
            else None
        )
        #: Indexes of the points filters select, built once per (version, filter).
        self.filtered = FilteredIndexes(self.engine)

    # -- datasets ------------------------------------------------------------------------
    async def Upload(self, request_iterator, context):
        scope = CallScope(context)
        upload = _Upload(self.store, self.limits)
        async for message in request_iterator:
            await in_thread(scope, upload.add, message)
        version, rows = await in_thread(scope, upload.commit, scope)
        return pb.UploadResponse(dataset=dataset_info(version), rows_received=rows)

    async def DeleteRows(self, request, context):
        return await in_thread(CallScope(context), self._delete_rows, request)

    def _delete_rows(self, request: pb.DeleteRowsRequest) -> pb.DeleteRowsResponse:
        if request.int_ids and request.string_ids:
            raise InvalidInput("give int_ids or string_ids, not both")
        current = self.store.get(request.dataset)
        is_int = pa.types.is_integer(current.table.column("id").type)
        if (is_int and request.string_ids) or (not is_int and request.int_ids):
            raise InvalidInput(f"dataset {request.dataset!r} has {current.id_type} ids")
        ids = list(request.int_ids) if is_int else list(request.string_ids)
        version, deleted, missing = self.store.delete_rows(request.dataset, ids)
        return pb.DeleteRowsResponse(
            dataset=dataset_info(version), rows_deleted=deleted, ids_not_found=missing
        )

    async def ListDatasets(self, request, context):
        return pb.ListDatasetsResponse(datasets=[dataset_info(d) for d in self.store.datasets()])

    async def GetDataset(self, request, context):
        return dataset_info(self.store.get(request.dataset))

    async def DropDataset(self, request, context):
        dropped = await in_thread(CallScope(context), self.store.drop, request.dataset)
        return pb.DropDatasetResponse(dataset=dropped.name, version=dropped.version)

    # -- queries -------------------------------------------------------------------------
    def _knn_args(
        self,
        request: pb.KnnRequest,
        dataset: DatasetVersion | None = None,
        points: pb.Points | None = None,
    ) -> dict[str, Any]:
        lat, lon = points_from_message(points or request.queries)
        dataset = dataset or self.store.get(request.dataset)
        return {
            "dataset": dataset,
            "lat": lat,
            "lon": lon,
            "k": int(request.k),
            "max_distance_m": (
                request.max_distance_m if request.HasField("max_distance_m") else None
            ),
            "columns": list(request.columns),
            "points": self._selection(dataset, request),
            "limits": self.limits,
        }

    def _radius_args(
        self,
        request: pb.RadiusRequest,
        dataset: DatasetVersion | None = None,
        points: pb.Points | None = None,
    ) -> dict[str, Any]:
        lat, lon = points_from_message(points or request.queries)
        dataset = dataset or self.store.get(request.dataset)
        return {
            "dataset": dataset,
            "lat": lat,
            "lon": lon,
            "radius_m": float(request.radius_m),
            "columns": list(request.columns),
            "points": self._selection(dataset, request),
            "limits": self.limits,
        }

    def _selection(self, dataset: DatasetVersion, request: Any) -> PointSelection | None:
        """The points a request's ``where`` selects and its ``within`` area holds, with
        their index (None: all)."""
        where, area = _where(request), _within(request)
        if where is None and area is None:
            return None
        return self.filtered.select(dataset, where, area)

    # Knn and Radius stream answers of any size, searched, assembled and encoded on a
    # thread a slice of queries at a time, the next slice made while one is sent; the
    # compact forms answer small queries on the event loop, where batching costs no
    # thread handoff per request (docs/benchmarks.md, "Small queries"). Every answer's
    # size is known, and checked against the limits, before the search.
    async def Knn(self, request, context):
        stream = self._streamed(context, self._answer, iter([request]), self._knn_answers)
        async for message in stream:
            yield message

    async def Radius(self, request, context):
        stream = self._streamed(context, self._answer, iter([request]), self._radius_answers)
        async for message in stream:
            yield message

    async def KnnStream(self, request_iterator, context):
        stream = self._streamed(context, self._answer, self._knn_answers, requests=request_iterator)
        async for message in stream:
            yield message

    async def RadiusStream(self, request_iterator, context):
        stream = self._streamed(
            context, self._answer, self._radius_answers, requests=request_iterator
        )
        async for message in stream:
            yield message

    async def _streamed(
        self,
        context: grpc.aio.ServicerContext,
        make: Callable[..., Iterator[Any]],
        *args: Any,
        requests: AsyncIterator[Any] | None = None,
    ) -> AsyncIterator[Any]:
        """The messages of ``make(*args, scope, timing)``, made on a thread up to
        PREFETCH_MESSAGES ahead of the sender; where the time went goes back in the
        ``geonear-timing`` trailer. With ``requests`` (a streamed request), ``make``
        gets the request's messages first, each read from the loop as it asks for it."""
        scope, timing = CallScope(context), StageTimes()
        feed = None if requests is None else RequestFeed(requests, scope)
        reader = None if feed is None else asyncio.create_task(feed.pump())
        if feed is not None:
            args = (feed.messages(), *args)
        made = produced(scope, lambda: make(*args, scope, timing), PREFETCH_MESSAGES)
        try:
            async with contextlib.aclosing(made):
                async for message in made:
                    yield message
        finally:
            if feed is not None and reader is not None:
                feed.stop()
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
        context.set_trailing_metadata(((TIMING_KEY, timing.header()),))

    def _knn_answers(
        self,
        first: pb.KnnRequest,
        points: pb.Points,
        dataset: DatasetVersion,
        offset: int,
    ) -> tuple[int, Iterator[NeighbourGrid]]:
        query = knn_query(**self._knn_args(first, dataset, points))
        return query.n_queries, knn_slices(query, offset=offset)

    def _radius_answers(
        self,
        first: pb.RadiusRequest,
        points: pb.Points,
        dataset: DatasetVersion,
        offset: int,
    ) -> tuple[int, Iterator[NeighbourRows]]:
        query = radius_query(**self._radius_args(first, dataset, points))
        return query.n_queries, radius_slices(query, offset=offset)

    def _answer(
        self,
        requests: Iterator[Any],
        answers: Callable[..., Any],
        scope: CallScope,
        timing: StageTimes,
    ) -> Iterator[EncodedArrowData]:
        """One Arrow stream answering every request message's query points in order.

        The first message is the whole request; later ones (the streaming RPCs) carry
        only more query points, answered on the first one's dataset version.
        """
        first = next(requests, None)
        if first is None:
            raise InvalidInput("the request stream carried no message")
        layout = _LAYOUTS.get(first.layout)
        if layout is None:
            raise InvalidInput(f"unknown result layout {first.layout}")
        dataset = self.store.get(first.dataset)

        def tables() -> Iterator[pa.Table]:
            offset, points = 0, first.queries
            while points is not None:
                with timing.stage("decode"):
                    n_queries, found = answers(first, points, dataset, offset)
                yield from self._assembled(found, layout, scope, timing)
                offset += n_queries
                points = _more_points(next(requests, None))

        return _encoded(tables(), timing)

    async def KnnCompact(self, request, context):
        scope = CallScope(context)
        _refuse_columns(request, "KnnCompact", "Knn")
        # A new filter's or area's index is built off the event loop.
        args = (
            await in_thread(scope, self._knn_args, request)
            if _selects(request)
            else self._knn_args(request)
        )
        query = knn_query(**args)
        _check_compact(query.result_rows, "Knn")
        found = await knn(query, batcher=self.batcher, timeout_s=scope.time_left_s())
        return self._compact(found)

    async def RadiusCompact(self, request, context):
        scope = CallScope(context)
        _refuse_columns(request, "RadiusCompact", "Radius")
        # Counting many queries, or building a filter's or area's index, is done off
        # the event loop.
        if _selects(request) or len(request.queries.lat) > INLINE_COUNT_QUERIES:
            query = await in_thread(scope, lambda: radius_query(**self._radius_args(request)))
        else:
            query = radius_query(**self._radius_args(request))
        _check_compact(query.result_rows, "Radius")
        found = await radius(query, batcher=self.batcher, timeout_s=scope.time_left_s())
        return self._compact(found)

    def _compact(self, found: NeighbourRows) -> pb.CompactNeighbours:
        response = pb.CompactNeighbours(
            query_index=found.query_index.tolist(),
            rank=found.rank.tolist(),
            distance_m=found.distances_m.tolist(),
            earth_radius_m=self.engine.earth_radius_m,
            dataset_version=found.dataset.version,
        )
        ids = found.dataset.int_ids
        if ids is not None:
            # A NumPy view of the id column: a take of a few rows costs microseconds
            # here, against tens for Arrow's compute kernel.
            response.int_ids.extend(ids[found.rows].tolist())
        else:
            response.string_ids.extend(found.ids().to_pylist())
        return response

    async def DistanceMatrix(self, request, context):
        async for message in self._streamed(context, self._matrix_tiles, request):
            yield message

    def _matrix_tiles(
        self, request: pb.DistanceMatrixRequest, scope: CallScope, timing: StageTimes
    ) -> Iterator[pb.MatrixTile]:
        with timing.stage("decode"):
            lat1, lon1 = points_from_message(request.queries)
            lat2, lon2 = self._matrix_columns(request)
            dtype: MatrixDtype | None = _DTYPES.get(request.dtype)
            if dtype is None:
                raise InvalidInput(f"unknown matrix dtype {request.dtype}")
        tiles = distance_tiles(
            self.engine, lat1, lon1, lat2, lon2, dtype, self.limits, is_active=scope.is_active
        )
        for tile in timing.timed(tiles, "search"):
            with timing.stage("encode"):
                message = pb.MatrixTile(
                    row_start=tile.row_start,
                    col_start=tile.col_start,
                    row_count=tile.values.shape[0],
                    col_count=tile.values.shape[1],
                    values=np.ascontiguousarray(
                        tile.values, dtype=f"<{dtype[0]}{tile.values.itemsize}"
                    ).tobytes(),
                    total_rows=lat1.shape[0],
                    total_cols=lat2.shape[0],
                    earth_radius_m=self.engine.earth_radius_m,
                    dtype=request.dtype or pb.FLOAT64,
                )
            yield message

    def _matrix_columns(self, request: pb.DistanceMatrixRequest) -> tuple[np.ndarray, np.ndarray]:
        if not request.dataset:
            if request.HasField("ids") or _selects(request):
                raise InvalidInput(
                    "ids, where and within select columns of a dataset; name the dataset"
                )
            if not request.HasField("targets"):
                raise InvalidInput("give a dataset or inline targets for the matrix columns")
            return points_from_message(request.targets)
        if request.HasField("targets"):
            raise InvalidInput("give a dataset or inline targets, not both")
        if request.ids.int_ids and request.ids.string_ids:
            raise InvalidInput("matrix ids: give int_ids or string_ids, not both")
        dataset = self.store.get(request.dataset)
        if not request.HasField("ids") or not (request.ids.int_ids or request.ids.string_ids):
            rows = selected_rows(dataset, _where(request), _within(request))
            if rows is None:
                return dataset.lat, dataset.lon
            return dataset.lat[rows], dataset.lon[rows]
        if _where(request) is not None or _within(request) is not None:
            raise InvalidInput("matrix columns: give ids or a selection (where, within), not both")
        wanted: list[int] | list[str] = list(request.ids.int_ids) or list(request.ids.string_ids)
        id_col = dataset.table.column("id")
        try:
            wanted_arr = pa.array(wanted, type=id_col.type)
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
            raise InvalidInput(f"ids do not match the dataset's {id_col.type} ids") from exc
        rows = pa.compute.index_in(wanted_arr, value_set=id_col)
        if rows.null_count:
            missing = [
                wanted[i] for i in np.flatnonzero(rows.is_null().to_numpy(zero_copy_only=False))[:5]
            ]
            raise InvalidInput(
                f"{rows.null_count} id(s) not in {request.dataset!r} (first: {missing})"
            )
        idx = rows.to_numpy()
        return dataset.lat[idx], dataset.lon[idx]

    async def KMeans(self, request, context):
        async for message in self._streamed(context, self._kmeans, request):
            yield message

    def _kmeans(
        self, request: pb.KMeansRequest, scope: CallScope, timing: StageTimes
    ) -> Iterator[pb.KMeansResponse]:
        with timing.stage("decode"):
            dataset = self.store.get(request.dataset)
            points = self._selection(dataset, request)
        with timing.stage("search"):
            answer = kmeans_query.kmeans(
                dataset,
                int(request.k),
                seed=int(request.seed),
                n_init=request.n_init or 1,
                max_iter=request.max_iter or 100,
                tol=request.tol or 1e-6,
                weight_column=request.weight_column,
                return_labels=request.return_labels,
                points=points,
                limits=self.limits,
                should_stop=lambda: not scope.is_active(),
            )
        result = answer.result
        # k <= max_k keeps the centroid table small enough for one message.
        (centroids,) = table_to_messages(kmeans_query.centroid_table(result), batch_bytes=1 << 62)
        yield pb.KMeansResponse(
            summary=pb.KMeansSummary(
                centroids=centroids,
                inertia_m2=result.inertia_m2,
                n_iter=result.n_iter,
                earth_radius_m=self.engine.earth_radius_m,
                dataset_version=dataset.version,
            )
        )
        if request.return_labels:
            labels = label_tables(dataset, answer.rows, result.labels, pa.int32(), scope.is_active)
            for message in _label_messages(timing.timed(labels, "assemble"), timing):
                yield pb.KMeansResponse(labels=message)

    async def CountWithin(self, request, context):
        async for message in self._streamed(context, self._counts, request):
            yield message

    def _counts(
        self, request: pb.CountWithinRequest, scope: CallScope, timing: StageTimes
    ) -> Iterator[EncodedArrowData]:
        with timing.stage("decode"):
            dataset = self.store.get(request.dataset)
            if bool(request.left_dataset) == request.HasField("queries"):
                raise InvalidInput("give query points or a left dataset (one of the two)")
            left = self.store.get(request.left_dataset) if request.left_dataset else None
            lat, lon = (
                left.index.query_degrees(left.lat, left.lon)
                if left
                else points_from_message(request.queries)
            )
            query = count_query(
                dataset,
                lat,
                lon,
                float(request.radius_m),
                points=self._selection(dataset, request),
                left=left,
                limits=self.limits,
            )
        tables = count_tables(
            query, self.engine.earth_radius_m, scope.is_active, narrow=request.narrow_integers
        )
        return _encoded(timing.timed(tables, "search"), timing)

    # Joins: the left dataset's points are the queries, searched and sent a slice at a
    # time as Knn's and Radius's are.
    async def KnnJoin(self, request, context):
        async for message in self._streamed(context, self._join, request, self._knn_join_slices):
            yield message

    async def RadiusJoin(self, request, context):
        stream = self._streamed(context, self._join, request, self._radius_join_slices)
        async for message in stream:
            yield message

    def _knn_join_slices(
        self, request: pb.KnnJoinRequest, sides: JoinSides
    ) -> tuple[int, Iterator[JoinSlice]]:
        """The join's largest rank and its slices (as ``_radius_join_slices``)."""
        join = knn_join(
            sides,
            int(request.k),
            max_distance_m=request.max_distance_m if request.HasField("max_distance_m") else None,
            points=self._selection(sides.right, request),
            limits=self.limits,
        )
        return int(request.k) - 1, knn_join_slices(join)

    def _radius_join_slices(
        self, request: pb.RadiusJoinRequest, sides: JoinSides
    ) -> tuple[int, Iterator[JoinSlice]]:
        join = radius_join(
            sides,
            float(request.radius_m),
            points=self._selection(sides.right, request),
            limits=self.limits,
        )
        return sides.right.rows - 1, radius_join_slices(join)

    def _join(
        self,
        request: Any,
        slices: Callable[..., tuple[int, Iterator[JoinSlice]]],
        scope: CallScope,
        timing: StageTimes,
    ) -> Iterator[EncodedArrowData]:
        layout = _LAYOUTS.get(request.layout)
        if layout is None:
            raise InvalidInput(f"unknown result layout {request.layout}")
        with timing.stage("decode"):
            left = self.store.get(request.left_dataset)
            right = (
                left
                if request.right_dataset == request.left_dataset
                else self.store.get(request.right_dataset)
            )
            sides = join_sides(left, right, request.left_columns, request.right_columns)
            max_rank, found = slices(request, sides)
        types = sides.narrow_types(max_rank) if request.narrow_integers else {}
        return _encoded(self._assembled(found, layout, scope, timing, types), timing)

    def _assembled(
        self,
        pieces: Iterator[Any],
        layout: str,
        scope: CallScope,
        timing: StageTimes,
        narrow_types: dict[str, Narrowing] | None = None,
    ) -> Iterator[pa.Table]:
        """Each searched slice as a result table, its integer columns in ``narrow_types``
        where given (ids gathered narrow); the search stops once the call is over."""
        for piece in timing.timed(pieces, "search"):
            with timing.stage("assemble"):
                if narrow_types:
                    wide = piece.table(self.engine.earth_radius_m, layout, narrow_ids=True)
                    table = narrowed(wide, narrow_types)
                else:
                    table = piece.table(self.engine.earth_radius_m, layout)
            yield table
            if not scope.is_active():
                raise Cancelled("the call was cancelled; its search stopped")

    async def Dbscan(self, request, context):
        async for message in self._streamed(context, self._dbscan, request):
            yield message

    def _dbscan(
        self, request: pb.DbscanRequest, scope: CallScope, timing: StageTimes
    ) -> Iterator[pb.DbscanResponse]:
        with timing.stage("decode"):
            dataset = self.store.get(request.dataset)
            points = self._selection(dataset, request)
        with timing.stage("search"):
            answer = dbscan_query.dbscan(
                dataset,
                float(request.eps_m),
                int(request.min_samples),
                points=points,
                return_labels=request.return_labels,
                earth_radius_m=self.engine.earth_radius_m,
                limits=self.limits,
                should_stop=lambda: not scope.is_active(),
            )
        result = answer.result
        yield pb.DbscanResponse(
            summary=pb.DbscanSummary(
                n_clusters=result.n_clusters,
                sizes=result.sizes.tolist(),
                n_noise=result.n_noise,
                earth_radius_m=self.engine.earth_radius_m,
                dataset_version=dataset.version,
            )
        )
        if request.return_labels:
            labels = label_tables(dataset, answer.rows, result.labels, pa.int64(), scope.is_active)
            for message in _label_messages(timing.timed(labels, "assemble"), timing):
                yield pb.DbscanResponse(labels=message)

    async def Within(self, request, context):
        async for message in self._streamed(context, self._within, request):
            yield message

    def _within(
        self, request: pb.WithinRequest, scope: CallScope, timing: StageTimes
    ) -> Iterator[EncodedArrowData]:
        with timing.stage("decode"):
            dataset = self.store.get(request.dataset)
            area = _area(request, "area")
            selected = selected_rows(dataset, _where(request))
        with timing.stage("search"):
            query = within_query(
                dataset, area, selected=selected, columns=request.columns, limits=self.limits
            )
        tables = within_tables(query, scope.is_active)
        return _encoded(timing.timed(tables, "assemble"), timing)

    async def ServerInfo(self, request, context):
        used, total = self.engine.memory_pool_bytes()
        limits = self.limits
        others = [n for n in runnable_engine_names() if n != self.engine.name]
        specs = [self.engine.spec, *map(engine_spec, others)]
        return pb.ServerInfoResponse(
            version=__version__,
            backend=self.backend,
            device=self.engine.describe_device(),
            earth_radius_m=self.engine.earth_radius_m,
            limits=pb.Limits(
                max_k=limits.max_k,
                max_matrix_cells=limits.max_matrix_cells,
                max_upload_rows=limits.max_upload_rows,
                max_message_bytes=limits.max_message_bytes,
                max_query_points=limits.max_query_points,
                max_concurrent_rpcs=limits.max_concurrent_rpcs,
                max_dataset_host_bytes=limits.dataset_host_bytes(),
                max_dataset_device_bytes=limits.max_dataset_device_bytes,
                max_result_rows=limits.result_rows(),
            ),
            engines=[spec.name for spec in specs],
            engine_descriptions=[
                pb.EngineDescription(
                    name=spec.name,
                    device_kind=spec.device_kind,
                    capabilities=sorted(spec.capabilities),
                    summary=spec.summary,
                )
                for spec in specs
            ],
            worker_processes=self.worker_processes,
            worker_index=self.worker_index,
            pool_used_bytes=used,
            pool_total_bytes=total,
        )
