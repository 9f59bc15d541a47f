"""The service's errors: one tree, mapped to gRPC statuses in one place.

The domain layer knows nothing of gRPC: each error names its status code by the code's
name and a machine-readable ``reason``; the interceptor (:mod:`geonear.service.interceptor`)
is the one seam that turns any of them into the call's status, with the reason in a
``google.rpc.ErrorInfo`` detail (domain ``geonear``) and, for the errors worth retrying,
a ``google.rpc.RetryInfo`` with the delay to wait. The message says what to change::

    ServiceError                    INTERNAL             INTERNAL
    ├── InvalidInput                INVALID_ARGUMENT     INVALID_ARGUMENT
    │   └── BadArrow                                     BAD_ARROW
    ├── NotFound                    NOT_FOUND
    │   ├── DatasetNotFound                              DATASET_NOT_FOUND
    │   └── ColumnNotFound                               COLUMN_NOT_FOUND
    ├── DatasetExists               ALREADY_EXISTS       DATASET_EXISTS
    ├── Unauthenticated             UNAUTHENTICATED      UNAUTHENTICATED
    ├── PermissionDenied            PERMISSION_DENIED    PERMISSION_DENIED
    ├── Precondition                FAILED_PRECONDITION  FAILED_PRECONDITION
    │   └── EngineUnavailable                            ENGINE_UNAVAILABLE
    ├── Unsupported                 UNIMPLEMENTED        UNSUPPORTED_BY_ENGINE
    ├── LimitExceeded               RESOURCE_EXHAUSTED   LIMIT_EXCEEDED
    │   ├── ResultTooLarge                               RESULT_TOO_LARGE
    │   ├── CompactTooLarge                              COMPACT_TOO_LARGE
    │   ├── OutOfMemory                                  OUT_OF_MEMORY
    │   └── ServerBusy (retry)                           SERVER_BUSY
    ├── Cancelled                   CANCELLED            CANCELLED
    ├── DeadlineExceeded            DEADLINE_EXCEEDED    DEADLINE_EXCEEDED
    │   ├── QueueDeadlineExceeded                        QUEUE_DEADLINE_EXCEEDED
    │   └── UploadIdle                                   UPLOAD_IDLE
    └── Unavailable (retry)         UNAVAILABLE          UNAVAILABLE
        ├── WorkerLost                                   WORKER_LOST
        └── DeviceLost                                   DEVICE_LOST

``Cancelled`` is answered DEADLINE_EXCEEDED when the call's deadline has passed; an
engine's ``DeviceLost`` also stops the server so that it is restarted. Errors from
outside the tree are mapped at the same seam: the wire codec's ``WireError`` is
``BadArrow``, a ``MemoryError`` is ``OutOfMemory``, a ``NotImplementedError`` is
``Unsupported``, and anything else is INTERNAL with an error id that the
``geonear.errors`` log line (with the traceback) carries too, never UNKNOWN with a
Python class name.
"""

from __future__ import annotations

from typing import ClassVar


class ServiceError(Exception):
    """Base of the errors the service reports to callers.

    ``metadata`` (string pairs, e.g. the setting that raises a limit) travels in the
    ErrorInfo detail beside the reason.
    """

    status: ClassVar[str] = "INTERNAL"
    reason: ClassVar[str] = "INTERNAL"
    #: Seconds a client should wait before trying the same call again; None: do not retry.
    retry_after_s: ClassVar[float | None] = None

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.metadata = metadata


class InvalidInput(ServiceError):
    """Bad coordinates, schema, k, names, filters, areas or bytes."""

    status = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class BadArrow(InvalidInput):
    """Bytes that are not the Arrow IPC stream the request needs (the wire codec's
    ``WireError``)."""

    reason = "BAD_ARROW"


class NotFound(ServiceError):
    status = "NOT_FOUND"
    reason = "NOT_FOUND"


class DatasetNotFound(NotFound):
    reason = "DATASET_NOT_FOUND"


class ColumnNotFound(NotFound):
    """A column asked for (attributes, a filter's, a weight) is not in the dataset."""

    reason = "COLUMN_NOT_FOUND"


class DatasetExists(ServiceError):
    status = "ALREADY_EXISTS"
    reason = "DATASET_EXISTS"


class Unauthenticated(ServiceError):
    """No bearer token, or one the server does not know (:mod:`geonear.service.auth`)."""

    status = "UNAUTHENTICATED"
    reason = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    """The token's scope does not allow the call."""

    status = "PERMISSION_DENIED"
    reason = "PERMISSION_DENIED"


class Precondition(ServiceError):
    """The request does not fit the dataset's state (e.g. append with another schema)."""

    status = "FAILED_PRECONDITION"
    reason = "FAILED_PRECONDITION"


class EngineUnavailable(Precondition):
    """The engine cannot run here; the message says why and what to install."""

    reason = "ENGINE_UNAVAILABLE"


class Unsupported(ServiceError):
    """The dataset's engine lacks the capability the query needs (its spec says so)."""

    status = "UNIMPLEMENTED"
    reason = "UNSUPPORTED_BY_ENGINE"


class LimitExceeded(ServiceError):
    """A server limit; the message names the limit and the setting that raises it."""

    status = "RESOURCE_EXHAUSTED"
    reason = "LIMIT_EXCEEDED"


class ResultTooLarge(LimitExceeded):
    """The answer would pass ``max_result_rows``: ask for less, or in parts."""

    reason = "RESULT_TOO_LARGE"


class CompactTooLarge(LimitExceeded):
    """A compact (unary) answer would pass its bound: call the streaming RPC."""

    reason = "COMPACT_TOO_LARGE"


class OutOfMemory(LimitExceeded):
    """Host or device memory ran out for this call; fewer points per call fit."""

    reason = "OUT_OF_MEMORY"


class ServerBusy(LimitExceeded):
    """Every slot is taken (``max_concurrent_rpcs`` or the uploads' share): try again."""

    reason = "SERVER_BUSY"
    retry_after_s = 0.05


class Cancelled(ServiceError):
    """The caller went away or its deadline passed while work was running."""

    status = "CANCELLED"
    reason = "CANCELLED"


class DeadlineExceeded(ServiceError):
    status = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"


class QueueDeadlineExceeded(DeadlineExceeded):
    """The call's deadline passed while it waited for a shared engine call."""

    reason = "QUEUE_DEADLINE_EXCEEDED"


class UploadIdle(DeadlineExceeded):
    """No request message came for ``upload_idle_timeout_s``; the upload was ended."""

    reason = "UPLOAD_IDLE"

    def __init__(self, idle_timeout_s: float) -> None:
        super().__init__(
            f"no Upload message came for upload_idle_timeout_s={idle_timeout_s:g} s "
            "(setting GEONEAR_UPLOAD_IDLE_TIMEOUT_S): the upload was ended and nothing was "
            "stored; send data more often, or raise the setting",
            setting="GEONEAR_UPLOAD_IDLE_TIMEOUT_S",
        )


class Unavailable(ServiceError):
    status = "UNAVAILABLE"
    reason = "UNAVAILABLE"
    retry_after_s = 1.0


class WorkerLost(Unavailable):
    """A Dask worker holding part of a dataset went away; the next call finds it again."""

    reason = "WORKER_LOST"


class DeviceLost(Unavailable):
    """The device failed in a way no later call in this process can recover from.

    Raised by engines in place of their library's error for a sticky CUDA error (an
    illegal address, a failed launch, a destroyed context, an uncorrectable ECC error):
    the CUDA context is unusable, so every later call would fail too. The server answers
    the call UNAVAILABLE, reports NOT_SERVING and exits with a non-zero status so that
    a supervisor restarts it (``geonear.service.lifecycle``); the new process reloads
    every dataset. Errors a later call may not meet (out of memory, bad input) are not
    this one.
    """

    reason = "DEVICE_LOST"


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
