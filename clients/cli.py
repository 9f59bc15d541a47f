"""The ``geonear`` command line.

``geonear serve`` runs the server; the other commands talk to one at ``--target``
(default localhost:50051) and print readable tables. Errors print one line and exit
non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from geonear.clients.client import DEFAULT_TARGET, Client
from geonear.clients.errors import GeoNearError

_console = Console()


def _print_frame(frame: pd.DataFrame, title: str | None = None) -> None:
    table = Table(title=title)
    for name in frame.columns:
        table.add_column(str(name), justify="right" if frame[name].dtype.kind in "iuf" else "left")
    for row in frame.itertuples(index=False):
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row])
    _console.print(table)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


# -- serve -----------------------------------------------------------------------------
def _add_serve(sub: Any) -> None:
    from geonear.service.settings import Limits

    p = sub.add_parser(
        "serve",
        help="run the gRPC server",
        description="Run the geonear server. Settings also come from "
        "GEONEAR_* environment variables.",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 50051; 0 picks a free one)")
    p.add_argument("--data-dir", help="directory where datasets persist (default ./geonear-data)")
    p.add_argument("--memory-only", action="store_true", help="keep datasets in memory only")
    p.add_argument("--backend", choices=["auto", "cpu", "gpu"], help="default auto")
    p.add_argument("--engine", help="engine overriding the backend's (sklearn, numpy-brute, ...)")
    p.add_argument("--earth-radius-m", type=float, help="sphere radius (default 6371008.8)")
    p.add_argument("--max-workers", type=int, help="threads serving RPCs (default 16)")
    p.add_argument(
        "--demo",
        action="store_true",
        default=None,
        help="load the bundled airports and cities data sets at start",
    )
    batching = p.add_argument_group("dynamic batching of concurrent KNN/radius requests")
    batching.add_argument(
        "--no-batching",
        action="store_false",
        dest="batching",
        default=None,
        help="one engine call per request",
    )
    batching.add_argument("--batch-max-points", type=int, help="query points per batch (8192)")
    batching.add_argument(
        "--batch-max-delay-us",
        type=int,
        help="wait for more requests after the first, µs (0: take what is queued)",
    )
    scale = p.add_argument_group("GPU memory and scale-out")
    scale.add_argument(
        "--gpu-pool-size-bytes",
        type=int,
        help="GPU pool size, also its limit (default half the free memory, growing)",
    )
    scale.add_argument(
        "--managed-memory",
        action="store_true",
        default=None,
        help="managed memory pool for sets larger than the card (slower)",
    )
    scale.add_argument(
        "--processes",
        type=int,
        help="worker processes on one port (SO_REUSEPORT), each holding every dataset; "
        "datasets are read-only while several serve",
    )
    scale.add_argument("--dask-scheduler", help="partition datasets over this Dask scheduler")
    scale.add_argument(
        "--dask-local-workers", type=int, help="start a local Dask cluster of N workers"
    )
    security = p.add_argument_group("security")
    security.add_argument("--tls-cert", help="PEM certificate chain of the server (with --tls-key)")
    security.add_argument("--tls-key", help="PEM private key of the server")
    security.add_argument(
        "--tls-client-ca", help="PEM CA bundle: clients must present a certificate it signed"
    )
    security.add_argument(
        "--auth-tokens", help="file of bearer tokens, lines 'read|admin TOKEN [name]'"
    )
    limits = p.add_argument_group("limits (RESOURCE_EXHAUSTED beyond them)")
    for name, field in Limits.model_fields.items():
        limits.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            dest=f"limit_{name}",
            help=f"{field.description} (GEONEAR_{name.upper()}, default {field.default})",
        )
    ops = p.add_argument_group("observability")
    ops.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    ops.add_argument(
        "--no-request-log",
        action="store_false",
        dest="log_requests",
        default=None,
        help="no log line per request",
    )
    ops.add_argument(
        "--shutdown-grace-s", type=float, help="seconds calls in flight get at shutdown (5)"
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import pydantic

    from geonear.service.auth import TokenFileError
    from geonear.service.server import serve
    from geonear.service.settings import Limits, ServerSettings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    given = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "data_dir": args.data_dir,
            "backend": args.backend,
            "engine": args.engine,
            "earth_radius_m": args.earth_radius_m,
            "max_workers": args.max_workers,
            "demo": args.demo,
            "tls_cert": args.tls_cert,
            "tls_key": args.tls_key,
            "tls_client_ca": args.tls_client_ca,
            "auth_tokens": args.auth_tokens,
            "metrics_port": args.metrics_port,
            "log_requests": args.log_requests,
            "shutdown_grace_s": args.shutdown_grace_s,
            "batching": args.batching,
            "batch_max_points": args.batch_max_points,
            "batch_max_delay_us": args.batch_max_delay_us,
            "gpu_pool_size_bytes": args.gpu_pool_size_bytes,
            "managed_memory": args.managed_memory,
            "processes": args.processes,
            "dask_scheduler": args.dask_scheduler,
            "dask_local_workers": args.dask_local_workers,
        }.items()
        if v is not None
    }
    if args.memory_only:
        given["data_dir"] = None
    limits = {
        name: getattr(args, f"limit_{name}")
        for name in Limits.model_fields
        if getattr(args, f"limit_{name}") is not None
    }
    try:
        settings = ServerSettings(**given, limits=Limits(**limits))
        serve(settings)
    except (TokenFileError, pydantic.ValidationError) as exc:
        raise ValueError(str(exc)) from exc
    return 0


# -- client commands -------------------------------------------------------------------
def _client_parser(sub: Any, name: str, help: str, func: Callable[..., int]) -> Any:
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("--target", default=DEFAULT_TARGET, help="server host:port")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of the call")
    p.add_argument("--tls", action="store_true", help="use TLS, trusting the system's CAs")
    p.add_argument("--tls-ca", help="PEM CA bundle that signed the server's certificate")
    p.add_argument("--tls-cert", help="PEM client certificate, for mutual TLS")
    p.add_argument("--tls-key", help="PEM client key, for mutual TLS")
    p.add_argument("--tls-server-name", help="name to verify in the server's certificate")
    p.add_argument(
        "--token",
        default=os.environ.get("GEONEAR_TOKEN"),
        help="bearer token (default: the GEONEAR_TOKEN environment variable)",
    )
    p.set_defaults(func=func)
    return p


def _datasets(client: Client, args: argparse.Namespace) -> int:
    rows = [
        {
            "name": d.name,
            "version": d.version,
            "rows": d.rows,
            "host_bytes": d.host_bytes,
            "device_bytes": d.device_bytes,
            "engine": d.engine,
        }
        for d in client.datasets()
    ]
    _print_frame(
        pd.DataFrame(
            rows, columns=["name", "version", "rows", "host_bytes", "device_bytes", "engine"]
        ),
        "datasets",
    )
    return 0


def _info(client: Client, args: argparse.Namespace) -> int:
    d = client.info(args.name)
    b = d.bounding_box
    _console.print(
        f"[bold]{d.name}[/] version {d.version}: {d.rows} rows, engine {d.engine}, "
        f"ids {d.id_type}\n  host bytes {d.host_bytes}, device bytes "
        f"{d.device_bytes}\n  bounding box lat [{b.min_lat}, {b.max_lat}] lon "
        f"[{b.min_lon}, {b.max_lon}]\n  columns: "
        + ", ".join(f"{c.name} ({c.arrow_type})" for c in d.columns)
    )
    return 0


def _drop(client: Client, args: argparse.Namespace) -> int:
    version = client.drop(args.name)
    _console.print(f"dropped {args.name} (version {version})")
    return 0


def _add_points(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lat", type=_floats, help="latitude(s), degrees, comma-separated")
    p.add_argument("--lon", type=_floats, help="longitude(s), degrees")
    p.add_argument(
        "--queries",
        metavar="FILE",
        help="query points from a file (CSV, Parquet, Arrow, GeoJSON, GeoParquet; "
        "lat/lon columns detected) instead of --lat/--lon",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the results to FILE (.parquet, .csv or .arrow; a matrix also "
        ".npy) instead of printing them",
    )
    p.add_argument("--columns", default="", help="attribute columns to add, comma-separated")


def _query_points(args: argparse.Namespace) -> tuple[Any, Any]:
    """(lat, lon) of --queries FILE or of --lat/--lon."""
    if args.queries:
        if args.lat is not None or args.lon is not None:
            raise ValueError("give --queries or --lat/--lon, not both")
        from geonear.loaders import read_query_points

        return read_query_points(args.queries)
    if args.lat is None or args.lon is None:
        raise ValueError("give query points with --lat and --lon, or --queries FILE")
    return args.lat, args.lon


def _write_or_print(frame: pd.DataFrame, args: argparse.Namespace, title: str) -> None:
    if args.out:
        from geonear.loaders import write_table

        rows = write_table(frame, args.out)
        _console.print(f"wrote {rows} rows to {args.out}")
    else:
        _print_frame(frame, title)


def _columns(args: argparse.Namespace) -> list[str]:
    return [c for c in args.columns.split(",") if c]


def _knn(client: Client, args: argparse.Namespace) -> int:
    lat, lon = _query_points(args)
    frame = client.knn(
        args.name, lat, lon, k=args.k, max_distance_m=args.max_distance_m, columns=_columns(args)
    )
    _write_or_print(frame, args, f"{args.k} nearest in {args.name}")
    return 0


def _radius(client: Client, args: argparse.Namespace) -> int:
    lat, lon = _query_points(args)
    frame = client.radius(args.name, lat, lon, args.radius_m, columns=_columns(args))
    _write_or_print(frame, args, f"within {args.radius_m} m in {args.name}")
    return 0


def _matrix(client: Client, args: argparse.Namespace) -> int:
    if args.name is None and args.lat2 is None:
        raise ValueError("give a dataset NAME or --lat2/--lon2")
    lat, lon = _query_points(args)
    m = client.distance_matrix(
        lat, lon, name=args.name, lat2=args.lat2, lon2=args.lon2, dtype=args.dtype
    )
    if args.out and args.out.endswith(".npy"):
        np.save(args.out, m)
        _console.print(f"wrote a {m.shape[0]} x {m.shape[1]} {m.dtype} matrix to {args.out}")
    elif args.out:
        # Long form, one row per (query, column) pair: what Parquet/CSV readers expect.
        rows, cols = np.indices(m.shape)
        frame = pd.DataFrame(
            {"query_index": rows.ravel(), "column_index": cols.ravel(), "distance_m": m.ravel()}
        )
        _write_or_print(frame, args, "distance matrix, metres")
    else:
        _print_frame(
            pd.DataFrame(m, columns=[f"col {j}" for j in range(m.shape[1])]),
            "distance matrix, metres",
        )
    return 0


def _kmeans(client: Client, args: argparse.Namespace) -> int:
    out = client.kmeans(
        args.name,
        args.k,
        seed=args.seed,
        n_init=args.n_init,
        max_iter=args.max_iter,
        tol=args.tol,
        weights=args.weights,
    )
    _print_frame(out.centroids, f"{args.k} clusters of {args.name}")
    _console.print(f"inertia {out.inertia_m2:.6g} m^2 after {out.n_iter} iterations")
    return 0


def _server_info(client: Client, args: argparse.Namespace) -> int:
    i = client.server_info()
    _console.print(
        f"geonear {i.version}: backend {i.backend} on {i.device}; earth radius "
        f"{i.earth_radius_m} m; engines {', '.join(i.engines)}"
    )
    _console.print(str(i.limits).strip().replace("\n", "; "))
    return 0


def _run_client(func: Callable[[Client, argparse.Namespace], int]) -> Callable[..., int]:
    def run(args: argparse.Namespace) -> int:
        with Client(
            args.target,
            timeout_s=args.timeout_s,
            tls=args.tls,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            token=args.token,
            server_name=args.tls_server_name,
        ) as client:
            return func(client, args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geonear", description="geonear: geospatial nearest-neighbour analytics over gRPC."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _client_parser(sub, "datasets", "list the datasets", _run_client(_datasets))
    _client_parser(
        sub,
        "server-info",
        "show the server's version, backend and limits",
        _run_client(_server_info),
    )
    for name, help_text, func in (
        ("info", "describe a dataset", _info),
        ("drop", "drop a dataset", _drop),
    ):
        _client_parser(sub, name, help_text, _run_client(func)).add_argument("name")
    p = _client_parser(sub, "knn", "k nearest neighbours of query points", _run_client(_knn))
    p.add_argument("name")
    _add_points(p)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--max-distance-m", type=float, default=None)
    p = _client_parser(
        sub, "radius", "points within a radius of query points", _run_client(_radius)
    )
    p.add_argument("name")
    _add_points(p)
    p.add_argument("--radius-m", type=float, required=True)
    p = _client_parser(sub, "matrix", "great-circle distance matrix, metres", _run_client(_matrix))
    p.add_argument("name", nargs="?", default=None, help="dataset for the columns")
    _add_points(p)
    p.add_argument("--lat2", type=_floats, help="column latitudes (instead of a dataset)")
    p.add_argument("--lon2", type=_floats, help="column longitudes")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p = _client_parser(sub, "kmeans", "spherical k-means of a dataset", _run_client(_kmeans))
    p.add_argument("name")
    p.add_argument("-k", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-init", type=int, default=1)
    p.add_argument("--max-iter", type=int, default=100)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--weights", default=None, help="numeric column holding point weights")
    _add_tool_commands(sub)
    return parser


def _add_tool_commands(sub: Any) -> None:
    """Commands whose modules live beside this one: bench, load test, loaders."""
    from geonear.clients import bench, loadtest
    from geonear.loaders import cli as loaders_cli

    commands: tuple[tuple[str, str, Callable[..., None], Callable[..., int]], ...] = (
        (
            "bench",
            "compare engines in one process on the same data",
            bench.add_arguments,
            bench.run,
        ),
        (
            "loadtest",
            "drive running servers and report latency and throughput",
            loadtest.add_loadtest_arguments,
            loadtest.run_loadtest,
        ),
        (
            "load",
            "load a file or bundled data set into a server",
            loaders_cli.add_load_arguments,
            loaders_cli.run_load,
        ),
        (
            "generate",
            "write a synthetic point set to a file",
            loaders_cli.add_generate_arguments,
            loaders_cli.run_generate,
        ),
    )
    for command, help_text, add_arguments, run in commands:
        p = sub.add_parser(command, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GeoNearError as exc:
        print(f"geonear: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"geonear: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
