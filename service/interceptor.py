"""The server's one interceptor: tokens, admission, message size, metrics, request log.

One interceptor rather than one per concern, because each layer of gRPC interception
wraps every call again; here a call costs one dictionary lookup for its wrapped handler
(built once per method), a token check when tokens are configured, and the bookkeeping
of the wrapper itself: about 5 µs per call for admission and metrics, 4 µs more for
tokens and 15 µs more for the log line, on a 2-core machine (README, "Metrics and logs").

For every GeoNear call, in order:

1. tokens (when ``--auth-tokens`` is set): UNAUTHENTICATED / PERMISSION_DENIED
   (:mod:`geonear.service.auth`);
2. admission: RESOURCE_EXHAUSTED beyond ``max_concurrent_rpcs``, or for an upload beyond
   ``max_concurrent_uploads`` (:mod:`geonear.service.admission`);
3. message size: a request message above ``max_message_bytes`` is refused with
   RESOURCE_EXHAUSTED naming the setting. gRPC's own receive limit is set to twice that,
   so a message between the two gets geonear's message; one above both is refused by
   gRPC itself before it is read;
4. the call's exceptions, mapped here and nowhere else (:mod:`geonear.service.errors`
   has the tree): each error's status code and message, with a ``google.rpc.Status`` in
   the ``grpc-status-details-bin`` trailer carrying its machine-readable reason
   (``ErrorInfo``, domain ``geonear``: e.g. COMPACT_TOO_LARGE, which no retry helps, vs
   SERVER_BUSY) and, where a retry helps, a ``RetryInfo``; anything unexpected is
   INTERNAL with an error id that the ``geonear.errors`` log line (with the traceback)
   carries too, never UNKNOWN with a Python class name;
5. after the call: metrics (:mod:`geonear.service.metrics`) and, when enabled, one log
   line on the ``geonear.requests`` logger, in logfmt::

       rpc=Knn dataset=pts rows=30 duration_ms=0.84 status=OK peer=ipv4:127.0.0.1:50412

A call whose engine raised ``DeviceLost`` (the servicer lets it through) is answered
UNAVAILABLE and hands the failure to the server's lifecycle, which stops the process so
that it is restarted (:mod:`geonear.service.lifecycle`); from then on every call is
refused UNAVAILABLE before it starts.

Health checks and reflection pass untouched: open to everyone, never refused, not
counted.

The server is a grpc.aio server and every handler runs on its event loop: a unary one
is a coroutine, a streaming one an async generator; their blocking work runs on the
loop's thread pool (:mod:`geonear.service.calls`). A streamed request (Upload,
KnnStream, RadiusStream) is read on the loop; when no message comes for
``upload_idle_timeout_s`` the call ends DEADLINE_EXCEEDED (``UploadIdle``), nothing
stored, and its slot is free again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from geonear.service.admission import Admission
from geonear.service.auth import Denial, TokenCheck
from geonear.service.errors import (
    BadArrow,
    Cancelled,
    DeviceLost,
    InvalidInput,
    LimitExceeded,
    OutOfMemory,
    PermissionDenied,
    ServerBusy,
    ServiceError,
    Unauthenticated,
    Unsupported,
    UploadIdle,
    status_message,
)
from geonear.service.lifecycle import Lifecycle
from geonear.service.metrics import Metrics
from geonear.v1 import geonear_pb2 as pb
from geonear.wire import EncodedArrowData, WireError

request_log = logging.getLogger("geonear.requests")
error_log = logging.getLogger("geonear.errors")

#: Method prefixes that skip every check: health checking and reflection.
OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")

_ROWS: dict[type, Callable[[Any], int]] = {
    pb.ArrowData: lambda m: m.row_count,
    EncodedArrowData: lambda m: m.row_count,
    pb.CompactNeighbours: lambda m: len(m.distance_m),
    pb.MatrixTile: lambda m: m.row_count * m.col_count,
    pb.KMeansResponse: lambda m: m.labels.row_count,
    pb.UploadResponse: lambda m: m.rows_received,
    pb.DeleteRowsResponse: lambda m: m.rows_deleted,
}


def _rows(message: Any) -> int:
    count = _ROWS.get(type(message))
    return count(message) if count is not None else 0


class _Unreadable:
    """Stands in for a request message the server will not read: one above the size limit,
    or bytes that are not the method's protobuf message. The call is answered with
    ``error`` (RESOURCE_EXHAUSTED naming the limit, or INVALID_ARGUMENT)."""

    __slots__ = ("error",)

    def __init__(self, error: ServiceError) -> None:
        self.error = error


class _Call:
    """What is known about one call while it runs, for the metrics and the log line."""

    __slots__ = ("dataset", "ended", "rows", "start", "upload")

    def __init__(self, dataset: str, upload: bool) -> None:
        self.dataset = dataset
        self.upload = upload  # admitted against the uploads' share
        self.rows = 0
        self.start = time.perf_counter()
        self.ended = False  # counted in the metrics and the log


def _dataset_of(request: Any) -> str:
    """The dataset a request reads, for the log: a join's is "left>right"."""
    left = getattr(request, "left_dataset", "")
    right = getattr(request, "right_dataset", "") or getattr(request, "dataset", "")
    return f"{left}>{right}" if left and right else right or left


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every GeoNear method handler once; see the module docstring."""

    def __init__(
        self,
        admission: Admission,
        *,
        max_message_bytes: int,
        tokens: TokenCheck | None = None,
        metrics: Metrics | None = None,
        log_requests: bool = True,
        lifecycle: Lifecycle | None = None,
        upload_idle_timeout_s: float = 30.0,
    ) -> None:
        self.admission = admission
        self.max_message_bytes = max_message_bytes
        self.tokens = tokens
        self.metrics = metrics
        self.log_requests = log_requests
        self.lifecycle = lifecycle
        self.upload_idle_timeout_s = upload_idle_timeout_s
        # By method and denial: each denial's message is built into its handler. The
        # denials are auth's few constants, so a method has at most four handlers.
        self._handlers: dict[tuple[str, Denial | None], grpc.RpcMethodHandler] = {}

    # -- dispatch ------------------------------------------------------------------------
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        denial = None
        if self.tokens is not None:
            metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
            denial = self.tokens.check(method, metadata)
        key = (method, denial)
        handler = self._handlers.get(key)
        if handler is None:
            inner = await continuation(handler_call_details)
            if inner is None:
                return None  # type: ignore[return-value]  # gRPC answers UNIMPLEMENTED
            handler = self._wrap(method.rsplit("/", 1)[-1], inner, denial)
            self._handlers[key] = handler
        return handler

    def _wrap(
        self, rpc: str, inner: grpc.RpcMethodHandler, denial: Denial | None
    ) -> grpc.RpcMethodHandler:
        limit = self.max_message_bytes
        parse = inner.request_deserializer

        def deserialize(data: bytes) -> Any:
            if len(data) > limit:
                return _Unreadable(
                    LimitExceeded(self._too_large(len(data)), setting="GEONEAR_MAX_MESSAGE_BYTES")
                )
            if parse is None:
                return data
            try:
                return parse(data)
            except DecodeError as exc:
                return _Unreadable(
                    InvalidInput(f"the {rpc} request is not a valid protobuf message ({exc})")
                )

        streaming_request = inner.request_streaming
        behaviour: Callable[..., Any]
        if inner.response_streaming:
            behaviour = self._streaming(rpc, inner, denial, streaming_request)
            factory = (
                grpc.stream_stream_rpc_method_handler
                if streaming_request
                else grpc.unary_stream_rpc_method_handler
            )
        else:
            behaviour = self._unary(rpc, inner, denial, streaming_request)
            factory = (
                grpc.stream_unary_rpc_method_handler
                if streaming_request
                else grpc.unary_unary_rpc_method_handler
            )
        return factory(
            behaviour,
            request_deserializer=deserialize,
            response_serializer=inner.response_serializer,
        )

    # -- around the call -----------------------------------------------------------------
    def _refusal(
        self, call: _Call, request: Any, denial: Denial | None, streaming: bool
    ) -> ServiceError | None:
        """Checks before the call: the error to refuse it with, or None once admitted."""
        refusal: ServiceError | None = None
        if denial is not None:
            refusal = _DENIALS[denial.status](denial.message)
        elif self.lifecycle is not None and self.lifecycle.fatal_reason is not None:
            refusal = DeviceLost(self.lifecycle.refusal())
        elif (crowded := self.admission.admit(call.upload)) is not None:
            refusal = ServerBusy(crowded)
        elif not streaming and type(request) is _Unreadable:
            self.admission.leave(call.upload)
            refusal = request.error
        return refusal

    async def _admit(
        self,
        rpc: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        denial: Denial | None,
        streaming: bool,
    ) -> tuple[_Call, Any]:
        """Checks before the call; returns its record and the request (iterator) to pass on."""
        call = _Call("" if streaming else _dataset_of(request), upload=rpc == "Upload")
        refusal = self._refusal(call, request, denial, streaming)
        if refusal is not None:
            code, message, trailers = _status(refusal, context)
            self._finish(call, rpc, context, code)
            await context.abort(code, message, trailers)
        if streaming:
            return call, self._checked_stream(request, call)
        return call, request

    async def _checked_stream(
        self, requests: AsyncIterator[Any], call: _Call
    ) -> AsyncIterator[Any]:
        """The request messages of a streamed call. The call ends DEADLINE_EXCEEDED
        (``UploadIdle``) when no message comes within ``upload_idle_timeout_s`` of being
        asked for: time the handler spends on a message does not count against the
        client."""
        while True:
            try:
                message = await asyncio.wait_for(anext(requests), self.upload_idle_timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise UploadIdle(self.upload_idle_timeout_s) from None
            if type(message) is _Unreadable:
                raise message.error
            if not call.dataset:
                header = message.header if type(message) is pb.UploadRequest else message
                call.dataset = getattr(header, "dataset", "")
            yield message

    def _too_large(self, size: int) -> str:
        return (
            f"a {size}-byte request message exceeds max_message_bytes="
            f"{self.max_message_bytes} (setting GEONEAR_MAX_MESSAGE_BYTES); send smaller "
            "batches or fewer points per request"
        )

    def _unary(
        self, rpc: str, inner: grpc.RpcMethodHandler, denial: Denial | None, streaming: bool
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """The wrapper of a unary-response handler (a coroutine)."""
        behaviour = inner.stream_unary if streaming else inner.unary_unary
        assert behaviour is not None and inspect.iscoroutinefunction(behaviour), rpc

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call, request = await self._admit(rpc, request, context, denial, streaming)
            code = None
            try:
                response = await behaviour(request, context)
                call.rows = _rows(response)
                return response
            except asyncio.CancelledError:
                code = _gone(context)
                raise
            except grpc.aio.AbortError:
                code = _code(context) or grpc.StatusCode.UNKNOWN
                raise
            except Exception as exc:
                await self._abort(call, rpc, context, exc)
            except BaseException:
                code = _code(context) or grpc.StatusCode.UNKNOWN
                raise
            finally:
                self._end(call, rpc, context, code)

        unary.__name__ = rpc
        return unary

    def _streaming(
        self, rpc: str, inner: grpc.RpcMethodHandler, denial: Denial | None, streaming: bool
    ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        """The wrapper of a streaming-response handler (an async generator)."""
        behaviour = inner.stream_stream if streaming else inner.unary_stream
        assert behaviour is not None and inspect.isasyncgenfunction(behaviour), rpc

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call, request = await self._admit(rpc, request, context, denial, streaming)
            code = None
            responses = behaviour(request, context)
            try:
                async for response in responses:
                    call.rows += _rows(response)
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                # gRPC stopped reading: the client went away or its deadline passed.
                code = _gone(context)
                await responses.aclose()  # its work ends (and its threads let go) first
                raise
            except grpc.aio.AbortError:
                code = _code(context) or grpc.StatusCode.UNKNOWN
                raise
            except Exception as exc:
                await self._abort(call, rpc, context, exc)
            except BaseException:
                code = _code(context) or grpc.StatusCode.UNKNOWN
                raise
            finally:
                self._end(call, rpc, context, code)

        stream.__name__ = rpc
        return stream

    def _end(self, call: _Call, rpc: str, context: Any, code: grpc.StatusCode | None) -> None:
        """Leave admission and count the call in the metrics and the log, once."""
        if not call.ended:
            call.ended = True
            self.admission.leave(call.upload)
            self._finish(call, rpc, context, code)

    async def _abort(
        self, call: _Call, rpc: str, context: grpc.aio.ServicerContext, exc: Exception
    ) -> None:
        """End the call, then answer it with the status of ``exc`` (``abort`` raises).

        The one seam from exceptions to statuses (:mod:`geonear.service.errors`). grpc.aio's
        ``abort`` sends the status at once, so the call is counted first: a client that
        has seen the status finds the call in the metrics and the log."""
        error = _as_service_error(rpc, exc)
        if isinstance(error, DeviceLost) and self.lifecycle is not None:
            # The lifecycle stops the server so that it is restarted.
            self.lifecycle.fatal(str(error))
            error = DeviceLost(self.lifecycle.refusal())
        code, message, trailers = _status(error, context)
        self._end(call, rpc, context, code)
        await context.abort(code, message, trailers)

    def _finish(
        self,
        call: _Call,
        rpc: str,
        context: Any,
        code: grpc.StatusCode | None,
    ) -> None:
        """Metrics and the log line of a finished (or refused) call."""
        if code is None:
            code = _code(context) or grpc.StatusCode.OK
        status = code.name
        seconds = time.perf_counter() - call.start
        if self.metrics is not None:
            self.metrics.record(rpc, status, seconds, call.rows)
        if self.log_requests and request_log.isEnabledFor(logging.INFO):
            request_log.info(
                "rpc=%s dataset=%s rows=%d duration_ms=%.3f status=%s peer=%s",
                rpc,
                _logfmt(call.dataset),
                call.rows,
                seconds * 1e3,
                status,
                context.peer(),
            )


_DENIALS: dict[str, type[ServiceError]] = {
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
}
#: Where google.rpc error details travel: the binary trailer gRPC's richer error model uses.
DETAILS_KEY = "grpc-status-details-bin"
#: The ErrorInfo domain of every reason geonear gives.
ERROR_DOMAIN = "geonear"


def _as_service_error(rpc: str, exc: Exception) -> ServiceError:
    """``exc`` as an error of the service's tree. One that no layer below answered is
    INTERNAL with an error id that the log line (with the traceback) carries too, never
    the exception's class or text."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, WireError):
        return BadArrow(str(exc))
    if isinstance(exc, MemoryError):
        why = exc or "allocation failed"
        return OutOfMemory(f"out of memory: {why}; use fewer points per call")
    if isinstance(exc, NotImplementedError):
        return Unsupported(f"{rpc}: {exc or 'not implemented by this engine'}")
    error_id = uuid.uuid4().hex[:12]
    error_log.error("rpc=%s error_id=%s unexpected error", rpc, error_id, exc_info=exc)
    return ServiceError(
        f"internal error {error_id} in {rpc}; the server's log has its details under this id",
        error_id=error_id,
    )


def _status(
    error: ServiceError, context: Any
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes], ...]]:
    """The status code, message and trailing metadata answering ``error``: the
    ``google.rpc.Status`` in the details trailer carries an ErrorInfo (the reason, domain
    ``geonear``, the error's metadata) and, for an error worth retrying, a RetryInfo."""
    code = grpc.StatusCode[error.status]
    if isinstance(error, Cancelled):
        left = context.time_remaining()
        if left is not None and left <= 0:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
    message = status_message(str(error))
    status = status_pb2.Status(code=code.value[0], message=message)
    info = error_details_pb2.ErrorInfo(
        reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata
    )
    status.details.add().Pack(info)
    if error.retry_after_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        status.details.add().Pack(retry)
    return code, message, tuple(rpc_status.to_status(status).trailing_metadata)


def _code(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    """The status code set on a call so far, or None."""
    code = context.code()
    if code is None or isinstance(code, grpc.StatusCode):
        return code
    return _CODES.get(code)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _gone(context: Any) -> grpc.StatusCode:
    """Why a streaming call stopped being read: its deadline passed, or the client left."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def _logfmt(value: str) -> str:
    """A value as logfmt writes it: bare when plain, else double-quoted."""
    if value and all(c.isalnum() or c in "_.-" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
