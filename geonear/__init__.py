"""geonear: geospatial nearest-neighbour analytics over gRPC.

``geonear.connect("host:port")`` returns a :class:`Client`; ``geonear.connect()`` with
no target starts an in-process server on a free port (handy in notebooks).
"""

from __future__ import annotations

from geonear._version import __version__
from geonear.clients.client import Client, connect
from geonear.clients.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    GeoNearError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "AlreadyExists",
    "Client",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GeoNearError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "__version__",
    "connect",
]
