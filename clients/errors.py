"""The client's exception hierarchy.

Every error a geonear call raises is a :class:`GeoNearError`; its subclasses mirror the
gRPC status codes the server uses (docs/design.md). Each carries the status ``code`` (a
``grpc.StatusCode``), the server's ``message``, its machine-readable ``reason`` (e.g.
``COMPACT_TOO_LARGE``, ``RESULT_TOO_LARGE``, ``SERVER_BUSY``, ``DATASET_NOT_FOUND``;
docs/errors.md lists them) with its ``metadata`` (e.g. the setting that raises a limit),
and ``retry_after_s``: the delay after which the same call may succeed, or None when
retrying cannot help. The underlying ``grpc.RpcError`` is kept as ``__cause__``.

- :class:`InvalidArgument`: bad coordinates, schema, k, names (fix the request).
- :class:`NotFound`: unknown dataset or column.
- :class:`AlreadyExists`: create over an existing dataset name (use replace/append).
- :class:`FailedPrecondition`: the request does not fit the dataset's state.
- :class:`ResourceExhausted`: a server limit or GPU memory; the message names the limit.
- :class:`Unauthenticated`, :class:`PermissionDenied`: token missing, wrong or too weak.
- :class:`DeadlineExceeded`: the call's deadline passed.
- :class:`Unavailable`: the server cannot be reached.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class GeoNearError(Exception):
    """Base of every geonear client error."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        reason: str = "",
        metadata: dict[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        #: The server's machine-readable reason ("" from a server that gave none).
        self.reason = reason
        self.metadata = dict(metadata or {})
        #: Seconds to wait before the same call may succeed; None: retrying cannot help.
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        """Whether the same call may succeed later (the server said when)."""
        return self.retry_after_s is not None

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(GeoNearError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GeoNearError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(GeoNearError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(GeoNearError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(GeoNearError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(GeoNearError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(GeoNearError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(GeoNearError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(GeoNearError):
    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[GeoNearError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        DeadlineExceeded,
        Unavailable,
    )
}


def from_rpc_error(exc: grpc.RpcError) -> GeoNearError:
    """Translate a grpc.RpcError into the matching GeoNearError (raise it ``from exc``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, GeoNearError)
    reason, metadata, retry_after_s = "", {}, None
    details_sent = _details(exc)
    if code == grpc.StatusCode.UNAVAILABLE and not details_sent:
        retry_after_s = 1.0  # the transport's own: the server is not reachable (yet)
    for detail in details_sent:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    return cls(
        details or code.name,
        code,
        reason=reason,
        metadata=metadata,
        retry_after_s=retry_after_s,
    )


def _details(exc: grpc.RpcError) -> list:
    """The google.rpc error details the server sent with ``exc`` (none from a server or
    proxy that sends none, or an error raised before the call reached one)."""
    if not hasattr(exc, "trailing_metadata"):
        return []
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except ValueError:  # a details trailer that does not match the call's status
        return []
    return list(status.details) if status is not None else []
