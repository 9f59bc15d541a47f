"""What a load test sends: the scenarios, their RPCs and the pool of prepared requests.

Requests are built and serialized once, in the parent process, before any clock starts:
a pool of distinct requests (random query points) that every worker cycles through, so
the load generator spends its time on gRPC rather than on NumPy or protobuf, and every
target of a ``--compare`` run receives the same queries.

Scenarios
---------
ping
    grpc.health.v1 Health/Check: the cheapest RPC the server answers, so its rate is the
    ceiling of the server and load generator together.
knn, radius
    ``--batch`` uniform query points per request, ``-k`` neighbours or ``--radius-m``.
matrix
    distances from ``--batch`` query points to the dataset (or to ``--matrix-targets``
    inline points when that is set).
kmeans
    spherical k-means of the dataset with ``-k`` clusters (seed varies per request).
upload
    replaces one of eight scratch datasets with ``--batch`` uniform points.
mixed
    70% knn, 20% radius, 10% matrix, drawn at random per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
from grpc_health.v1 import health_pb2

from geonear.loaders import uniform_points
from geonear.loadtest.connection import Connection
from geonear.v1 import geonear_pb2 as pb
from geonear.wire import (
    COMPACT_RADIUS_QUERIES,
    COMPACT_ROWS,
    points_to_message,
    table_to_messages,
)

SCENARIOS = ("knn", "radius", "matrix", "kmeans", "upload", "mixed", "ping")
#: Scenarios that query a dataset (and so may need ``--create-dataset``).
NEEDS_DATASET = frozenset({"knn", "radius", "matrix", "kmeans", "mixed"})
#: Share of each RPC in the mixed scenario.
MIXED_WEIGHTS = {"knn": 0.7, "radius": 0.2, "matrix": 0.1}
#: Scratch datasets the upload scenario replaces in turn; dropped after the run.
UPLOAD_SLOTS = 8
#: At most this many distinct requests, and about this many bytes of them, per pool.
POOL_REQUESTS = 1024
POOL_BYTES = 64 * 1024 * 1024

_SERVICE = "/geonear.v1.GeoNear/"


def _stream_rows(messages: Sequence[Any]) -> int:
    return sum(m.row_count for m in messages)


def _compact_rows(response: Any) -> int:
    return len(response.distance_m)


def _matrix_cells(tiles: Sequence[Any]) -> int:
    return sum(t.row_count * t.col_count for t in tiles)


def _centroids(messages: Sequence[Any]) -> int:
    return messages[0].summary.centroids.row_count if messages else 0


def _uploaded(response: Any) -> int:
    return response.rows_received


def _serving(response: Any) -> int:
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        # Counted as an error by the runner, under this name.
        raise NotServing(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
    return 0


class NotServing(Exception):
    """A health check that answered, but with a status other than SERVING."""


@dataclass(frozen=True)
class Rpc:
    """One RPC a scenario calls: its path, shape, response type and what counts as rows.

    ``rows`` maps the response (a list of messages for server-streaming RPCs) to the
    rows returned: result rows for knn/radius, distances (cells) for matrix, centroids
    for kmeans, rows stored for upload, none for ping.
    """

    path: str
    cardinality: str  # unary_unary, unary_stream or stream_unary
    response: Any
    rows: Callable[[Any], int]


RPCS: dict[str, Rpc] = {
    "knn": Rpc(_SERVICE + "Knn", "unary_stream", pb.ArrowData, _stream_rows),
    "knn-compact": Rpc(_SERVICE + "KnnCompact", "unary_unary", pb.CompactNeighbours, _compact_rows),
    "radius-compact": Rpc(
        _SERVICE + "RadiusCompact", "unary_unary", pb.CompactNeighbours, _compact_rows
    ),
    "radius": Rpc(_SERVICE + "Radius", "unary_stream", pb.ArrowData, _stream_rows),
    "matrix": Rpc(_SERVICE + "DistanceMatrix", "unary_stream", pb.MatrixTile, _matrix_cells),
    "kmeans": Rpc(_SERVICE + "KMeans", "unary_stream", pb.KMeansResponse, _centroids),
    "upload": Rpc(_SERVICE + "Upload", "stream_unary", pb.UploadResponse, _uploaded),
    "ping": Rpc(
        "/grpc.health.v1.Health/Check", "unary_unary", health_pb2.HealthCheckResponse, _serving
    ),
}

#: A prepared request: the RPC's name and its serialized message (a tuple of them for
#: client-streaming RPCs).
Request = tuple[str, bytes | tuple[bytes, ...]]


@dataclass(frozen=True)
class ScenarioConfig:
    """The parameters of what is sent (not of how fast: that is the runner's)."""

    scenario: str = "knn"
    dataset: str = "loadtest"
    batch: int = 1
    k: int = 10
    radius_m: float = 5_000.0
    matrix_targets: int = 0
    kmeans_max_iter: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(
                f"unknown scenario {self.scenario!r}; choose one of {', '.join(SCENARIOS)}"
            )
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.k < 1:
            raise ValueError(f"-k must be >= 1, got {self.k}")
        if self.radius_m < 0:
            raise ValueError(f"--radius-m must be >= 0, got {self.radius_m}")

    @property
    def upload_prefix(self) -> str:
        return f"{self.dataset}-upload"

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "dataset": self.dataset,
            "batch": self.batch,
            "k": self.k,
            "radius_m": self.radius_m,
            "matrix_targets": self.matrix_targets,
            "kmeans_max_iter": self.kmeans_max_iter,
            "seed": self.seed,
        }


def _request(
    config: ScenarioConfig,
    rpc: str,
    i: int,
    lat: np.ndarray,
    lon: np.ndarray,
    targets: pb.Points | None,
) -> Request:
    if rpc == "ping":
        return rpc, health_pb2.HealthCheckRequest(service="").SerializeToString()
    if rpc == "kmeans":
        message: Any = pb.KMeansRequest(
            dataset=config.dataset, k=config.k, seed=i, n_init=1, max_iter=config.kmeans_max_iter
        )
        return rpc, message.SerializeToString()
    if rpc == "upload":
        ids = np.arange(lat.shape[0], dtype=np.int64)
        table = pa.table({"id": ids, "lat": lat, "lon": lon})
        header = pb.UploadHeader(
            dataset=f"{config.upload_prefix}-{i % UPLOAD_SLOTS}", mode=pb.REPLACE
        )
        stream = [pb.UploadRequest(header=header)]
        stream += [pb.UploadRequest(data=m) for m in table_to_messages(table)]
        return rpc, tuple(m.SerializeToString() for m in stream)
    points = points_to_message(lat, lon)
    # Small queries take the compact unary RPCs, by the Python client's own rule.
    if rpc == "knn":
        message = pb.KnnRequest(dataset=config.dataset, queries=points, k=config.k)
        if lat.shape[0] * config.k <= COMPACT_ROWS:
            rpc = "knn-compact"
    elif rpc == "radius":
        message = pb.RadiusRequest(dataset=config.dataset, queries=points, radius_m=config.radius_m)
        if lat.shape[0] <= COMPACT_RADIUS_QUERIES:
            rpc = "radius-compact"
    elif targets is not None:
        message = pb.DistanceMatrixRequest(queries=points, targets=targets)
    else:
        message = pb.DistanceMatrixRequest(queries=points, dataset=config.dataset)
    return rpc, message.SerializeToString()


def build_pool(config: ScenarioConfig, size: int = POOL_REQUESTS) -> list[Request]:
    """Distinct prepared requests for ``config``, at most ``size`` of them (fewer when big).

    Query points are uniform on the sphere, seeded by ``config.seed``, so two runs with
    the same seed send the same queries.
    """
    point_bytes = 24 * config.batch + 64
    size = max(1, min(size, POOL_BYTES // point_bytes))
    if config.scenario in ("ping", "kmeans"):
        # Every ping is the same; k-means requests differ by their seed only.
        size = 1 if config.scenario == "ping" else min(size, 64)
    rng = np.random.default_rng(config.seed)
    if config.scenario == "mixed":
        names = list(MIXED_WEIGHTS)
        weights = np.array(list(MIXED_WEIGHTS.values()))
        rpcs = [names[j] for j in rng.choice(len(names), size=size, p=weights / weights.sum())]
    else:
        rpcs = [config.scenario] * size
    targets = None
    if config.matrix_targets > 0:
        t_lat, t_lon = uniform_points(config.matrix_targets, seed=config.seed + 1)
        targets = points_to_message(t_lat, t_lon)
    lat, lon = uniform_points(config.batch * size, seed=config.seed)
    lat, lon = lat.reshape(size, config.batch), lon.reshape(size, config.batch)
    return [_request(config, rpc, i, lat[i], lon[i], targets) for i, rpc in enumerate(rpcs)]


# -- before and after a run ------------------------------------------------------------
async def _unary(
    channel: grpc.aio.Channel,
    path: str,
    request: Any,
    response: Any,
    connection: Connection,
    timeout_s: float,
) -> Any:
    call = channel.unary_unary(
        path,
        request_serializer=type(request).SerializeToString,
        response_deserializer=response.FromString,
    )
    return await call(request, timeout=timeout_s, metadata=connection.metadata())


async def _upload_uniform(
    channel: grpc.aio.Channel,
    connection: Connection,
    name: str,
    rows: int,
    seed: int,
    timeout_s: float,
) -> pb.DatasetInfo:
    lat, lon = uniform_points(rows, seed=seed)
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "lat": lat, "lon": lon})

    async def requests() -> AsyncIterator[pb.UploadRequest]:
        yield pb.UploadRequest(header=pb.UploadHeader(dataset=name, mode=pb.CREATE))
        for message in table_to_messages(table):
            yield pb.UploadRequest(data=message)

    call = channel.stream_unary(
        _SERVICE + "Upload",
        request_serializer=pb.UploadRequest.SerializeToString,
        response_deserializer=pb.UploadResponse.FromString,
    )
    response = await call(requests(), timeout=timeout_s, metadata=connection.metadata())
    return response.dataset


@dataclass
class Prepared:
    """What the parent learnt about a target before loading it."""

    server: dict[str, Any] | None
    dataset: dict[str, Any] | None
    warnings: list[str]


class PreparationFailed(Exception):
    """A target refused the calls made before the run (dataset check or creation)."""


async def prepare_target(
    address: str,
    connection: Connection,
    config: ScenarioConfig,
    create_rows: int = 0,
    timeout_s: float = 600.0,
    connect_timeout_s: float = 10.0,
) -> Prepared:
    """Check that ``address`` answers, describe its server and dataset, create it if asked.

    Raises OSError when the server cannot be reached within ``connect_timeout_s``, and
    PreparationFailed (with the status and the server's message) when it refuses.
    """
    try:
        return await _prepare(
            address, connection, config, create_rows, timeout_s, connect_timeout_s
        )
    except grpc.aio.AioRpcError as exc:
        raise PreparationFailed(
            f"{address} refused the preparation of the run: {exc.code().name}: {exc.details()}"
        ) from exc


async def _prepare(
    address: str,
    connection: Connection,
    config: ScenarioConfig,
    create_rows: int,
    timeout_s: float,
    connect_timeout_s: float,
) -> Prepared:
    warnings: list[str] = []
    async with connection.aio_channel(address) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), connect_timeout_s)
        except TimeoutError as exc:
            raise OSError(
                f"cannot reach a server at {address} within {connect_timeout_s:g} s"
            ) from exc
        server: dict[str, Any] | None
        try:
            info = await _unary(
                channel,
                _SERVICE + "ServerInfo",
                pb.ServerInfoRequest(),
                pb.ServerInfoResponse,
                connection,
                30.0,
            )
            server = {
                "version": info.version,
                "backend": info.backend,
                "device": info.device,
                "engine": info.engines[0] if info.engines else "",
            }
        except grpc.aio.AioRpcError as exc:
            server = None
            warnings.append(f"ServerInfo failed at {address}: {exc.code().name} {exc.details()}")
        if config.scenario not in NEEDS_DATASET:
            return Prepared(server, None, warnings)
        try:
            described = await _unary(
                channel,
                _SERVICE + "GetDataset",
                pb.GetDatasetRequest(dataset=config.dataset),
                pb.DatasetInfo,
                connection,
                30.0,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            if create_rows <= 0:
                warnings.append(
                    f"dataset {config.dataset!r} does not exist at {address}: "
                    "every request will fail with NOT_FOUND (add "
                    "--create-dataset N to upload N uniform points first)"
                )
                return Prepared(server, None, warnings)
            described = await _upload_uniform(
                channel, connection, config.dataset, create_rows, config.seed + 2, timeout_s
            )
            warnings.append(
                f"created dataset {config.dataset!r} at {address}: {described.rows} uniform points"
            )
        dataset = {
            "name": described.name,
            "rows": described.rows,
            "version": described.version,
            "engine": described.engine,
        }
        return Prepared(server, dataset, warnings)


async def drop_upload_scratch(address: str, connection: Connection, config: ScenarioConfig) -> int:
    """Drop the upload scenario's scratch datasets; returns how many were dropped."""
    dropped = 0
    async with connection.aio_channel(address) as channel:
        for slot in range(UPLOAD_SLOTS):
            try:
                await _unary(
                    channel,
                    _SERVICE + "DropDataset",
                    pb.DropDatasetRequest(dataset=f"{config.upload_prefix}-{slot}"),
                    pb.DropDatasetResponse,
                    connection,
                    30.0,
                )
                dropped += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
    return dropped
