"""Dynamic batching: concurrent KNN and radius requests share one engine call.

In the manner of NVIDIA Triton's dynamic batcher. Each handler puts its request in the
queue of the dataset version it reads and awaits its answer; one dispatcher thread per batcher
takes whatever is queued when the engine is free (up to ``max_points`` query points,
after waiting up to ``max_delay_us`` for more when the queue is short), makes one engine
call for the whole batch, and hands every caller its own rows.

Exactness is unchanged. Requests of one batch may differ in k and max_distance_m: the
batch asks for the largest k with no distance bound, and each request keeps the first
``k`` neighbours within its own bound. The engine's neighbours are sorted by (distance,
row), so that prefix is exactly the request's own answer. Radius requests are batched
per radius.

A request whose deadline passes while it waits in the queue is answered
DEADLINE_EXCEEDED and left out of the batch; the others are not disturbed.

Callers are the handlers on the server's event loop (the compact RPCs, whose answers
are small by construction): they await the answer without holding the loop, so the loop
goes on reading requests while a batch runs, and that is what fills the next batch.
Streamed answers are made on threads, a slice at a time, and are not batched: they are
large enough to fill an engine call themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from geonear.service.engines import Neighbours, PointIndex, RadiusNeighbours
from geonear.service.errors import ServiceError


class QueueDeadlineExceeded(ServiceError):
    status = "DEADLINE_EXCEEDED"


@dataclass
class _Request:
    kind: str  # "knn" or "radius"
    index: PointIndex
    lat: np.ndarray
    lon: np.ndarray
    k: int = 0
    max_distance_m: float | None = None
    radius_m: float = 0.0
    #: The request's place in the queue: cancelled while it waits (the caller left or
    #: its deadline passed), or running once a batch took it.
    state: Future = field(default_factory=Future)
    #: The caller's future, on its event loop, that gets the answer.
    awaited: asyncio.Future | None = None

    def group(self) -> tuple[Any, ...]:
        """Requests that may share an engine call."""
        if self.kind == "knn":
            return ("knn", id(self.index))
        return ("radius", id(self.index), self.radius_m)


class Batcher:
    """Coalesces concurrent neighbour queries into batched engine calls.

    Parameters
    ----------
    max_points : int
        Largest number of query points in one engine call.
    max_delay_us : int
        How long the dispatcher waits for more requests after the first, microseconds;
        0 takes whatever is queued when the engine is free.
    """

    def __init__(self, max_points: int = 8192, max_delay_us: int = 0) -> None:
        self.max_points = max_points
        self.max_delay_s = max_delay_us / 1e6
        self._queue: deque[_Request] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self.batches = 0
        self.requests = 0
        self._thread = threading.Thread(target=self._run, name="geonear-batcher", daemon=True)
        self._thread.start()

    # -- callers -------------------------------------------------------------------------
    async def knn(
        self,
        index: PointIndex,
        lat: np.ndarray,
        lon: np.ndarray,
        k: int,
        max_distance_m: float | None,
        timeout_s: float | None = None,
    ) -> Neighbours:
        request = _Request("knn", index, lat, lon, k=k, max_distance_m=max_distance_m)
        result: Neighbours = await self._submit(request, timeout_s)
        return result

    async def radius(
        self,
        index: PointIndex,
        lat: np.ndarray,
        lon: np.ndarray,
        radius_m: float,
        timeout_s: float | None = None,
    ) -> RadiusNeighbours:
        request = _Request("radius", index, lat, lon, radius_m=radius_m)
        result: RadiusNeighbours = await self._submit(request, timeout_s)
        return result

    async def _submit(self, request: _Request, timeout_s: float | None) -> Any:
        if request.lat.shape[0] >= self.max_points:
            return await asyncio.to_thread(_run_alone, request)  # a full batch on its own
        loop = asyncio.get_running_loop()
        request.awaited = answer = loop.create_future()
        self._enqueue(request)
        # One timer per request, not wait_for + shield: the path runs per small query.
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, request)
        try:
            return await answer
        except asyncio.CancelledError:
            request.state.cancel()  # the caller left: drop it from the queue if it waits
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _enqueue(self, request: _Request) -> None:
        with self._ready:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._queue.append(request)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=5)

    # -- dispatcher ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            self.batches += 1
            self.requests += len(batch)
            _run_batch(batch)

    def _take(self) -> list[_Request] | None:
        with self._ready:
            while not self._queue:
                if self._closed:
                    return None
                self._ready.wait()
            if self.max_delay_s > 0:
                deadline = time.monotonic() + self.max_delay_s
                while self._queued_points() < self.max_points and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._ready.wait(left)
            first = self._queue[0].group()
            batch: list[_Request] = []
            rest: deque[_Request] = deque()
            points = 0
            while self._queue:
                request = self._queue.popleft()
                fits = points + request.lat.shape[0] <= self.max_points
                if request.group() == first and fits:
                    if request.state.set_running_or_notify_cancel():
                        batch.append(request)
                        points += request.lat.shape[0]
                else:
                    rest.append(request)
            self._queue = rest
            return batch

    def _queued_points(self) -> int:
        return sum(r.lat.shape[0] for r in self._queue)


def _expire(request: _Request) -> None:
    """A request's deadline passed: fail it if it still waits in the queue."""
    answer = request.awaited
    if answer is not None and not answer.done() and request.state.cancel():
        answer.set_exception(
            QueueDeadlineExceeded("the deadline passed while the request waited for a batch")
        )


def _run_alone(request: _Request) -> Any:
    if request.kind == "knn":
        return request.index.knn(request.lat, request.lon, request.k, request.max_distance_m)
    return request.index.radius(request.lat, request.lon, request.radius_m)


def _run_batch(batch: list[_Request]) -> None:
    if not batch:
        return
    try:
        results = [_run_alone(batch[0])] if len(batch) == 1 else _run_together(batch)
    except BaseException as exc:  # every caller hears of the failure
        _answer_loops(batch, [exc] * len(batch))
        return
    _answer_loops(batch, results)


def _run_together(batch: list[_Request]) -> list[Any]:
    lat = np.concatenate([r.lat for r in batch])
    lon = np.concatenate([r.lon for r in batch])
    starts = np.cumsum([0] + [r.lat.shape[0] for r in batch])
    spans = list(zip(batch, starts[:-1].tolist(), starts[1:].tolist(), strict=True))
    if batch[0].kind == "knn":
        knn = batch[0].index.knn(lat, lon, max(r.k for r in batch), None)
        return [_split_knn(knn, r, a, b) for r, a, b in spans]
    radius = batch[0].index.radius(lat, lon, batch[0].radius_m)
    return [_split_radius(radius, r, a, b) for r, a, b in spans]


def _answer_loops(batch: list[_Request], results: list[Any]) -> None:
    """Hand the answers of callers on event loops over: one wake-up per loop and batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any]]] = {}
    for r, result in zip(batch, results, strict=True):
        if r.awaited is not None:
            by_loop.setdefault(r.awaited.get_loop(), []).append((r.awaited, result))
    for loop, answers in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(_settle, answers)


def _settle(answers: list[tuple[asyncio.Future, Any]]) -> None:
    for future, result in answers:
        if future.done():
            continue  # its caller was cancelled
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


def _split_knn(found: Neighbours, request: _Request, start: int, stop: int) -> Neighbours:
    kk = min(request.k, found.indices.shape[1])
    dist = found.distances_m[start:stop, :kk].copy()
    idx = found.indices[start:stop, :kk].copy()
    if request.max_distance_m is not None:
        far = dist > request.max_distance_m
        dist[far], idx[far] = np.inf, -1
    return Neighbours(distances_m=dist, indices=idx)


def _split_radius(
    found: RadiusNeighbours, request: _Request, start: int, stop: int
) -> RadiusNeighbours:
    lo, hi = found.offsets[start], found.offsets[stop]
    return RadiusNeighbours(
        offsets=found.offsets[start : stop + 1] - lo,
        indices=found.indices[lo:hi],
        distances_m=found.distances_m[lo:hi],
    )
