"""``geonear loadtest``: its arguments and what running it does.

Two forms share one parser::

    geonear loadtest --target HOST:PORT | --compare NAME=HOST:PORT ... [options]
    geonear loadtest report RESULTS.json ... [--html PATH] [--png PATH] [--json PATH]

The first drives the servers one after another (so they never compete for the load
generator's cores) and reports each; the second renders saved runs together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import time
from typing import Any

import grpc
from rich.console import Console

from geonear.clients.cli_options import (
    TARGET_VARIABLE,
    add_connection_arguments,
    connection_options,
)
from geonear.loadtest.connection import Connection
from geonear.loadtest.results import (
    client_description,
    read_results,
    summarise_run,
    write_results,
)
from geonear.loadtest.runner import LoadPlan, LoadTestError, ProgressSink, run_workers
from geonear.loadtest.scenarios import (
    SCENARIOS,
    PreparationFailed,
    ScenarioConfig,
    build_pool,
    drop_upload_scratch,
    prepare_target,
)

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


def _seconds(text: str) -> float:
    """A duration: plain seconds, or a number with ms, s, m or h (``30``, ``2m``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30, 30s, 2m)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _named_target(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name or not address or not _NAME.match(name):
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT, got {text!r}")
    return name, address


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value:g}")
    return value


def _add_outputs(p: Any) -> None:
    p.add_argument("--json", metavar="PATH", help="write the raw results (mergeable) here")
    p.add_argument(
        "--html", metavar="PATH", help="write one self-contained HTML report (table and plots) here"
    )
    p.add_argument("--png", metavar="PATH", help="write the report's plots as one PNG here")
    p.add_argument("--title", default="geonear loadtest", help="title of the reports")


def add_loadtest_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``geonear loadtest`` (and of its ``report`` sub-mode) on ``parser``."""
    parser.description = (
        "Drive running geonear servers over gRPC and report throughput, latency "
        "percentiles and errors. `geonear loadtest report a.json b.json --html out.html` "
        "renders saved runs together."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    modes = parser.add_subparsers(dest="loadtest_command", title="sub-mode", required=False)
    report = modes.add_parser(
        "report",
        help="render saved JSON results together",
        description="Render saved load-test results in one report.",
    )
    report.add_argument("results", nargs="+", metavar="RESULTS.json")
    report.add_argument(
        "--merge",
        action="store_true",
        help="combine runs with the same target name (load generators that "
        "ran in parallel) instead of showing them side by side",
    )
    _add_outputs(report)

    where = parser.add_argument_group("targets").add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="the server to drive (default: the GEONEAR_TARGET environment variable)",
    )
    where.add_argument(
        "--compare",
        nargs="+",
        type=_named_target,
        metavar="NAME=HOST:PORT",
        help="several named servers, driven one after another",
    )

    what = parser.add_argument_group("what to send")
    what.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="knn",
        help="ping is gRPC health Check, the ceiling (default knn)",
    )
    what.add_argument("--dataset", default="loadtest", help="dataset to query (default loadtest)")
    what.add_argument(
        "--create-dataset",
        type=int,
        default=0,
        metavar="N",
        help="when the dataset is missing, upload N uniform points first",
    )
    what.add_argument(
        "--batch",
        type=_positive_int,
        default=1,
        help="query points per request (upload: rows per upload; default 1)",
    )
    what.add_argument(
        "-k",
        type=_positive_int,
        default=10,
        help="neighbours per query (kmeans: clusters; default 10)",
    )
    what.add_argument(
        "--radius-m",
        type=float,
        default=5_000.0,
        help="radius of the radius scenario, metres (default 5000)",
    )
    what.add_argument(
        "--matrix-targets",
        type=int,
        default=0,
        metavar="N",
        help="matrix columns: N inline points instead of the dataset",
    )
    what.add_argument("--kmeans-max-iter", type=_positive_int, default=20)
    what.add_argument("--seed", type=int, default=0, help="seed of the query points")

    how = parser.add_argument_group("how hard and how long")
    loop = how.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="N",
        help="closed loop: N requests in flight at all times (default 16)",
    )
    loop.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="open loop: R requests/s on a constant schedule, latency measured "
        "from the scheduled time (coordinated-omission corrected)",
    )
    how.add_argument(
        "--duration", type=_seconds, default=10.0, help="measurement window (default 10s)"
    )
    how.add_argument(
        "--warmup",
        type=_seconds,
        default=2.0,
        help="load before the window, not recorded (default 2s)",
    )
    how.add_argument(
        "--processes",
        type=_positive_int,
        default=1,
        help="load-generator worker processes (default 1)",
    )
    how.add_argument(
        "--channels",
        type=_positive_int,
        default=1,
        help="gRPC channels (TCP connections) per process (default 1)",
    )
    how.add_argument("--timeout-s", type=float, default=30.0, help="deadline of each request")
    how.add_argument(
        "--max-error-rate",
        type=_fraction,
        default=0.0,
        metavar="FRACTION",
        help="exit with status 1 when more than this fraction of a target's requests "
        "fail (default 0: any failure)",
    )
    how.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=10_000,
        help="open loop: cap on outstanding requests per process",
    )

    add_connection_arguments(parser, target=False, title="TLS and tokens")

    out = parser.add_argument_group("output")
    _add_outputs(out)
    out.add_argument("--quiet", action="store_true", help="no live display and no summary table")


def run_loadtest(args: argparse.Namespace) -> int:
    """Run ``geonear loadtest`` (or its ``report`` sub-mode) as parsed; the exit status."""
    try:
        if getattr(args, "loadtest_command", None) == "report":
            return _report(args)
        return _run(args)
    except (LoadTestError, PreparationFailed) as exc:
        Console(stderr=True).print(f"geonear loadtest: {exc}", markup=False)
        return 2


def _report(args: argparse.Namespace) -> int:
    from geonear.loadtest.report import print_summary

    runs = read_results(args.results, merge=args.merge)
    print_summary(runs)
    _write_outputs(args, runs)
    return 0


def _write_outputs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    # Imported here, not at the top: every worker process imports this package, and
    # matplotlib would add half a second to each one's start.
    from geonear.loadtest.report import write_html, write_png

    if args.json:
        write_results(args.json, runs)
    if args.html:
        write_html(args.html, runs, args.title, client_description())
    if args.png:
        write_png(args.png, runs, args.title)


def _targets(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.compare:
        names = [name for name, _ in args.compare]
        if len(set(names)) != len(names):
            raise ValueError(f"--compare names must differ, got {names}")
        return list(args.compare)
    target = args.target or os.environ.get(TARGET_VARIABLE)
    if target:
        return [(target, target)]
    raise ValueError(
        "give --target HOST:PORT or --compare NAME=HOST:PORT ... "
        "(or `geonear loadtest report FILES`)"
    )


def _run(args: argparse.Namespace) -> int:
    targets = _targets(args)
    options = connection_options(args)
    connection = Connection.from_options(
        options.tls,
        options.tls_ca,
        options.tls_cert,
        options.tls_key,
        options.tls_server_name,
        options.token,
    )
    config = ScenarioConfig(
        scenario=args.scenario,
        dataset=args.dataset,
        batch=args.batch,
        k=args.k,
        radius_m=args.radius_m,
        matrix_targets=args.matrix_targets,
        kmeans_max_iter=args.kmeans_max_iter,
        seed=args.seed,
    )
    concurrency = args.concurrency if args.rate is None else None
    if concurrency is None and args.rate is None:
        concurrency = 16
    plan = LoadPlan(
        concurrency=concurrency,
        rate=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        processes=args.processes,
        channels=args.channels,
        timeout_s=args.timeout_s,
        max_in_flight=args.max_in_flight,
    )
    pool = build_pool(config)
    console = Console()
    errors = Console(stderr=True)
    live = not args.quiet and console.is_terminal
    runs = []
    progress: Any = ProgressSink()
    if live:
        from geonear.loadtest.progress import LiveProgress

        progress = LiveProgress(console)
    with progress if live else contextlib.nullcontext():
        for name, address in targets:
            prepared = asyncio.run(
                prepare_target(
                    address,
                    connection,
                    config,
                    create_rows=args.create_dataset,
                    timeout_s=max(600.0, args.timeout_s),
                )
            )
            for warning in prepared.warnings:
                errors.print(f"geonear loadtest: {warning}", markup=False, highlight=False)
            started = time.time()
            totals = run_workers(name, address, connection, pool, plan, progress)
            run = summarise_run(
                name,
                address,
                config.scenario,
                plan.mode,
                {**config.to_dict(), **plan.to_dict()},
                prepared.server,
                plan.duration_s,
                totals,
            )
            run["dataset"] = prepared.dataset
            run["started_unix_s"] = started
            if config.scenario == "upload":
                try:
                    asyncio.run(drop_upload_scratch(address, connection, config))
                except grpc.aio.AioRpcError as exc:
                    errors.print(
                        f"geonear loadtest: scratch datasets left at {address}: "
                        f"{exc.code().name}: {exc.details()}",
                        markup=False,
                    )
            progress.end(run)
            runs.append(run)
    if not args.quiet:
        from geonear.loadtest.report import print_summary

        print_summary(runs, console)
    _write_outputs(args, runs)
    return _error_status(runs, args.max_error_rate, errors)


def _error_status(runs: list[dict[str, Any]], max_rate: float, console: Console) -> int:
    """1, with the reason on stderr, when a target failed more requests than allowed."""
    status = 0
    for run in runs:
        failed = sum(run["errors"].values())
        if failed and failed > max_rate * run["requests"]:
            first = run.get("error_messages") or [{"code": "?", "message": ""}]
            console.print(
                f"geonear loadtest: {run['name']}: {failed:,} of {run['requests']:,} requests "
                f"failed ({failed / run['requests']:.1%}), more than --max-error-rate "
                f"{max_rate:g}; first: {first[0]['code']}: {first[0]['message']}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            status = 1
    return status
