"""What the client returns for datasets and the server: plain, frozen dataclasses.

The protobuf messages stay inside the client; these read well in a notebook
(``DatasetInfo(name='stores', version=1, rows=3, ...)``) and compare by value.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from geonear.v1 import geonear_pb2 as pb


@dataclass(frozen=True)
class Column:
    """A stored column: its name and Arrow type (``int64``, ``double``, ``string``...)."""

    name: str
    arrow_type: str

    def __repr__(self) -> str:
        return f"Column({self.name!r}, {self.arrow_type!r})"


@dataclass(frozen=True)
class BoundingBox:
    """The smallest latitude/longitude box holding a dataset's points, degrees."""

    min_lat: float
    min_lon: float
    max_lat: float
    max_lon: float


@dataclass(frozen=True)
class DatasetInfo:
    """One version of a dataset, as the server describes it.

    ``host_bytes`` and ``device_bytes`` are the memory this version holds, index
    included (``device_bytes`` is 0 on the CPU backend); ``columns`` are id, lat, lon,
    then the attributes; ``id_type`` is ``int64`` or ``string``.
    """

    name: str
    version: int
    rows: int
    host_bytes: int
    device_bytes: int
    columns: tuple[Column, ...]
    bounding_box: BoundingBox
    engine: str
    id_type: str
    created_unix_s: float

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    @classmethod
    def from_message(cls, message: pb.DatasetInfo) -> DatasetInfo:
        b = message.bounding_box
        return cls(
            name=message.name,
            version=int(message.version),
            rows=int(message.rows),
            host_bytes=int(message.host_bytes),
            device_bytes=int(message.device_bytes),
            columns=tuple(Column(c.name, c.arrow_type) for c in message.columns),
            bounding_box=BoundingBox(b.min_lat, b.min_lon, b.max_lat, b.max_lon),
            engine=message.engine,
            id_type=message.id_type,
            created_unix_s=float(message.created_unix_s),
        )


@dataclass(frozen=True)
class DeleteResult:
    """What a delete did: the new version, rows deleted and ids that matched no row."""

    dataset: DatasetInfo
    rows_deleted: int
    ids_not_found: int

    @classmethod
    def from_message(cls, message: pb.DeleteRowsResponse) -> DeleteResult:
        return cls(
            dataset=DatasetInfo.from_message(message.dataset),
            rows_deleted=int(message.rows_deleted),
            ids_not_found=int(message.ids_not_found),
        )


@dataclass(frozen=True)
class ServerLimits:
    """The server's admission limits; a request beyond one is RESOURCE_EXHAUSTED."""

    max_k: int
    max_matrix_cells: int
    max_upload_rows: int
    max_message_bytes: int
    max_query_points: int
    max_concurrent_rpcs: int
    max_dataset_host_bytes: int
    max_dataset_device_bytes: int
    max_result_rows: int

    def describe(self) -> str:
        """``max_k: 10000; max_matrix_cells: ...``, one line."""
        return "; ".join(f"{f.name}: {getattr(self, f.name)}" for f in fields(self))


@dataclass(frozen=True)
class EngineDescription:
    """One engine the server can run: where it runs and the query kinds it answers.

    ``capabilities`` holds ``knn``, ``radius``, ``matrix``, ``kmeans`` and
    ``spherical-kmeans`` as the engine declares them; joins, counts, filters, areas and
    DBSCAN need what their query needs (a KNN join needs ``knn``, DBSCAN ``radius``).
    """

    name: str
    device_kind: str
    capabilities: tuple[str, ...]
    summary: str

    def can(self, capability: str) -> bool:
        return capability in self.capabilities


@dataclass(frozen=True)
class ServerInfo:
    """The server's version, backend, device, sphere radius, limits and engines.

    ``engines`` names the engines it can run, the one serving queries first, and
    ``engine_descriptions`` says what each answers (``capabilities`` is the serving
    engine's). ``pool_used_bytes``/``pool_total_bytes`` describe the GPU memory pool (0 on
    the CPU backend); ``worker_processes`` is how many processes serve the port and
    ``worker_index`` which one answered.
    """

    version: str
    backend: str
    device: str
    earth_radius_m: float
    limits: ServerLimits
    engines: tuple[str, ...]
    pool_used_bytes: int
    pool_total_bytes: int
    worker_processes: int
    worker_index: int
    engine_descriptions: tuple[EngineDescription, ...] = ()

    @property
    def engine(self) -> str:
        """The engine serving queries."""
        return self.engines[0] if self.engines else ""

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What the serving engine answers (empty from a server too old to say)."""
        for description in self.engine_descriptions:
            if description.name == self.engine:
                return description.capabilities
        return ()

    @classmethod
    def from_message(cls, message: pb.ServerInfoResponse) -> ServerInfo:
        limits: dict[str, Any] = {
            f.name: int(getattr(message.limits, f.name)) for f in fields(ServerLimits)
        }
        return cls(
            version=message.version,
            backend=message.backend,
            device=message.device,
            earth_radius_m=float(message.earth_radius_m),
            limits=ServerLimits(**limits),
            engines=tuple(message.engines),
            pool_used_bytes=int(message.pool_used_bytes),
            pool_total_bytes=int(message.pool_total_bytes),
            worker_processes=int(message.worker_processes),
            worker_index=int(message.worker_index),
            engine_descriptions=tuple(
                EngineDescription(
                    name=e.name,
                    device_kind=e.device_kind,
                    capabilities=tuple(e.capabilities),
                    summary=e.summary,
                )
                for e in message.engine_descriptions
            ),
        )
