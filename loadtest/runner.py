"""Driving one target: worker processes, each an asyncio loop over its own grpc.aio channels.

One Python process saturates long before a server does, so the load is spread over
``--processes`` workers (spawned, never forked: gRPC's core does not survive a fork).
The parent starts them, waits until every worker has connected, then gives them one
common start time; each worker runs the warm-up (measured, not recorded), then the
measurement window, then sends back its totals with its HdrHistogram encoded.

Closed loop (``--concurrency N``)
    N requests in flight at all times, each client coroutine sending its next request
    as soon as the last one returned. Latency runs from the actual send.
Open loop (``--rate R``)
    requests are scheduled at a constant rate, R/processes per worker with the
    workers' schedules interleaved, and sent at their scheduled time whatever the
    server is doing. Latency runs from the *scheduled* time, so a stalled server (or a
    load generator that falls behind) shows up as latency rather than as a lower rate:
    wrk2's correction of coordinated omission. A request belongs to the window it was
    scheduled (closed loop: sent) in, and every such request is awaited to its answer
    or its deadline, so the slow ones are never cut off by the end of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue as queue_module
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from geonear.loadtest.connection import Connection
from geonear.loadtest.results import (
    WorkerTotals,
    count_error_message,
    encode_histogram,
    new_histogram,
    record_latency,
)
from geonear.loadtest.scenarios import RPCS, NotServing, Request

#: Seconds between progress messages from a worker.
PROGRESS_INTERVAL_S = 0.5
#: An open-loop send more than this late counts in ``late_sends``.
LATE_SEND_S = 0.010
#: Seconds a worker may take to start and connect before the run is abandoned.
START_TIMEOUT_S = 60.0


class LoadTestError(RuntimeError):
    """The load generator itself failed (a worker crashed or never connected)."""


@dataclass(frozen=True)
class LoadPlan:
    """How hard and how long to drive one target, for all workers together."""

    concurrency: int | None = None
    rate: float | None = None
    duration_s: float = 10.0
    warmup_s: float = 2.0
    processes: int = 1
    channels: int = 1
    timeout_s: float = 30.0
    max_in_flight: int = 10_000

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give either a concurrency (closed loop) or a rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {self.rate}")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("--duration must be > 0 and --warmup >= 0 seconds")
        for name in ("processes", "channels", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def n_workers(self) -> int:
        # More processes than in-flight requests would leave some idle.
        if self.concurrency is not None:
            return min(self.processes, self.concurrency)
        return self.processes

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "processes": self.n_workers,
            "channels": self.channels,
            "timeout_s": self.timeout_s,
            "max_in_flight": self.max_in_flight,
        }


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's share of a LoadPlan (pickled into the worker process)."""

    index: int
    address: str
    connection: Connection
    pool: Sequence[Request]
    plan: LoadPlan
    concurrency: int = 0
    rate: float = 0.0
    rate_offset_s: float = 0.0


def split_plan(
    plan: LoadPlan, address: str, connection: Connection, pool: Sequence[Request]
) -> list[WorkerPlan]:
    """Concurrency split as evenly as integers allow; the rate split evenly, interleaved."""
    n = plan.n_workers
    out = []
    for i in range(n):
        if plan.concurrency is not None:
            share = plan.concurrency // n + (1 if i < plan.concurrency % n else 0)
            out.append(WorkerPlan(i, address, connection, pool, plan, concurrency=share))
        elif plan.rate is not None:
            out.append(
                WorkerPlan(
                    i,
                    address,
                    connection,
                    pool,
                    plan,
                    rate=plan.rate / n,
                    rate_offset_s=i / plan.rate,
                )
            )
    return out


# -- inside a worker process -----------------------------------------------------------
@dataclass
class _Recorder:
    """Counts what completes; only requests that started in the window are recorded."""

    window_start: float
    window_end: float
    totals: WorkerTotals = field(default_factory=WorkerTotals)
    histogram: Any = field(default_factory=new_histogram)
    # Everything that completed (warm-up included), for the live display.
    done: int = 0
    failed: int = 0
    recent: Any = field(default_factory=new_histogram)

    def _bucket(self, series: list[int], now: float) -> None:
        second = max(0, int(now - self.window_start))
        if second >= len(series):
            series.extend([0] * (second + 1 - len(series)))
        series[second] += 1

    def success(self, started: float, now: float, rows: int) -> None:
        self.done += 1
        record_latency(self.recent, now - started)
        if not self.window_start <= started < self.window_end:
            return
        self.totals.successes += 1
        self.totals.rows += rows
        record_latency(self.histogram, now - started)
        self._bucket(self.totals.timeline_successes, now)

    def error(self, started: float, now: float, code: str, message: str = "") -> None:
        self.failed += 1
        if not self.window_start <= started < self.window_end:
            return
        self.totals.errors[code] += 1
        count_error_message(self.totals.error_messages, code, message)
        self._bucket(self.totals.timeline_errors, now)

    def final(self) -> WorkerTotals:
        n = max(len(self.totals.timeline_successes), len(self.totals.timeline_errors))
        for series in (self.totals.timeline_successes, self.totals.timeline_errors):
            series.extend([0] * (n - len(series)))
        self.totals.histogram = encode_histogram(self.histogram)
        return self.totals


def _callers(
    channel: grpc.aio.Channel, connection: Connection, timeout_s: float
) -> dict[str, Callable[[Any], Any]]:
    """Per RPC name, a coroutine function sending a prepared request and counting rows."""
    metadata = connection.metadata()
    out: dict[str, Callable[[Any], Any]] = {}
    for name, rpc in RPCS.items():
        # request_serializer=None: the pool holds requests already serialized.
        if rpc.cardinality == "unary_unary":
            method = channel.unary_unary(
                rpc.path, request_serializer=None, response_deserializer=rpc.response.FromString
            )

            async def unary(payload: Any, method: Any = method, rpc: Any = rpc) -> int:
                return rpc.rows(await method(payload, timeout=timeout_s, metadata=metadata))

            out[name] = unary
        elif rpc.cardinality == "unary_stream":
            method = channel.unary_stream(
                rpc.path, request_serializer=None, response_deserializer=rpc.response.FromString
            )

            async def stream(payload: Any, method: Any = method, rpc: Any = rpc) -> int:
                call = method(payload, timeout=timeout_s, metadata=metadata)
                return rpc.rows([m async for m in call])

            out[name] = stream
        else:
            method = channel.stream_unary(
                rpc.path, request_serializer=None, response_deserializer=rpc.response.FromString
            )

            async def upload(payload: Any, method: Any = method, rpc: Any = rpc) -> int:
                return rpc.rows(await method(iter(payload), timeout=timeout_s, metadata=metadata))

            out[name] = upload
    return out


async def _send(
    caller: dict[str, Callable[[Any], Any]], request: Request, recorder: _Recorder, started: float
) -> None:
    name, payload = request
    try:
        rows = await caller[name](payload)
    except grpc.aio.AioRpcError as exc:
        recorder.error(started, time.perf_counter(), exc.code().name, exc.details() or "")
    except NotServing as exc:
        recorder.error(started, time.perf_counter(), str(exc))
    else:
        recorder.success(started, time.perf_counter(), rows)


async def _closed_loop(
    w: WorkerPlan, callers: list[dict[str, Any]], recorder: _Recorder, start: float
) -> None:
    pool = w.pool

    async def client(j: int) -> None:
        caller = callers[j % len(callers)]
        n = w.index * w.concurrency + j
        while (started := time.perf_counter()) < recorder.window_end:
            await _send(caller, pool[n % len(pool)], recorder, started)
            n += w.concurrency

    await asyncio.gather(*(client(j) for j in range(w.concurrency)))


async def _open_loop(
    w: WorkerPlan, callers: list[dict[str, Any]], recorder: _Recorder, start: float
) -> None:
    pool = w.pool
    interval = 1.0 / w.rate
    slots = asyncio.Semaphore(w.plan.max_in_flight)
    in_flight: set[asyncio.Task[None]] = set()

    async def one(n: int, scheduled: float) -> None:
        try:
            await _send(
                callers[n % len(callers)], pool[(n + w.index) % len(pool)], recorder, scheduled
            )
        finally:
            slots.release()

    n = 0
    scheduled = start + w.rate_offset_s
    while scheduled < recorder.window_end:
        now = time.perf_counter()
        if scheduled > now:
            await asyncio.sleep(scheduled - now)
            continue
        # Never skip a send: when the server or this process falls behind, requests go
        # out late, and their latency still counts from the scheduled time.
        await slots.acquire()
        if time.perf_counter() - scheduled > LATE_SEND_S and scheduled >= recorder.window_start:
            recorder.totals.late_sends += 1
        task = asyncio.create_task(one(n, scheduled))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        n += 1
        scheduled = start + w.rate_offset_s + n * interval
    if in_flight:
        await asyncio.gather(*in_flight)


async def _report_progress(w: WorkerPlan, recorder: _Recorder, out: Any) -> None:
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        recent, recorder.recent = recorder.recent, new_histogram()
        out.put(("progress", w.index, recorder.done, recorder.failed, encode_histogram(recent)))


async def _worker(w: WorkerPlan, out: Any, go: Any, start_wall: Any) -> WorkerTotals:
    channels = [w.connection.aio_channel(w.address, i) for i in range(w.plan.channels)]
    try:
        await asyncio.wait_for(
            asyncio.gather(*(c.channel_ready() for c in channels)), START_TIMEOUT_S / 2
        )
        callers = [_callers(c, w.connection, w.plan.timeout_s) for c in channels]
        out.put(("ready", w.index))
        if not await asyncio.get_running_loop().run_in_executor(None, go.wait, START_TIMEOUT_S):
            raise LoadTestError("the parent process never gave the start signal")
        # The parent's start time is wall-clock (shared across processes); convert it
        # to this process's monotonic clock once.
        start = time.perf_counter() + (start_wall.value - time.time())
        recorder = _Recorder(start + w.plan.warmup_s, start + w.plan.warmup_s + w.plan.duration_s)
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        progress = asyncio.create_task(_report_progress(w, recorder, out))
        try:
            loop = _closed_loop if w.plan.mode == "closed" else _open_loop
            await loop(w, callers, recorder, start)
        finally:
            progress.cancel()
        return recorder.final()
    finally:
        for channel in channels:
            await channel.close()


def worker_main(w: WorkerPlan, out: Any, go: Any, start_wall: Any) -> None:
    """Entry point of a worker process: run, then put ("done", index, totals) on ``out``."""
    try:
        totals = asyncio.run(_worker(w, out, go, start_wall))
        out.put(("done", w.index, totals.to_dict()))
    except BaseException:
        out.put(("failed", w.index, traceback.format_exc()))


# -- in the parent ---------------------------------------------------------------------
class ProgressSink:
    """Receives the workers' progress; the live display implements it, this ignores it."""

    def begin(self, name: str, plan: LoadPlan) -> None:
        pass

    def started(self) -> None:
        pass

    def update(self, worker: int, done: int, failed: int, recent_histogram: str) -> None:
        pass

    def end(self, run: dict[str, Any]) -> None:
        pass


def run_workers(
    name: str,
    address: str,
    connection: Connection,
    pool: Sequence[Request],
    plan: LoadPlan,
    progress: ProgressSink | None = None,
) -> list[WorkerTotals]:
    """Drive ``address`` with ``plan`` from worker processes; their totals, by worker."""
    progress = progress or ProgressSink()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Event()
    start_wall = ctx.Value("d", 0.0)
    workers = split_plan(plan, address, connection, pool)
    procs = [
        ctx.Process(
            target=worker_main,
            args=(w, out, go, start_wall),
            daemon=True,
            name=f"geonear-loadtest-{name}-{w.index}",
        )
        for w in workers
    ]
    progress.begin(name, plan)
    for p in procs:
        p.start()
    try:
        ready: set[int] = set()
        totals: dict[int, WorkerTotals] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(totals) < len(procs):
            if not go.is_set() and len(ready) == len(procs):
                # A short lead so every worker is waiting when the clock starts.
                start_wall.value = time.time() + 0.05
                go.set()
                progress.started()
                run_s = plan.warmup_s + plan.duration_s + plan.timeout_s + START_TIMEOUT_S
                deadline = time.monotonic() + run_s
            try:
                message = out.get(timeout=0.1)
            except queue_module.Empty:
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode]
                if dead or time.monotonic() > deadline:
                    raise LoadTestError(
                        f"load-test workers {', '.join(dead)} died"
                        if dead
                        else f"load-test workers did not finish against {address}"
                    ) from None
                continue
            kind, index, *rest = message
            if kind == "ready":
                ready.add(index)
            elif kind == "progress":
                progress.update(index, *rest)
            elif kind == "done":
                totals[index] = WorkerTotals.from_dict(rest[0])
            else:
                raise LoadTestError(
                    f"load-test worker {index} against {address} failed:\n{rest[0]}"
                )
        for p in procs:
            p.join(timeout=10)
        return [totals[i] for i in sorted(totals)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        with contextlib.suppress(Exception):
            out.close()
