"""``geonear bench --served``: one bulk query in-process and through a real server.

For each engine, in one run on the same data: the engine's own call in this process
(what ``geonear bench`` times), then the same query through a server started for it in
a process of its own (``geonear serve --engine NAME --memory-only`` on a free loopback
port), asked by the Python client. The server reports where its time went in the
call's trailing metadata (``geonear-timing``, see ``geonear.wire.parse_timing``); the
client side adds what it spent receiving, decoding and converting. The gap between the
first line and the last is what the service costs. CPU seconds are counted too, in
this process and in the server's: where client and server share a few cores, the served
call's CPU over the cores is a floor on its wall time.

    geonear bench --served --n 1000 --queries 100000 -k 10 --engines cpu
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from geonear import Client
from geonear.bench.command import (
    DEFAULT_ENGINES,
    SERVED_ENGINES,
    BenchConfig,
    BenchData,
    make_data,
    synchroniser,
)
from geonear.service.engines import EngineUnavailable, create_engine
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import TIMING_KEY, messages_to_table, parse_timing, points_to_message

#: Seconds a server started for the run gets to listen.
START_TIMEOUT_S = 120.0


@dataclass
class ServedResult:
    """One engine's times, seconds (min over the repeats; the stages of the fastest call)."""

    engine: str
    status: str = "ok"
    reason: str = ""
    in_process_s: float | None = None
    served_s: float | None = None
    served_pandas_s: float | None = None
    served_per_query_s: float | None = None
    result_rows: int = 0
    result_bytes: int = 0
    #: CPU seconds a call, mean over the repeats and the warm-up call: the engine's call
    #: in this process, then the served call's in the server and in this client (all
    #: threads each).
    in_process_cpu_s: float | None = None
    server_cpu_s: float | None = None
    client_cpu_s: float | None = None
    server_stages: dict[str, float] = field(default_factory=dict)
    client_stages: dict[str, float] = field(default_factory=dict)

    @property
    def overhead(self) -> float | None:
        if self.in_process_s and self.served_s:
            return self.served_s / self.in_process_s
        return None


@dataclass(frozen=True)
class ServedProcess:
    """A ``geonear serve`` process started for a run: its target and process id."""

    target: str
    pid: int

    def cpu_s(self) -> float | None:
        """CPU seconds the server has used, user and system (Linux; None elsewhere)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def served_engine(
    engine: str, *, log_dir: Path | None = None, settings: Mapping[str, str] | None = None
) -> Iterator[str]:
    """A ``geonear serve`` process running ``engine`` on a free port; yields its target.

    ``settings`` are ``GEONEAR_*`` environment variables of the server (limits a run
    needs raised), on top of the query-point limit every bench server lifts.
    """
    with served_process(engine, log_dir=log_dir, settings=settings) as server:
        yield server.target


@contextlib.contextmanager
def served_process(
    engine: str,
    *,
    log_dir: Path | None = None,
    settings: Mapping[str, str] | None = None,
    cli: Sequence[str] | None = None,
) -> Iterator[ServedProcess]:
    """As :func:`served_engine`, yielding the process too (for its CPU time). ``cli``
    is the command that runs geonear's command line (``python -m geonear`` by default):
    a benchmark's own, which changes the server before it starts."""
    with contextlib.ExitStack() as stack:
        folder = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_path = folder / f"serve-{engine}.log"
        args = [
            *(cli or (sys.executable, "-m", "geonear")),
            *("serve", "--host", "127.0.0.1", "--port", "0"),
            *("--memory-only", "--engine", engine, "--no-request-log"),
        ]
        env = {**os.environ, "GEONEAR_MAX_QUERY_POINTS": str(10**8), **(settings or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            yield ServedProcess(_wait_listening(proc, log_path), proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_listening(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        text = log_path.read_text(errors="replace")
        line = next((ln for ln in text.splitlines() if "listening on" in ln), None)
        if line is not None:
            port = int(line.split()[-1].rsplit(":", 1)[1].rstrip(")"))
            return f"127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            raise EngineUnavailable(f"the server did not start: {text.strip()[-500:]}")
        time.sleep(0.05)


def _best(repeat: int, call: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of ``repeat`` calls after one warm-up call, and its result."""
    call()
    best_s, best_out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - start
        if seconds < best_s:
            best_s, best_out = seconds, out
    return best_s, best_out


def _query(client: Client, config: BenchConfig, data: BenchData, **kwargs: Any) -> Any:
    if config.op == "radius":
        return client.radius("bench", data.q_lat, data.q_lon, config.radius_m, **kwargs)
    return client.knn("bench", data.q_lat, data.q_lon, config.k, **kwargs)


def bench_served_engine(config: BenchConfig, data: BenchData, engine: str) -> ServedResult:
    """The in-process call, then the served one, for ``engine``."""
    row = ServedResult(engine)
    try:
        local = create_engine(engine)
        local.warm_up()
    except EngineUnavailable as exc:
        return ServedResult(engine, status="skipped", reason=str(exc))
    row.in_process_s, row.in_process_cpu_s = _in_process_s(config, data, local)
    with served_process(engine) as server, Client(server.target, timeout_s=600) as client:
        points = pa.table({"id": np.arange(data.lat.shape[0]), "lat": data.lat, "lon": data.lon})
        client.upload("bench", points)
        served_cpu_s = server.cpu_s()
        client_cpu_s = time.process_time()
        row.served_s, table = _best(
            config.repeat, lambda: _query(client, config, data, as_arrow=True)
        )
        calls = config.repeat + 1  # and the warm-up
        row.client_cpu_s = (time.process_time() - client_cpu_s) / calls
        served_cpu_after = server.cpu_s()
        if served_cpu_s is not None and served_cpu_after is not None:
            row.server_cpu_s = (served_cpu_after - served_cpu_s) / calls
        row.served_pandas_s, _ = _best(config.repeat, lambda: _query(client, config, data))
        row.served_per_query_s, _ = _best(
            config.repeat,
            lambda: _query(client, config, data, as_arrow=True, layout="per_query"),
        )
        stub = pb_grpc.GeoNearStub(client._channel)
        _, (row.server_stages, row.client_stages) = _best(
            config.repeat, lambda: _staged_call(stub, config, data)
        )
    row.result_rows = table.num_rows
    row.result_bytes = table.nbytes
    return row


def _in_process_s(config: BenchConfig, data: BenchData, engine: Any) -> tuple[float, float]:
    """The engine's own call, fastest of the repeats, and its mean CPU seconds (the
    index is freed on return)."""
    index = engine.build_index(data.lat, data.lon)
    sync = synchroniser(engine)

    def call() -> Any:
        sync()
        out: Any = (
            index.radius(data.q_lat, data.q_lon, config.radius_m)
            if config.op == "radius"
            else index.knn(data.q_lat, data.q_lon, config.k)
        )
        sync()
        return out

    cpu_s = time.process_time()
    best_s = _best(config.repeat, call)[0]
    return best_s, (time.process_time() - cpu_s) / (config.repeat + 1)


def _staged_call(
    stub: pb_grpc.GeoNearStub, config: BenchConfig, data: BenchData
) -> tuple[dict[str, float], dict[str, float]]:
    """One Knn/Radius call of the whole query set on a plain stub (rows layout): the
    server's stages, then the client's."""
    client: dict[str, float] = {}
    start = time.perf_counter()
    points = points_to_message(data.q_lat, data.q_lon)
    if config.op == "radius":
        call = stub.Radius(
            pb.RadiusRequest(dataset="bench", queries=points, radius_m=config.radius_m)
        )
    else:
        call = stub.Knn(pb.KnnRequest(dataset="bench", queries=points, k=config.k))
    client["encode request"] = time.perf_counter() - start
    table, server = received_with_stages(call, client)
    mark = time.perf_counter()
    table.to_pandas()
    client["to_pandas"] = time.perf_counter() - mark
    return server, client


def received_with_stages(call: Any, client: dict[str, float]) -> tuple[pa.Table, dict[str, float]]:
    """The answer of a started ArrowData-stream call, with the server's stages (its
    ``geonear-timing`` trailer); the client's "receive" and "decode Arrow" go in ``client``."""
    mark = time.perf_counter()
    messages = list(call)
    client["receive"] = time.perf_counter() - mark
    mark = time.perf_counter()
    table = messages_to_table(messages)
    client["decode Arrow"] = time.perf_counter() - mark
    server = parse_timing(dict(call.trailing_metadata() or ()).get(TIMING_KEY, ""))
    return table, server


def run_served(
    config: BenchConfig, progress: Callable[[str], None] = lambda _text: None
) -> dict[str, Any]:
    """Every engine of ``config``, in-process and served; a document for print/JSON."""
    if config.op not in ("knn", "radius"):
        raise ValueError(f"--served measures knn and radius, not {config.op}")
    if config.engines == DEFAULT_ENGINES:
        config = dataclasses.replace(config, engines=SERVED_ENGINES)
    data = make_data(config)
    rows = []
    for engine in config.engines:
        progress(engine)
        rows.append(bench_served_engine(config, data, engine))
    return {
        "config": config,
        "command": config.command() + " --served",
        "data": data.description,
        "results": rows,
    }


def print_served(doc: dict[str, Any], console: Any) -> None:
    """The run as two tables: totals per engine, then each stage's milliseconds."""
    from rich.table import Table

    totals = Table(title=f"{doc['data']}: in-process vs served", title_justify="left")
    names = (
        *("engine", "in-process ms", "served ms", "x"),
        *("+ pandas ms", "per-query ms", "rows", "MB"),
    )
    for name in names:
        totals.add_column(name, justify="left" if name == "engine" else "right")
    for r in doc["results"]:
        if r.status != "ok":
            totals.add_row(r.engine, r.status, *[""] * (len(names) - 2))
            console.print(f"{r.engine}: {r.reason}")
            continue
        totals.add_row(
            r.engine,
            f"{r.in_process_s * 1e3:.1f}",
            f"{r.served_s * 1e3:.1f}",
            f"{r.overhead:.2f}",
            f"{r.served_pandas_s * 1e3:.1f}",
            f"{r.served_per_query_s * 1e3:.1f}",
            f"{r.result_rows:,}",
            f"{r.result_bytes / 1e6:.1f}",
        )
    console.print(totals)
    ok = [r for r in doc["results"] if r.status == "ok"]
    if any(r.server_cpu_s is not None for r in ok):
        cpu = Table(title="CPU ms a call (all threads): where the cores went", title_justify="left")
        for name in ("engine", "in-process", "server", "client", "served / in-process"):
            cpu.add_column(name, justify="left" if name == "engine" else "right")
        for r in ok:
            if r.server_cpu_s is None or r.in_process_cpu_s is None or r.client_cpu_s is None:
                continue
            served = r.server_cpu_s + r.client_cpu_s
            cpu.add_row(
                r.engine,
                f"{r.in_process_cpu_s * 1e3:.0f}",
                f"{r.server_cpu_s * 1e3:.0f}",
                f"{r.client_cpu_s * 1e3:.0f}",
                f"{served / r.in_process_cpu_s:.2f}" if r.in_process_cpu_s else "",
            )
        console.print(cpu)
    stages = list(dict.fromkeys(s for r in ok for s in (*r.server_stages, *r.client_stages)))
    if not stages:
        return
    breakdown = Table(title="stages, ms (server, then client)", title_justify="left")
    breakdown.add_column("stage")
    for r in ok:
        breakdown.add_column(r.engine, justify="right")
    for stage in stages:
        cells = []
        for r in ok:
            value = r.server_stages.get(stage, r.client_stages.get(stage))
            cells.append("" if value is None else f"{value * 1e3:.1f}")
        breakdown.add_row(stage, *cells)
    console.print(breakdown)
    console.print(f"reproduce: {doc['command']}")
