"""Domain errors of the service. The servicer maps each to its gRPC status code.

The domain layer knows nothing of gRPC: each error names its status by the code's
name, and its message says what to change.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors the service reports to callers."""

    status = "INTERNAL"


class InvalidInput(ServiceError):
    """Bad coordinates, schema, k, names, or bytes."""

    status = "INVALID_ARGUMENT"


class DatasetNotFound(ServiceError):
    status = "NOT_FOUND"


class DatasetExists(ServiceError):
    status = "ALREADY_EXISTS"


class Precondition(ServiceError):
    """The request does not fit the dataset's state (e.g. append with another schema)."""

    status = "FAILED_PRECONDITION"


class LimitExceeded(ServiceError):
    """A server limit; the message names the limit and the setting that raises it."""

    status = "RESOURCE_EXHAUSTED"


class Cancelled(ServiceError):
    """The caller went away or its deadline passed while work was running."""

    status = "CANCELLED"
