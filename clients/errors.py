"""The client's exception hierarchy.

Every error a geonear call raises is a :class:`GeoNearError`; its subclasses mirror the
gRPC status codes the server uses (docs/design.md). Each carries the status ``code`` (a
``grpc.StatusCode``) and the server's ``message``; the underlying ``grpc.RpcError`` is
kept as ``__cause__``.

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


class GeoNearError(Exception):
    """Base of every geonear client error."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

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
    return cls(details or code.name, code)
