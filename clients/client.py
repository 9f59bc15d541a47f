"""The Python client: ``geonear.connect(...)`` and :class:`Client`.

Calls take and return pandas / pyarrow / NumPy objects and the dataclasses of
:mod:`geonear.clients.models`; errors raise the :mod:`geonear.clients.errors`
hierarchy with the server's status and message.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa

from geonear.allocator import tune_allocator
from geonear.clients.areas import set_area, within_message
from geonear.clients.cli_options import DEFAULT_TARGET
from geonear.clients.errors import GeoNearError, ResourceExhausted, from_rpc_error
from geonear.clients.filters import filter_message
from geonear.clients.models import DatasetInfo, DeleteResult, ServerInfo
from geonear.clients.query_points import Queries, attach_queries, queries
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import (
    COMPACT_RADIUS_QUERIES,
    COMPACT_ROWS,
    compact_to_table,
    messages_to_table,
    points_to_message,
    table_to_messages,
)

#: Query points per request message (about 1 MB of Arrow); larger query sets go up as a
#: stream of such messages, each searched on the server as it arrives.
QUERY_CHUNK = 65_536
#: Result layouts by name (the proto's ResultLayout).
LAYOUTS: dict[str, pb.ResultLayout] = {"rows": pb.ROWS, "per_query": pb.PER_QUERY}
_MODES = {"create": pb.CREATE, "replace": pb.REPLACE, "append": pb.APPEND}
_MESSAGE_BYTES = 64 * 1024 * 1024
_UNKNOWN_DATASET = re.compile(r"no dataset named '([^']*)'")
#: Words of gRPC's message when nothing answers at the address.
_UNREACHABLE = ("connection refused", "failed to connect", "dns resolution failed")


@dataclass(frozen=True)
class KMeansOutcome:
    """Spherical k-means result: centroids (cluster, lat, lon, size), inertia, labels."""

    centroids: pd.DataFrame
    inertia_m2: float
    n_iter: int
    earth_radius_m: float
    labels: pd.DataFrame | None = None


@dataclass(frozen=True)
class DbscanOutcome:
    """DBSCAN result: clusters, their sizes (cluster number order), noise, labels.

    ``labels`` (id, cluster; -1 for noise) covers the clustered points, in row order,
    when they were asked for.
    """

    n_clusters: int
    sizes: tuple[int, ...]
    n_noise: int
    earth_radius_m: float
    dataset_version: int
    labels: pd.DataFrame | None = None

    def __repr__(self) -> str:
        sizes = ", ".join(map(str, self.sizes[:8])) + (", ..." if len(self.sizes) > 8 else "")
        labels = "None" if self.labels is None else f"<{len(self.labels)} rows>"
        return (
            f"DbscanOutcome(n_clusters={self.n_clusters}, sizes=[{sizes}], "
            f"n_noise={self.n_noise}, labels={labels})"
        )


def _split_ids(ids: Iterable[Any]) -> tuple[list[int], list[str]]:
    """Ids as the (int_ids, string_ids) pair of the contract; one of the two is empty."""
    values = list(ids)
    if values and isinstance(values[0], str):
        return [], [str(v) for v in values]
    return [int(v) for v in values], []


def _column_list(columns: str | Sequence[str] | None) -> list[str]:
    """Attribute columns: one name as a string, or a sequence of names."""
    if columns is None:
        return []
    if isinstance(columns, str):
        return [columns]
    return [str(c) for c in columns]


def _layout(name: str) -> pb.ResultLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {name!r}") from None


def _limit_per_query(table: pa.Table, max_per_query: int | None, sort: str) -> pa.Table:
    """Radius rows ordered ``asc`` (nearest first) or ``desc``, at most n per query.

    Applied to what the server sent: it saves memory and printing, not the transfer.
    """
    if sort not in ("asc", "desc"):
        raise ValueError(f"sort must be 'asc' or 'desc', got {sort!r}")
    if max_per_query is not None and max_per_query < 0:
        raise ValueError(f"max_per_query must be >= 0, got {max_per_query}")
    if sort == "asc" and max_per_query is None:
        return table
    if "query_index" not in table.column_names:
        if sort != "asc":
            raise ValueError("sort='desc' applies to the rows layout")
        lists = [pa.compute.list_slice(c, 0, max_per_query) for c in table.columns]
        return pa.table(lists, schema=table.schema)
    query = table.column("query_index").to_numpy()
    rank = table.column("rank").to_numpy().astype(np.int64)
    order = np.lexsort((rank if sort == "asc" else -rank, query))
    if max_per_query is not None:
        ordered = query[order]
        position = np.arange(ordered.shape[0]) - np.searchsorted(ordered, ordered, side="left")
        order = order[position < max_per_query]
    return table.take(pa.array(order))


Pem = str | os.PathLike | bytes


def _pem(value: Pem | None) -> bytes | None:
    """PEM bytes given as bytes, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call.

    Metadata rather than call credentials: gRPC refuses call credentials on a plaintext
    channel, and a token over plaintext still has its use on a loopback or private net.
    """

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _add(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._entry]
        return details._replace(metadata=metadata)

    def _intercept(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._add(details), request)

    intercept_unary_unary = _intercept
    intercept_unary_stream = _intercept
    intercept_stream_unary = _intercept
    intercept_stream_stream = _intercept


def open_channel(
    target: str,
    *,
    tls: bool = False,
    tls_ca: Pem | None = None,
    tls_cert: Pem | None = None,
    tls_key: Pem | None = None,
    token: str | None = None,
    server_name: str | None = None,
) -> grpc.Channel:
    """A channel to ``target``: plaintext, TLS or mutual TLS, with an optional token.

    TLS is used when ``tls`` is True or any TLS file is given; without ``tls_ca`` the
    system's roots verify the server. Mutual TLS needs both ``tls_cert`` and ``tls_key``.
    ``server_name`` overrides the name checked in the server's certificate.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("mutual TLS needs both tls_cert and tls_key")
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", _MESSAGE_BYTES),
        ("grpc.max_receive_message_length", _MESSAGE_BYTES),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if tls or tls_ca is not None or tls_cert is not None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_pem(tls_ca),
            private_key=_pem(tls_key),
            certificate_chain=_pem(tls_cert),
        )
        channel = grpc.secure_channel(target, credentials, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


def _arrow_calls(channel: grpc.Channel) -> dict[str, Any]:
    """Each GeoNear RPC that answers with an ArrowData stream, by name, its messages
    given as received (bytes), which ``messages_to_table`` reads without a protobuf
    parse: no copy of the answer's bytes on the way in."""
    service = pb.DESCRIPTOR.services_by_name["GeoNear"]
    calls: dict[str, Any] = {}
    for method in service.methods:
        if not method.server_streaming or method.output_type is not pb.ArrowData.DESCRIPTOR:
            continue
        request = getattr(pb, method.input_type.name)
        make = channel.stream_stream if method.client_streaming else channel.unary_stream
        calls[method.name] = make(
            f"/{service.full_name}/{method.name}",
            request_serializer=request.SerializeToString,
            response_deserializer=None,
        )
    return calls


class Client:
    """A connection to a geonear server.

    Parameters
    ----------
    target : str
        ``host:port`` of the server.
    timeout_s : float, optional
        Default deadline of every call, seconds (None: no deadline).
    tls : bool
        Use TLS, verifying the server against the system's roots (implied by the
        options below).
    tls_ca : path or PEM bytes, optional
        CA bundle that signed the server's certificate.
    tls_cert, tls_key : path or PEM bytes, optional
        Client certificate chain and key, for a server that asks for mutual TLS.
    token : str, optional
        Bearer token sent with every call (a server started with ``--auth-tokens``).
    server_name : str, optional
        Name to verify in the server's certificate instead of the target's host.
    channel : grpc.Channel, optional
        A ready channel; the connection options above are then ignored.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout_s: float | None = None,
        tls: bool = False,
        tls_ca: Pem | None = None,
        tls_cert: Pem | None = None,
        tls_key: Pem | None = None,
        token: str | None = None,
        server_name: str | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        tune_allocator()
        self.target = target
        self.timeout_s = timeout_s
        self._secure = bool(tls or tls_ca is not None or tls_cert is not None)
        self._token = bool(token)
        self._channel = channel or open_channel(
            target,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            token=token,
            server_name=server_name,
        )
        self._stub = pb_grpc.GeoNearStub(self._channel)
        self._arrow_calls = _arrow_calls(self._channel)
        self._on_close: list[Any] = []
        self._closed = False
        #: True when this client started the server it talks to (``geonear.connect()``).
        self.in_process = False

    # -- plumbing ------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()
        for hook in reversed(self._on_close):
            hook()
        self._on_close.clear()
        self._closed = True

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        how = ["in-process server" if self.in_process else "remote server"]
        if self._secure:
            how.append("TLS")
        if self._token:
            how.append("token")
        how.append("closed" if self._closed else "open")
        return f"Client({self.target!r}, {', '.join(how)})"

    def _error(self, exc: grpc.RpcError) -> GeoNearError:
        """The client error for ``exc``, with a hint where one helps."""
        error = from_rpc_error(exc)
        if error.code == grpc.StatusCode.NOT_FOUND:
            match = _UNKNOWN_DATASET.search(error.message)
            if match:
                error.message += self._did_you_mean(match.group(1))
        elif error.code == grpc.StatusCode.UNAVAILABLE and any(
            word in error.message.lower() for word in _UNREACHABLE
        ):
            error.message = (
                f"cannot reach a server at {self.target} ({error.message}); is a server "
                "running there? Start one with `geonear serve`"
            )
        return error

    def _did_you_mean(self, name: str) -> str:
        try:
            found = self._stub.ListDatasets(pb.ListDatasetsRequest(), timeout=10)
        except grpc.RpcError:
            return ""
        names = [d.name for d in found.datasets]
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        if close:
            return "; did you mean " + " or ".join(map(repr, close)) + "?"
        return f"; there are {', '.join(map(repr, names))}" if names else "; there are none"

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def _arrow(self, method: str, request: Any) -> pa.Table:
        """The Arrow stream answering ``request``, decoded message by message."""
        try:
            return messages_to_table(self._arrow_calls[method](request, timeout=self.timeout_s))
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def _stream(self, method: str, request: Any, timeout_s: float | None = None) -> list[Any]:
        try:
            return list(getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s))
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    # -- datasets ------------------------------------------------------------------------
    def upload(
        self,
        name: str,
        data: Any,
        *,
        lat: str | None = None,
        lon: str | None = None,
        id: str | bool | None = None,
        mode: str = "create",
        skip_invalid: bool = False,
        timeout_s: float | None = None,
    ) -> DatasetInfo:
        """Upload points as dataset ``name``; returns the new version's description.

        Parameters
        ----------
        data : DataFrame, GeoDataFrame, GeoSeries, pyarrow Table or stream, or a path
            The points: anything :func:`geonear.loaders.read_points` reads, files
            included. A GeoDataFrame's point geometry gives lat and lon.
        lat, lon, id : str, optional
            Columns to use, detected when None as ``geonear load`` detects them
            (lat/latitude/y, lon/lng/long/longitude/x, id/name/code; any case).
            Without an id column row numbers become ids; ``id=False`` numbers the rows
            even when an id-like column exists.
        mode : {"create", "replace", "append"}
            create fails if the dataset exists.
        skip_invalid : bool
            Drop rows with bad coordinates or ids instead of raising.

        Coordinates and ids are checked here before anything is sent: a bad row raises
        :class:`geonear.loaders.InvalidPoints` and a missing or ambiguous column
        :class:`geonear.loaders.ColumnError` (both ValueErrors), and nothing is stored.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        from geonear.loaders.points import upload_points

        result = upload_points(
            self,
            name,
            data,
            mode=mode,
            lat=lat,
            lon=lon,
            id=id,
            skip_invalid=skip_invalid,
            timeout_s=timeout_s,
        )
        return result.dataset  # type: ignore[no-any-return]

    def upload_mapped(
        self,
        name: str,
        batches: pa.RecordBatchReader | pa.Table,
        *,
        mode: str = "create",
        timeout_s: float | None = None,
    ) -> DatasetInfo:
        """Send points whose columns are already ``id`` (optional), ``lat``, ``lon``, ...

        The layer under :meth:`upload`, for streams that
        :func:`geonear.loaders.read_points` made: no column detection, no checks.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        header = pb.UploadHeader(
            dataset=name, mode=_MODES[mode], lat_column="lat", lon_column="lon", id_column="id"
        )

        def requests() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(header=header)
            if isinstance(batches, pa.Table):
                for message in table_to_messages(batches):
                    yield pb.UploadRequest(data=message)
                return
            first = True
            for batch in batches:
                for message in table_to_messages(pa.Table.from_batches([batch])):
                    if not first:
                        message.schema = b""
                    first = False
                    yield pb.UploadRequest(data=message)

        try:
            response = self._stub.Upload(requests(), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return DatasetInfo.from_message(response.dataset)

    def datasets(self) -> list[DatasetInfo]:
        """Every dataset's current version, by name."""
        found = self._call("ListDatasets", pb.ListDatasetsRequest())
        return [DatasetInfo.from_message(d) for d in found.datasets]

    def info(self, name: str) -> DatasetInfo:
        """Dataset ``name``'s current version: rows, columns, bounding box, memory."""
        return DatasetInfo.from_message(
            self._call("GetDataset", pb.GetDatasetRequest(dataset=name))
        )

    def drop(self, name: str) -> int:
        """Drop dataset ``name``; returns the version that was dropped."""
        return int(self._call("DropDataset", pb.DropDatasetRequest(dataset=name)).version)

    def delete(self, name: str, ids: Iterable[int] | Iterable[str]) -> DeleteResult:
        """Delete the rows with these ids; returns the new version and the counts."""
        int_ids, string_ids = _split_ids(ids)
        request = pb.DeleteRowsRequest(dataset=name, int_ids=int_ids, string_ids=string_ids)
        return DeleteResult.from_message(self._call("DeleteRows", request))

    def server_info(self) -> ServerInfo:
        """The server's version, backend, device, earth radius, limits and engines."""
        return ServerInfo.from_message(self._call("ServerInfo", pb.ServerInfoRequest()))

    # -- queries -------------------------------------------------------------------------
    def _neighbour_table(
        self, method: str, make_request: Any, found: Queries, compact: bool = False
    ) -> pa.Table:
        """The answer of ``method`` as one table; a query set beyond one message goes up
        as a stream (KnnStream, RadiusStream), each part searched as it arrives, and
        the answer is decoded message by message as it comes back."""
        if compact:
            try:
                answer = self._call(
                    method + "Compact", make_request(points_to_message(found.lat, found.lon))
                )
            except ResourceExhausted:
                pass  # more rows than a compact answer holds: stream them instead
            else:
                return compact_to_table(answer)
        # Each part is encoded as the stream sends it, not all of them before the call.
        parts = (
            points_to_message(found.lat[i : i + QUERY_CHUNK], found.lon[i : i + QUERY_CHUNK])
            for i in range(0, max(1, len(found)), QUERY_CHUNK)
        )
        first = make_request(next(parts))
        request: Any = first
        streamed = len(found) > QUERY_CHUNK
        if streamed:
            more = type(first)
            request = itertools.chain([first], (more(queries=p) for p in parts))
        return self._arrow(method + "Stream" if streamed else method, request)

    def knn(
        self,
        name: str,
        lat: Any,
        lon: Any = None,
        k: int = 10,
        *,
        max_distance_m: float | None = None,
        where: Any = None,
        within: Any = None,
        columns: str | Sequence[str] | None = None,
        query_columns: str | Sequence[str] | bool | None = None,
        layout: str = "rows",
        as_arrow: bool = False,
        as_geo: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """The k nearest points of dataset ``name`` to each query, nearest first.

        Parameters
        ----------
        lat, lon : float or array-like, degrees
            The query points, latitude first. Or ``lat`` alone: a pandas DataFrame
            (lat/lon columns detected as in :meth:`upload`), a GeoDataFrame or a
            GeoSeries of points (EPSG:4326); then pass ``k`` and the rest by keyword.
        k : int
            Neighbours per query; more than the dataset holds returns every point.
        max_distance_m : float, optional
            Leave out neighbours farther than this, metres.
        where : list of tuples, or list of lists of tuples, optional
            Search only the points this attribute filter selects, in pyarrow's
            ``filters=`` form: ``[("country", "==", "FR"), ("pop", ">=", 10_000)]``
            (ANDed), or a list of such lists (ORed); ops ``==``, ``!=``, ``<``, ``<=``,
            ``>``, ``>=``, ``in``, ``not in``. Exact: the k nearest among the points
            selected, not a filter of the k nearest. A null never matches.
        within : bbox tuple, GeoJSON, WKB or shapely geometry, optional
            Search only the points in this area (and selected by ``where``, when
            given), exactly as ``where``: a box ``(min_lat, min_lon, max_lat,
            max_lon)`` in degrees (``min_lon > max_lon`` crosses the antimeridian), or a
            polygon as :meth:`within` takes it (great-circle edges, boundary inside).
            An area holding no point gives no rows.
        columns : str or sequence of str
            Dataset attribute columns to add; a string is one column name.
        query_columns : str, sequence of str or True, optional
            Columns of the query frame to add (True: all of them), named
            ``query_NAME`` where NAME is taken by the result or is lat, lon or geometry.
        layout : {"rows", "per_query"}
            "rows": one row per neighbour (below). "per_query": one row per query, in
            query order, with ``id``, ``distance_m`` and each attribute column as a list
            of its neighbours (fixed-size lists of min(k, dataset rows), null entries
            where ``max_distance_m`` leaves a query fewer): 16 bytes a neighbour on the
            wire against 28, and no query_index or rank.
        as_arrow : bool
            Return a pyarrow Table (no index).
        as_geo : bool
            Return a GeoDataFrame whose geometry is each row's query point, EPSG:4326
            (needs geopandas: ``pip install 'geonear[geo]'``).

        Returns
        -------
        pandas.DataFrame
            Columns query_index (0-based position of the query), rank, id, distance_m
            (great-circle metres), the attribute ``columns``, then ``query_columns``.
            When the queries have an index (a DataFrame, GeoSeries or Series), each row
            carries its query's index label.
        """
        found = queries(lat, lon, "knn queries")
        wanted = _column_list(columns)
        wire_filter = filter_message(where)
        wire_area = within_message(within)
        wire_layout = _layout(layout)

        def request(points: pb.Points) -> pb.KnnRequest:
            return pb.KnnRequest(
                dataset=name,
                queries=points,
                k=k,
                max_distance_m=max_distance_m,
                columns=wanted,
                layout=wire_layout,
                where=wire_filter,
                within=wire_area,
            )

        compact = not wanted and layout == "rows" and len(found) * k <= COMPACT_ROWS
        table = self._neighbour_table("Knn", request, found, compact)
        return attach_queries(table, found, query_columns, as_arrow=as_arrow, as_geo=as_geo)

    def radius(
        self,
        name: str,
        lat: Any,
        lon: Any = None,
        radius_m: float | None = None,
        *,
        where: Any = None,
        within: Any = None,
        columns: str | Sequence[str] | None = None,
        query_columns: str | Sequence[str] | bool | None = None,
        max_per_query: int | None = None,
        sort: str = "asc",
        layout: str = "rows",
        as_arrow: bool = False,
        as_geo: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """Every point of ``name`` within ``radius_m`` metres of each query; as :meth:`knn`.

        ``layout="per_query"`` gives one row per query with lists of each query's own
        length. ``where`` searches only the points an attribute filter selects, and
        ``within`` only those in an area (as :meth:`knn`'s).
        ``sort`` orders each query's points by distance, ``asc`` (nearest first, as the
        server sends them) or ``desc``; ``max_per_query`` keeps the first n of that
        order (like Redis GEOSEARCH ``COUNT n ASC``). Both apply here, in the client,
        to every point the server sent: they make results smaller, not faster.
        """
        if radius_m is None:
            raise TypeError("radius() needs radius_m, metres")
        found = queries(lat, lon, "radius queries")
        wanted = _column_list(columns)
        wire_filter = filter_message(where)
        wire_area = within_message(within)
        wire_layout = _layout(layout)

        def request(points: pb.Points) -> pb.RadiusRequest:
            return pb.RadiusRequest(
                dataset=name,
                queries=points,
                radius_m=radius_m,
                columns=wanted,
                layout=wire_layout,
                where=wire_filter,
                within=wire_area,
            )

        compact = not wanted and layout == "rows" and len(found) <= COMPACT_RADIUS_QUERIES
        table = self._neighbour_table("Radius", request, found, compact)
        table = _limit_per_query(table, max_per_query, sort)
        return attach_queries(table, found, query_columns, as_arrow=as_arrow, as_geo=as_geo)

    def count_within(
        self,
        name: str,
        lat: Any = None,
        lon: Any = None,
        radius_m: float | None = None,
        *,
        left: str | None = None,
        where: Any = None,
        within: Any = None,
        as_arrow: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """How many points of ``name`` lie within ``radius_m`` metres of each query point,
        or of each point of the stored dataset ``left``; only the counts cross the wire.

        Parameters
        ----------
        lat, lon : float or array-like, degrees, optional
            The query points, as for :meth:`knn` (a frame as ``lat`` alone works too).
        radius_m : float
            Radius in metres; a point at exactly that distance counts.
        left : str, optional
            Count around every point of this stored dataset instead of query points.
        where : list of tuples, optional
            Count only the points of ``name`` this attribute filter selects (see
            :meth:`knn`).
        within : bbox tuple, GeoJSON, WKB or shapely geometry, optional
            Count only the points of ``name`` in this area (see :meth:`knn`).
        as_arrow : bool
            Return a pyarrow Table.

        Returns
        -------
        pandas.DataFrame
            query_index and count (int64) a query, in query order, with the queries'
            index where they have one; with ``left``: left_id (the left dataset's ids, in
            its row order) and count. Counts are exact: the number of rows
            :meth:`radius` would return for the query. Query sets beyond 65,536 points
            are counted in parts of that size, each on the version of ``name`` current
            when it arrives.
        """
        if radius_m is None:
            raise TypeError("count_within() needs radius_m, metres")
        wire_filter = filter_message(where)
        wire_area = within_message(within)
        if left is not None:
            if lat is not None or lon is not None:
                raise ValueError("give query points or left, not both")
            request = pb.CountWithinRequest(
                dataset=name,
                left_dataset=left,
                radius_m=radius_m,
                where=wire_filter,
                within=wire_area,
                narrow_integers=True,
            )
            table = self._arrow("CountWithin", request)
            return table if as_arrow else table.to_pandas()
        if lat is None:
            raise TypeError("count_within() needs query points (lat, lon) or left=")
        found = queries(lat, lon, "count queries")
        parts = []
        for start in range(0, max(1, len(found)), QUERY_CHUNK):
            stop = start + QUERY_CHUNK
            request = pb.CountWithinRequest(
                dataset=name,
                queries=points_to_message(found.lat[start:stop], found.lon[start:stop]),
                radius_m=radius_m,
                where=wire_filter,
                within=wire_area,
                narrow_integers=True,
            )
            part = self._arrow("CountWithin", request)
            if start:
                shifted = pa.compute.add(part.column("query_index"), start)
                part = part.set_column(0, "query_index", shifted)
            parts.append(part)
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        return attach_queries(table, found, None, as_arrow=as_arrow)

    def knn_join(
        self,
        left: str,
        right: str,
        k: int = 1,
        *,
        max_distance_m: float | None = None,
        where: Any = None,
        within: Any = None,
        left_columns: str | Sequence[str] = (),
        right_columns: str | Sequence[str] = (),
        layout: str = "rows",
        as_arrow: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """The k nearest points of stored dataset ``right`` to every point of stored
        dataset ``left``, all in the server (like ``geopandas.sjoin_nearest``).

        Parameters
        ----------
        left, right : str
            Dataset names; they may be one (each point's nearest is then itself, at 0 m).
        k : int
            Neighbours per left point; more than the right points selected returns all.
        max_distance_m : float, optional
            Leave out neighbours farther than this, metres.
        where : list of tuples, optional
            Search only the right points this attribute filter selects (see :meth:`knn`).
        within : bbox tuple, GeoJSON, WKB or shapely geometry, optional
            Search only the right points in this area (see :meth:`knn`); every left
            point is still answered.
        left_columns, right_columns : str or sequence of str
            Columns of each side to add (attributes, lat, lon). A name asked of both
            sides, or named left_id or right_id, gets the suffix ``_left``/``_right``.
        layout : {"rows", "per_query"}
            "per_query": one row per left point, with right_id, distance_m and the right
            columns as lists (as :meth:`knn`'s), the left columns as values.
        as_arrow : bool
            Return a pyarrow Table.

        Returns
        -------
        pandas.DataFrame
            left_id, rank (0 = nearest), right_id, distance_m (great-circle metres), then
            the left and right columns; in left row order, nearest first. At most
            left rows x min(k, right rows) rows (``max_result_rows`` bounds it).
        """
        request = pb.KnnJoinRequest(
            left_dataset=left,
            right_dataset=right,
            k=k,
            max_distance_m=max_distance_m,
            where=filter_message(where),
            within=within_message(within),
            left_columns=_column_list(left_columns),
            right_columns=_column_list(right_columns),
            layout=_layout(layout),
            narrow_integers=True,
        )
        table = self._arrow("KnnJoin", request)
        return table if as_arrow else table.to_pandas()

    def radius_join(
        self,
        left: str,
        right: str,
        radius_m: float,
        *,
        where: Any = None,
        within: Any = None,
        left_columns: str | Sequence[str] = (),
        right_columns: str | Sequence[str] = (),
        layout: str = "rows",
        as_arrow: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """Every point of stored dataset ``right`` within ``radius_m`` metres of each point
        of stored dataset ``left``, nearest first per left point; as :meth:`knn_join`
        (``layout="per_query"`` lists have each left point's own length)."""
        request = pb.RadiusJoinRequest(
            left_dataset=left,
            right_dataset=right,
            radius_m=radius_m,
            where=filter_message(where),
            within=within_message(within),
            left_columns=_column_list(left_columns),
            right_columns=_column_list(right_columns),
            layout=_layout(layout),
            narrow_integers=True,
        )
        table = self._arrow("RadiusJoin", request)
        return table if as_arrow else table.to_pandas()

    def distance_matrix(
        self,
        lat: Any,
        lon: Any = None,
        name: str | None = None,
        lat2: Any = None,
        lon2: Any = None,
        *,
        ids: Sequence[int] | Sequence[str] | None = None,
        where: Any = None,
        within: Any = None,
        dtype: str = "float64",
    ) -> np.ndarray:
        """Great-circle metres from each query point (rows) to a dataset or a second set.

        Rows are the points (``lat``, ``lon``), or ``lat`` alone as a DataFrame,
        GeoDataFrame or GeoSeries (see :meth:`knn`). Columns are the points of dataset
        ``name`` (in row order, or the rows of ``ids`` in that order, or only the
        points the filter ``where`` selects and the area ``within`` holds, in row
        order: see :meth:`knn`), or the
        points (``lat2``, ``lon2``), which may likewise be one frame given as ``lat2``.
        ``dtype`` float64 is exact; float32 halves the bytes and carries up to about
        4 m error at long range. Returns a NumPy array of shape (rows, columns).
        """
        if dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be float64 or float32, got {dtype!r}")
        rows = queries(lat, lon, "matrix rows")
        request = pb.DistanceMatrixRequest(
            queries=points_to_message(rows.lat, rows.lon),
            dtype=pb.FLOAT64 if dtype == "float64" else pb.FLOAT32,
        )
        if name is not None:
            request.dataset = name
            if ids is not None:
                int_ids, string_ids = _split_ids(ids)
                request.ids.int_ids.extend(int_ids)
                request.ids.string_ids.extend(string_ids)
            wire_filter = filter_message(where)
            if wire_filter is not None:
                request.where.CopyFrom(wire_filter)
            wire_area = within_message(within)
            if wire_area is not None:
                request.within.CopyFrom(wire_area)
        elif where is not None or within is not None:
            raise ValueError("where and within select a dataset's points; give the dataset name")
        elif lat2 is not None:
            columns = queries(lat2, lon2, "matrix columns")
            request.targets.CopyFrom(points_to_message(columns.lat, columns.lon))
        else:
            raise ValueError("give a dataset name or lat2 and lon2")
        out: np.ndarray | None = None
        for tile in self._stream("DistanceMatrix", request):
            if out is None:
                out = np.empty((tile.total_rows, tile.total_cols), dtype=dtype)
            values = np.frombuffer(tile.values, dtype="<f8" if dtype == "float64" else "<f4")
            out[
                tile.row_start : tile.row_start + tile.row_count,
                tile.col_start : tile.col_start + tile.col_count,
            ] = values.reshape(tile.row_count, tile.col_count)
        if out is None:
            out = np.empty((len(rows), 0), dtype=dtype)
        return out

    def kmeans(
        self,
        name: str,
        k: int,
        *,
        seed: int = 0,
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-6,
        weights: str | None = None,
        where: Any = None,
        within: Any = None,
        return_labels: bool = False,
    ) -> KMeansOutcome:
        """Spherical k-means of dataset ``name``; ``weights`` names a numeric column.

        ``where`` (an attribute filter) and ``within`` (an area) cluster only the points
        they select (see :meth:`knn`): the answer is that of a dataset holding only
        them, ``k`` at most their number, and ``labels`` (id, cluster) covers only them,
        in row order.
        """
        request = pb.KMeansRequest(
            dataset=name,
            k=k,
            seed=seed,
            n_init=n_init,
            max_iter=max_iter,
            tol=tol,
            weight_column=weights or "",
            return_labels=return_labels,
            where=filter_message(where),
            within=within_message(within),
        )
        messages = self._stream("KMeans", request)
        summary = messages[0].summary
        labels = None
        if return_labels:
            labels = messages_to_table(m.labels for m in messages[1:]).to_pandas()
        return KMeansOutcome(
            centroids=messages_to_table([summary.centroids]).to_pandas(),
            inertia_m2=summary.inertia_m2,
            n_iter=summary.n_iter,
            earth_radius_m=summary.earth_radius_m,
            labels=labels,
        )

    def dbscan(
        self,
        name: str,
        eps_m: float,
        min_samples: int,
        *,
        where: Any = None,
        within: Any = None,
        return_labels: bool = True,
    ) -> DbscanOutcome:
        """DBSCAN density clusters of dataset ``name`` by great-circle distance.

        Parameters
        ----------
        eps_m : float
            Neighbourhood radius, metres (> 0); a point at exactly eps_m is a neighbour.
        min_samples : int
            Points a neighbourhood needs, the point itself included, for a core point.
        where : list of tuples, optional
            Cluster only the points this attribute filter selects (see :meth:`knn`).
        within : bbox tuple, GeoJSON, WKB or shapely geometry, optional
            Cluster only the points in this area (see :meth:`knn`).
        return_labels : bool
            Also fetch each clustered point's label (id, cluster; -1 for noise).

        Returns
        -------
        DbscanOutcome
            Clusters numbered 0, 1, ... in the order of their first row.
        """
        request = pb.DbscanRequest(
            dataset=name,
            eps_m=eps_m,
            min_samples=min_samples,
            where=filter_message(where),
            within=within_message(within),
            return_labels=return_labels,
        )
        messages = self._stream("Dbscan", request)
        summary = messages[0].summary
        labels = None
        if return_labels:
            labels = messages_to_table(m.labels for m in messages[1:]).to_pandas()
        return DbscanOutcome(
            n_clusters=int(summary.n_clusters),
            sizes=tuple(int(s) for s in summary.sizes),
            n_noise=int(summary.n_noise),
            earth_radius_m=summary.earth_radius_m,
            dataset_version=int(summary.dataset_version),
            labels=labels,
        )

    def within(
        self,
        name: str,
        *,
        bbox: Sequence[float] | None = None,
        polygon: Any = None,
        columns: str | Sequence[str] | None = (),
        where: Any = None,
        as_arrow: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """The points of dataset ``name`` inside a box or a polygon, in row order.

        Parameters
        ----------
        bbox : (min_lat, min_lon, max_lat, max_lon), degrees, optional
            Bounds included; ``min_lon > max_lon`` crosses the antimeridian.
        polygon : optional
            A GeoJSON Polygon or MultiPolygon (a dict or its text), WKB bytes, or a
            shapely geometry; edges are great-circle arcs and the boundary is inside.
            Give ``bbox`` or ``polygon``.
        columns : str or list of str
            Attribute columns to add after id, lat and lon.
        where : list of tuples, optional
            Return only the points this attribute filter selects too (see :meth:`knn`).
        as_arrow : bool
            Return a pyarrow Table.
        """
        if (bbox is None) == (polygon is None):
            raise TypeError("within() needs bbox= or polygon= (one of the two)")
        request = pb.WithinRequest(
            dataset=name, columns=_column_list(columns), where=filter_message(where)
        )
        set_area(request, bbox=bbox, polygon=polygon)
        table = self._arrow("Within", request)
        return table if as_arrow else table.to_pandas()


def connect(
    target: str | None = None,
    *,
    timeout_s: float | None = None,
    tls: bool = False,
    tls_ca: Pem | None = None,
    tls_cert: Pem | None = None,
    tls_key: Pem | None = None,
    token: str | None = None,
    server_name: str | None = None,
    **server_settings: Any,
) -> Client:
    """A client for ``target`` (``host:port``).

    ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``, ``token`` and ``server_name`` are
    the connection options of :class:`Client`. With no target, an in-process server
    starts on a free loopback port (CPU backend unless ``backend=`` says otherwise, data
    kept in a temporary directory unless ``data_dir=`` is given) and stops when the
    client is closed.
    """
    if target is not None:
        return Client(
            target,
            timeout_s=timeout_s,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            token=token,
            server_name=server_name,
        )
    from geonear.service.server import create_server
    from geonear.service.settings import ServerSettings

    tmp = None
    if "data_dir" not in server_settings:
        tmp = tempfile.TemporaryDirectory(prefix="geonear-")
        server_settings["data_dir"] = tmp.name
    server_settings.setdefault("backend", "cpu")
    settings = ServerSettings(host="127.0.0.1", port=0, **server_settings)
    server, port, _ = create_server(settings)
    server.start()
    client = Client(
        f"127.0.0.1:{port}",
        timeout_s=timeout_s,
        tls=tls,
        tls_ca=tls_ca,
        tls_cert=tls_cert,
        tls_key=tls_key,
        token=token,
        server_name=server_name,
    )

    def stop() -> None:
        server.stop(grace=None)
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.cleanup()

    client._on_close.append(stop)
    client.in_process = True
    return client
