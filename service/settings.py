"""Server settings: flags of ``geonear serve`` and ``GEONEAR_*`` environment variables.

Every setting has a default, so ``geonear serve`` runs with none. Environment variables
use the setting's name in capitals with the ``GEONEAR_`` prefix, e.g. ``GEONEAR_PORT``.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from geonear.service.geometry import EARTH_RADIUS_M


class Limits(BaseSettings):
    """Admission limits; a request beyond one is refused with RESOURCE_EXHAUSTED."""

    model_config = SettingsConfigDict(env_prefix="GEONEAR_", extra="ignore")

    max_k: int = Field(10_000, ge=1, description="largest k of a KNN query")
    max_matrix_cells: int = Field(
        2_000_000_000, ge=1, description="largest rows x cols of a distance matrix"
    )
    max_upload_rows: int = Field(
        2_000_000_000, ge=1, description="largest number of rows in one upload"
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024, description="largest gRPC message, bytes"
    )
    max_query_points: int = Field(
        2_000_000, ge=1, description="largest number of query points in one request"
    )


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
    limits: Limits = Field(default_factory=lambda: Limits())

    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"
