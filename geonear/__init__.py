"""geonear: geospatial nearest-neighbour analytics over gRPC.

``geonear.connect("host:port")`` returns a :class:`Client`; ``geonear.connect()`` with
no target starts an in-process server on a free port (handy in notebooks).

The client and its errors are imported on first use, so that the server, which imports
modules of this package (the wire codec, the sphere's geometry), never loads the client
or pandas.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from geonear._version import __version__

if TYPE_CHECKING:
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
#: Public name -> the module that defines it, imported on first use.
_PUBLIC = {
    name: "geonear.clients.client" if name in ("Client", "connect") else "geonear.clients.errors"
    for name in __all__
    if name != "__version__"
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'geonear' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
