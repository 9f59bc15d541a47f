"""Server settings: flags of ``geonear serve`` and ``GEONEAR_*`` environment variables.

Every setting has a default, so ``geonear serve`` runs with none. Environment variables
use the setting's name in capitals with the ``GEONEAR_`` prefix, e.g. ``GEONEAR_PORT``.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from geonear.geometry import EARTH_RADIUS_M


def physical_memory_bytes() -> int:
    """Physical memory of the host, bytes (0 where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class Limits(BaseSettings):
    """Admission limits; a request beyond one is refused with RESOURCE_EXHAUSTED.

    Every refusal names the limit and the environment variable that raises it.
    """

    model_config = SettingsConfigDict(env_prefix="GEONEAR_", extra="ignore")

    max_k: int = Field(10_000, ge=1, description="largest k of a KNN or k-means query")
    max_matrix_cells: int = Field(
        2_000_000_000, ge=1, description="largest rows x cols of a distance matrix"
    )
    max_upload_rows: int = Field(
        2_000_000_000, ge=1, description="largest number of rows in one upload"
    )
    # At least gRPC's default of 4 MiB: results stream in 1 MiB batches and 2 MiB tiles.
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=4 * 1024 * 1024, description="largest gRPC message, bytes"
    )
    max_query_points: int = Field(
        2_000_000, ge=1, description="largest number of query points in one request"
    )
    # Each admitted call holds a server thread while it runs or waits for its batch, so
    # the cap is also the thread count; 512 lets a 256-client load batch fully.
    max_concurrent_rpcs: int = Field(
        512, ge=1, description="calls running at once; health checks are not counted"
    )
    max_dataset_host_bytes: int = Field(
        0,
        ge=0,
        description="host memory all datasets together may hold, bytes; "
        "0: three quarters of physical memory",
    )
    max_dataset_device_bytes: int = Field(
        0,
        ge=0,
        description="device memory all datasets together may hold, bytes; "
        "0: no limit but the device's own",
    )
    max_result_rows: int = Field(
        0,
        ge=0,
        description="most result rows of one Knn, Radius, join, count or KMeans labels answer; "
        "0: sized to the host (physical memory / 1200 bytes, 1M to 500M)",
    )
    # As the analytics layer's default: 1M points with 64 neighbours each, about 1.6 GB
    # of links at the peak of one run.
    max_dbscan_pairs: int = Field(
        1 << 26,
        ge=1,
        description="most (point, neighbour) pairs within eps_m of one Dbscan call",
    )

    def dataset_host_bytes(self) -> int:
        """The host budget in force: the setting, or 3/4 of physical memory for 0."""
        if self.max_dataset_host_bytes:
            return self.max_dataset_host_bytes
        return physical_memory_bytes() * 3 // 4

    def result_rows(self) -> int:
        """The result-row cap in force: the setting, or one sized to the host for 0."""
        if self.max_result_rows:
            return self.max_result_rows
        return default_result_rows(physical_memory_bytes())


#: Bytes one neighbour result row (query_index, rank, id, distance_m) costs where a whole
#: answer is held at once, measured: 60-75 at the Python client (the messages, the table,
#: a DataFrame of it), 110-140 on the server before answers were made in slices
#: (candidates, exact distances, sort order, Arrow table, IPC and protobuf copies).
#: 150 covers either, and some attribute columns.
RESULT_ROW_BYTES = 150
#: One answer may take an eighth of memory: other calls, their clients (in the same
#: process for ``geonear.connect()``) and the datasets need the rest.
RESULT_MEMORY_SHARE = 8
#: The host-sized cap stays within these: 1M rows answers 100k queries at k=10 on the
#: smallest host; 500M rows (75 GB held at a client) is more than any one call should
#: carry, whatever the host.
RESULT_ROWS_FLOOR = 1_000_000
RESULT_ROWS_CEILING = 500_000_000


def default_result_rows(memory_bytes: int) -> int:
    """The result-row cap of a host with ``memory_bytes`` of physical memory (16 GiB:
    14.3M rows)."""
    sized = memory_bytes // (RESULT_ROW_BYTES * RESULT_MEMORY_SHARE)
    return int(min(RESULT_ROWS_CEILING, max(RESULT_ROWS_FLOOR, sized)))


class ServerSettings(BaseSettings):
    """Everything ``geonear serve`` is configured with."""

    model_config = SettingsConfigDict(env_prefix="GEONEAR_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 for all")
    port: int = Field(50051, ge=0, le=65535, description="port; 0 picks a free one")
    data_dir: Path | None = Field(
        Path("geonear-data"), description="where dataset versions persist; None: memory only"
    )
    backend: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto uses the GPU when one works, else the CPU"
    )
    engine: str | None = Field(
        None, description="engine name overriding the backend's (e.g. sklearn, numpy-brute)"
    )
    earth_radius_m: float = Field(EARTH_RADIUS_M, gt=0, description="sphere radius, metres")
    max_workers: int = Field(16, ge=1, description="threads serving RPCs")
    demo: bool = Field(False, description="load the bundled airports and cities at start")
    # -- GPU memory (service/engines/gpu_memory.py) -----------------------------------
    gpu_pool_size_bytes: int | None = Field(
        None,
        ge=0,
        description="RMM/CuPy pool reserved at start, also its limit; None: half the free "
        "memory, growing",
    )
    managed_memory: bool = Field(
        False, description="managed (unified) memory pool for sets larger than the card; slower"
    )
    # -- scale-out -------------------------------------------------------------------------
    processes: int = Field(
        1,
        ge=1,
        description="worker processes on one port (SO_REUSEPORT), each holding every "
        "dataset; datasets are read-only while more than one serves",
    )
    dask_scheduler: str | None = Field(
        None, description="address of a Dask scheduler to partition datasets over"
    )
    dask_local_workers: int | None = Field(
        None, ge=1, description="start a local Dask cluster of this many workers"
    )
    # -- dynamic batching (service/batching.py) -----------------------------------------
    batching: bool = Field(
        True, description="coalesce concurrent KNN/radius requests into one engine call"
    )
    batch_max_points: int = Field(8192, ge=1, description="most query points in one batch")
    batch_max_delay_us: int = Field(
        0, ge=0, description="wait for more requests after the first, µs; 0: take what is queued"
    )
    limits: Limits = Field(default_factory=lambda: Limits())
    # -- fairness (service/admission.py) ----------------------------------------------
    # A client decides how long its upload stream stays open, so uploads get a share of
    # max_concurrent_rpcs of their own: streams left open cannot keep queries out.
    max_concurrent_uploads: int = Field(
        0,
        ge=0,
        description="uploads running at once, within max_concurrent_rpcs and below it; "
        "0: a quarter of max_concurrent_rpcs (at least 1)",
    )
    upload_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="an upload that sends no message for this long is ended, nothing stored",
    )
    # -- security ----------------------------------------------------------------------
    tls_cert: Path | None = Field(None, description="PEM certificate chain of the server")
    tls_key: Path | None = Field(None, description="PEM private key of the server")
    tls_client_ca: Path | None = Field(
        None, description="PEM CA bundle; when set, clients must present a certificate it signed"
    )
    auth_tokens: Path | None = Field(
        None, description="file of bearer tokens and their scopes (see geonear.service.auth)"
    )
    # -- observability and lifecycle ---------------------------------------------------
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port on the same host; None: off"
    )
    log_requests: bool = Field(True, description="one log line per request (geonear.requests)")
    shutdown_grace_s: float = Field(
        5.0, ge=0, description="seconds in-flight calls get to finish at shutdown"
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        return self

    @model_validator(mode="after")
    def _uploads_leave_slots_for_queries(self) -> ServerSettings:
        cap = self.limits.max_concurrent_rpcs
        if self.max_concurrent_uploads and self.max_concurrent_uploads >= cap:
            raise ValueError(
                f"max_concurrent_uploads={self.max_concurrent_uploads} must be below "
                f"max_concurrent_rpcs={cap}, so that queries keep slots of their own; "
                "0 gives uploads a quarter of them"
            )
        return self

    def upload_slots(self) -> int:
        """How many of the ``max_concurrent_rpcs`` slots uploads may hold at once."""
        if self.max_concurrent_uploads:
            return self.max_concurrent_uploads
        return max(1, self.limits.max_concurrent_rpcs // 4)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return self.host == "localhost"
