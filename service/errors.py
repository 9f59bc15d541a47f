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


#: Most bytes of a status message as UTF-8. gRPC sends the message in a trailer,
#: percent-encoding every byte outside ASCII, and clients drop a call whose headers pass
#: 8 KiB (at random) or 16 KiB: a message quoting a long user string must be cut.
MAX_STATUS_MESSAGE_BYTES = 1500


def status_message(text: str) -> str:
    """``text`` as a status message: cut, and marked so, beyond MAX_STATUS_MESSAGE_BYTES."""
    encoded = text.encode("utf-8", errors="replace")
    if len(encoded) <= MAX_STATUS_MESSAGE_BYTES:
        return text
    kept = encoded[: MAX_STATUS_MESSAGE_BYTES - 40].decode("utf-8", errors="ignore")
    return f"{kept} ... (message cut at {len(kept)} of {len(text)} characters)"
