"""The Python client: ``geonear.connect(...)`` and :class:`Client`.

Calls take and return pandas / pyarrow / NumPy objects; errors raise the
:mod:`geonear.clients.errors` hierarchy with the server's status and message.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa

from geonear._wire import (
    compact_to_table,
    messages_to_table,
    points_to_message,
    table_to_messages,
)
from geonear.clients.errors import ResourceExhausted, from_rpc_error
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:50051"
#: Query points per request; larger query sets are split and the results joined.
QUERY_CHUNK = 100_000
#: KNN calls expecting at most this many rows (queries x k), without attribute columns,
#: use the unary KnnCompact RPC: one message each way, no Arrow (the cheapest per call).
COMPACT_ROWS = 4096
#: Radius calls with at most this many queries try RadiusCompact first.
COMPACT_RADIUS_QUERIES = 16
_MODES = {"create": pb.CREATE, "replace": pb.REPLACE, "append": pb.APPEND}
_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class KMeansOutcome:
    """Spherical k-means result: centroids (cluster, lat, lon, size), inertia, labels."""

    centroids: pd.DataFrame
    inertia_m2: float
    n_iter: int
    earth_radius_m: float
    labels: pd.DataFrame | None = None


def _as_points(lat: Any, lon: Any) -> tuple[np.ndarray, np.ndarray]:
    lat_a = np.atleast_1d(np.asarray(lat, dtype=np.float64))
    lon_a = np.atleast_1d(np.asarray(lon, dtype=np.float64))
    if lat_a.shape != lon_a.shape or lat_a.ndim != 1:
        raise ValueError(
            f"lat and lon must be 1-D of one length, got {lat_a.shape} and {lon_a.shape}"
        )
    return lat_a, lon_a


def _split_ids(ids: Iterable[Any]) -> tuple[list[int], list[str]]:
    """Ids as the (int_ids, string_ids) pair of the contract; one of the two is empty."""
    values = list(ids)
    if values and isinstance(values[0], str):
        return [], [str(v) for v in values]
    return [int(v) for v in values], []


def _as_table(data: Any) -> Iterator[pa.RecordBatch] | pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatchReader):
        return iter(data)
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pd.DataFrame):
        return pa.Table.from_pandas(data, preserve_index=False)
    raise TypeError(
        f"upload takes a pandas DataFrame, pyarrow Table, RecordBatch or "
        f"RecordBatchReader, got {type(data).__name__}"
    )


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
        self.target = target
        self.timeout_s = timeout_s
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
        self._on_close: list[Any] = []

    # -- plumbing ------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()
        for hook in reversed(self._on_close):
            hook()
        self._on_close.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    def _stream(self, method: str, request: Any, timeout_s: float | None = None) -> list[Any]:
        try:
            return list(getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc

    # -- datasets ------------------------------------------------------------------------
    def upload(
        self,
        name: str,
        data: Any,
        *,
        lat: str = "lat",
        lon: str = "lon",
        id: str = "id",
        mode: str = "create",
        timeout_s: float | None = None,
    ) -> pb.DatasetInfo:
        """Upload a DataFrame, Table or RecordBatchReader as dataset ``name``.

        ``mode`` is create (fails if the name exists), replace or append. Returns the
        new version's description.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        header = pb.UploadHeader(
            dataset=name, mode=_MODES[mode], lat_column=lat, lon_column=lon, id_column=id
        )
        source = _as_table(data)

        def requests() -> Iterator[pb.UploadRequest]:
            yield pb.UploadRequest(header=header)
            if isinstance(source, pa.Table):
                for message in table_to_messages(source):
                    yield pb.UploadRequest(data=message)
                return
            first = True
            for batch in source:
                for message in table_to_messages(pa.Table.from_batches([batch])):
                    if not first:
                        message.schema = b""
                    first = False
                    yield pb.UploadRequest(data=message)

        try:
            response = self._stub.Upload(requests(), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        return response.dataset

    def datasets(self) -> list[pb.DatasetInfo]:
        return list(self._call("ListDatasets", pb.ListDatasetsRequest()).datasets)

    def info(self, name: str) -> pb.DatasetInfo:
        return self._call("GetDataset", pb.GetDatasetRequest(dataset=name))

    def drop(self, name: str) -> int:
        """Drop dataset ``name``; returns the version that was dropped."""
        return int(self._call("DropDataset", pb.DropDatasetRequest(dataset=name)).version)

    def delete(self, name: str, ids: Iterable[int] | Iterable[str]) -> pb.DeleteRowsResponse:
        """Delete the rows with these ids; returns the new version and the counts."""
        int_ids, string_ids = _split_ids(ids)
        request = pb.DeleteRowsRequest(dataset=name, int_ids=int_ids, string_ids=string_ids)
        return self._call("DeleteRows", request)

    def server_info(self) -> pb.ServerInfoResponse:
        return self._call("ServerInfo", pb.ServerInfoRequest())

    # -- queries -------------------------------------------------------------------------
    def _neighbour_query(
        self,
        method: str,
        make_request: Any,
        lat: Any,
        lon: Any,
        as_arrow: bool,
        compact: bool = False,
    ) -> pd.DataFrame | pa.Table:
        lat_a, lon_a = _as_points(lat, lon)
        if compact:
            try:
                found = self._call(
                    method + "Compact", make_request(points_to_message(lat_a, lon_a))
                )
            except ResourceExhausted:
                pass  # more rows than a compact answer holds: stream them instead
            else:
                table = compact_to_table(found)
                return table if as_arrow else table.to_pandas()
        parts = []
        for start in range(0, max(1, lat_a.shape[0]), QUERY_CHUNK):
            points = points_to_message(
                lat_a[start : start + QUERY_CHUNK], lon_a[start : start + QUERY_CHUNK]
            )
            table = messages_to_table(self._stream(method, make_request(points)))
            if start:
                offset = pa.compute.add(table.column("query_index"), start)
                table = table.set_column(0, "query_index", offset)
            parts.append(table)
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        return table if as_arrow else table.to_pandas()

    def knn(
        self,
        name: str,
        lat: Any,
        lon: Any,
        k: int = 10,
        *,
        max_distance_m: float | None = None,
        columns: Sequence[str] = (),
        as_arrow: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """The k nearest points of ``name`` to each (lat, lon) query, degrees.

        Returns columns query_index, rank, id, distance_m (great-circle metres), then
        the requested attribute ``columns``; nearest first per query.
        """

        def request(points: pb.Points) -> pb.KnnRequest:
            return pb.KnnRequest(
                dataset=name,
                queries=points,
                k=k,
                max_distance_m=max_distance_m,
                columns=list(columns),
            )

        n_queries = np.size(lat)
        compact = not columns and n_queries * k <= COMPACT_ROWS
        return self._neighbour_query("Knn", request, lat, lon, as_arrow, compact)

    def radius(
        self,
        name: str,
        lat: Any,
        lon: Any,
        radius_m: float,
        *,
        columns: Sequence[str] = (),
        as_arrow: bool = False,
    ) -> pd.DataFrame | pa.Table:
        """Every point of ``name`` within ``radius_m`` metres of each query; as ``knn``."""

        def request(points: pb.Points) -> pb.RadiusRequest:
            return pb.RadiusRequest(
                dataset=name, queries=points, radius_m=radius_m, columns=list(columns)
            )

        compact = not columns and np.size(lat) <= COMPACT_RADIUS_QUERIES
        return self._neighbour_query("Radius", request, lat, lon, as_arrow, compact)

    def distance_matrix(
        self,
        lat: Any,
        lon: Any,
        name: str | None = None,
        lat2: Any = None,
        lon2: Any = None,
        *,
        ids: Sequence[int] | Sequence[str] | None = None,
        dtype: str = "float64",
    ) -> np.ndarray:
        """Great-circle metres from each (lat, lon) (rows) to a dataset or a second set.

        Columns are the points of dataset ``name`` (in row order, or the rows of ``ids``
        in that order), or the points (``lat2``, ``lon2``). ``dtype`` float64 is exact;
        float32 halves the bytes and carries up to about 4 m error at long range.
        """
        if dtype not in ("float64", "float32"):
            raise ValueError(f"dtype must be float64 or float32, got {dtype!r}")
        request = pb.DistanceMatrixRequest(
            queries=points_to_message(*_as_points(lat, lon)),
            dtype=pb.FLOAT64 if dtype == "float64" else pb.FLOAT32,
        )
        if name is not None:
            request.dataset = name
            if ids is not None:
                int_ids, string_ids = _split_ids(ids)
                request.ids.int_ids.extend(int_ids)
                request.ids.string_ids.extend(string_ids)
        elif lat2 is not None and lon2 is not None:
            request.targets.CopyFrom(points_to_message(*_as_points(lat2, lon2)))
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
            n_rows = np.atleast_1d(np.asarray(lat)).shape[0]
            out = np.empty((n_rows, 0), dtype=dtype)
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
        return_labels: bool = False,
    ) -> KMeansOutcome:
        """Spherical k-means of dataset ``name``; ``weights`` names a numeric column."""
        request = pb.KMeansRequest(
            dataset=name,
            k=k,
            seed=seed,
            n_init=n_init,
            max_iter=max_iter,
            tol=tol,
            weight_column=weights or "",
            return_labels=return_labels,
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
    return client
