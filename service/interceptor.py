"""The server's one interceptor: tokens, admission, message size, metrics, request log.

One interceptor rather than one per concern, because each layer of gRPC interception
wraps every call again; here a call costs one dictionary lookup for its wrapped handler
(built once per method), a token check when tokens are configured, and the bookkeeping
of the wrapper itself: about 5 µs per call for admission and metrics, 4 µs more for
tokens and 15 µs more for the log line, on a 2-core machine (README, "Metrics and logs").

For every GeoNear call, in order:

1. tokens (when ``--auth-tokens`` is set): UNAUTHENTICATED / PERMISSION_DENIED
   (:mod:`geonear.service.auth`);
2. admission: RESOURCE_EXHAUSTED beyond ``max_concurrent_rpcs``
   (:mod:`geonear.service.admission`);
3. message size: a request message above ``max_message_bytes`` is refused with
   RESOURCE_EXHAUSTED naming the setting. gRPC's own receive limit is set to twice that,
   so a message between the two gets geonear's message; one above both is refused by
   gRPC itself before it is read;
4. after the call: metrics (:mod:`geonear.service.metrics`) and, when enabled, one log
   line on the ``geonear.requests`` logger, in logfmt::

       rpc=Knn dataset=pts rows=30 duration_ms=0.84 status=OK peer=ipv4:127.0.0.1:50412

A call whose engine raised ``DeviceLost`` (the servicer lets it through) is answered
UNAVAILABLE and hands the failure to the server's lifecycle, which stops the process so
that it is restarted (:mod:`geonear.service.lifecycle`); from then on every call is
refused UNAVAILABLE before it starts.

Health checks and reflection pass untouched: open to everyone, never refused, not
counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from geonear.service.admission import Admission
from geonear.service.auth import Denial, TokenCheck
from geonear.service.engines.base import DeviceLost
from geonear.service.errors import LimitExceeded
from geonear.service.lifecycle import Lifecycle
from geonear.service.metrics import Metrics
from geonear.v1 import geonear_pb2 as pb

request_log = logging.getLogger("geonear.requests")

#: Method prefixes that skip every check: health checking and reflection.
OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")

_ROWS: dict[type, Callable[[Any], int]] = {
    pb.ArrowData: lambda m: m.row_count,
    pb.CompactNeighbours: lambda m: len(m.distance_m),
    pb.MatrixTile: lambda m: m.row_count * m.col_count,
    pb.KMeansResponse: lambda m: m.labels.row_count,
    pb.UploadResponse: lambda m: m.rows_received,
    pb.DeleteRowsResponse: lambda m: m.rows_deleted,
}


def _rows(message: Any) -> int:
    count = _ROWS.get(type(message))
    return count(message) if count is not None else 0


class _Oversized:
    """Stands in for a request message above the limit, so the call can say which limit."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class _Call:
    """What is known about one call while it runs, for the metrics and the log line."""

    __slots__ = ("dataset", "rows", "start")

    def __init__(self, dataset: str) -> None:
        self.dataset = dataset
        self.rows = 0
        self.start = time.perf_counter()


class ServerInterceptor(grpc.ServerInterceptor):
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
    ) -> None:
        self.admission = admission
        self.max_message_bytes = max_message_bytes
        self.tokens = tokens
        self.metrics = metrics
        self.log_requests = log_requests
        self.lifecycle = lifecycle
        self._handlers: dict[tuple[str, str], grpc.RpcMethodHandler] = {}

    # -- dispatch ------------------------------------------------------------------------
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_PREFIXES):
            return continuation(handler_call_details)
        denial = None
        if self.tokens is not None:
            metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
            denial = self.tokens.check(method, metadata)
        key = (method, denial.status if denial is not None else "")
        handler = self._handlers.get(key)
        if handler is None:
            inner = continuation(handler_call_details)
            if inner is None:
                return None  # unknown method: gRPC answers UNIMPLEMENTED
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
                return _Oversized(len(data))
            return parse(data) if parse is not None else data

        streaming_request = inner.request_streaming
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
    def _admit(
        self,
        rpc: str,
        request: Any,
        context: grpc.ServicerContext,
        denial: Denial | None,
        streaming: bool,
    ) -> tuple[_Call, Any]:
        """Checks before the call; returns its record and the request (iterator) to pass on."""
        call = _Call("" if streaming else getattr(request, "dataset", ""))
        if denial is not None:
            self._finish(call, rpc, context, grpc.StatusCode[denial.status])
            context.abort(grpc.StatusCode[denial.status], denial.message)
        if self.lifecycle is not None and self.lifecycle.fatal_reason is not None:
            self._finish(call, rpc, context, grpc.StatusCode.UNAVAILABLE)
            context.abort(grpc.StatusCode.UNAVAILABLE, self.lifecycle.refusal())
        if not self.admission.try_enter():
            self._finish(call, rpc, context, grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.admission.refusal())
        if streaming:
            return call, self._checked_stream(request, call)
        if type(request) is _Oversized:
            self.admission.leave()
            self._finish(call, rpc, context, grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_large(request))
        return call, request

    def _checked_stream(self, requests: Iterator[Any], call: _Call) -> Iterator[Any]:
        for message in requests:
            if type(message) is _Oversized:
                raise LimitExceeded(self._too_large(message))
            if not call.dataset and type(message) is pb.UploadRequest:
                call.dataset = message.header.dataset
            yield message

    def _too_large(self, message: _Oversized) -> str:
        return (
            f"a {message.size}-byte request message exceeds max_message_bytes="
            f"{self.max_message_bytes} (setting GEONEAR_MAX_MESSAGE_BYTES); send smaller "
            "batches or fewer points per request"
        )

    def _unary(
        self, rpc: str, inner: grpc.RpcMethodHandler, denial: Denial | None, streaming: bool
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        behaviour = inner.stream_unary if streaming else inner.unary_unary
        assert behaviour is not None

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            call, request = self._admit(rpc, request, context, denial, streaming)
            code = None
            try:
                response = behaviour(request, context)
                call.rows = _rows(response)
                return response
            except DeviceLost as exc:
                code = grpc.StatusCode.UNAVAILABLE
                self._device_lost(context, exc)
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
                raise
            finally:
                self.admission.leave()
                self._finish(call, rpc, context, code)

        unary.__name__ = rpc
        return unary

    def _streaming(
        self, rpc: str, inner: grpc.RpcMethodHandler, denial: Denial | None, streaming: bool
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        behaviour = inner.stream_stream if streaming else inner.unary_stream
        assert behaviour is not None

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            call, request = self._admit(rpc, request, context, denial, streaming)
            code = None
            try:
                for response in behaviour(request, context):
                    call.rows += _rows(response)
                    yield response
            except GeneratorExit:
                # gRPC stopped reading: the client went away or its deadline passed.
                remaining = context.time_remaining()
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if remaining is not None and remaining <= 0
                    else grpc.StatusCode.CANCELLED
                )
                raise
            except DeviceLost as exc:
                code = grpc.StatusCode.UNAVAILABLE
                self._device_lost(context, exc)
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
                raise
            finally:
                self.admission.leave()
                self._finish(call, rpc, context, code)

        stream.__name__ = rpc
        return stream

    def _device_lost(self, context: grpc.ServicerContext, exc: DeviceLost) -> None:
        """Answer UNAVAILABLE; the lifecycle stops the server so that it is restarted."""
        message = str(exc)
        if self.lifecycle is not None:
            self.lifecycle.fatal(message)
            message = self.lifecycle.refusal()
        context.abort(grpc.StatusCode.UNAVAILABLE, message)

    def _finish(
        self,
        call: _Call,
        rpc: str,
        context: grpc.ServicerContext,
        code: grpc.StatusCode | None,
    ) -> None:
        """Metrics and the log line of a finished (or refused) call."""
        if code is None:
            code = context.code() or grpc.StatusCode.OK  # type: ignore[attr-defined]
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


def _logfmt(value: str) -> str:
    """A value as logfmt writes it: bare when plain, else double-quoted."""
    if value and all(c.isalnum() or c in "_.-" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
