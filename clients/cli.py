"""The ``geonear`` command line.

``geonear serve`` runs the server; the other commands talk to one at ``--target``
(default: GEONEAR_TARGET, else localhost:50051) and print readable tables, or write
whole results with ``--out FILE``. Errors print one line in the command line's own
words and exit non-zero: 1 for a refusal by the server, 2 for a bad command or setting.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table

from geonear.clients.cli_options import (
    HelpFormatter,
    add_connection_arguments,
    connection_options,
)
from geonear.clients.client import Client
from geonear.clients.errors import GeoNearError
from geonear.clients.filters import where_from_arguments

_console = Console()
#: Rows printed unless --limit or --all says otherwise.
PRINT_ROWS = 20
#: Widest distance matrix printed; wider ones go to --out.
PRINT_MATRIX_COLUMNS = 12
_OUT_HINT = "use --out FILE (.parquet, .csv or .arrow)"


# -- printing ----------------------------------------------------------------------------
def _cell(value: Any) -> str:
    """One printed value; missing ones (None, NaN, pandas' NA) as ``<NA>``, as pandas shows."""
    if value is None or (pd.api.types.is_scalar(value) and pd.isna(value)):
        return "<NA>"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _print_frame(frame: pd.DataFrame, title: str | None = None, limit: int | None = None) -> None:
    """A table of the first ``limit`` rows (all when None), then how many are left out."""
    shown = frame if limit is None or len(frame) <= limit else frame.iloc[:limit]
    table = Table(title=title)
    for name in frame.columns:
        table.add_column(str(name), justify="right" if frame[name].dtype.kind in "iuf" else "left")
    for row in shown.itertuples(index=False):
        table.add_row(*[_cell(v) for v in row])
    _console.print(table)
    left = len(frame) - len(shown)
    if left:
        _console.print(
            f"{left:,} more rows: {_OUT_HINT}, or --limit N / --all to print more",
            highlight=False,
        )


def _limit(args: argparse.Namespace) -> int | None:
    if getattr(args, "all", False):
        return None
    return int(args.limit)


def _floats(text: str) -> list[float]:
    """Comma-separated degrees: ``51.47,40.64``."""
    values = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a number: use a decimal point (40.7); separate "
                "several points with commas"
            ) from None
    return values


# -- serve -----------------------------------------------------------------------------
def _add_serve(sub: Any) -> None:
    from geonear.service.settings import Limits

    p = sub.add_parser(
        "serve",
        help="run the gRPC server",
        description="Run the geonear server. Settings also come from "
        "GEONEAR_* environment variables. A setting that cannot work (a port in use, "
        "--backend gpu without a GPU) stops it at once, before any data is loaded.",
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
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=_serve)


def _setting_flag(location: Sequence[Any]) -> str:
    """``--max-k / GEONEAR_MAX_K`` for a settings field's location."""
    name = str(location[-1]) if location else "settings"
    return f"--{name.replace('_', '-')} / GEONEAR_{name.upper()}"


def _settings_error(exc: Any) -> str:
    """A pydantic ValidationError as one line naming the flags."""
    parts = []
    for error in exc.errors():
        location = [str(p) for p in error.get("loc", ())]
        message = str(error.get("msg", "invalid"))
        value = error.get("input")
        if location:
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            parts.append(f"{_setting_flag(location)}: {message}{shown}")
        else:
            parts.append(message.removeprefix("Value error, "))
    return "bad setting: " + "; ".join(parts)


def _port_problem(host: str, port: int, what: str) -> str | None:
    """Why ``host:port`` cannot be bound now, or None. Port 0 always binds."""
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"cannot bind {host}:{port}: {host!r} is not a known address ({exc.strerror})"
    failures: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port left in TIME_WAIT by an earlier server is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                failures.append(exc)
    codes = {exc.errno for exc in failures}
    if errno.EADDRINUSE in codes:
        return (
            f"{what} {port} on {host} is in use (is another geonear serve running?); "
            "choose another with --port, or --port 0 for a free one"
        )
    if errno.EACCES in codes:
        return f"no permission to bind {what} {port} on {host}; use a port above 1023"
    if failures and len(failures) == len(addresses):
        # gRPC binds what it can of a name (localhost without IPv6 is fine); none is not.
        if codes <= {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT}:
            return f"cannot bind {host}: not an address of this machine (--host)"
        return f"cannot bind {host}:{port}: {failures[0].strerror}"
    return None


def _data_dir_problem(path: Path | None) -> str | None:
    if path is None:
        return None
    if path.exists() and not path.is_dir():
        return f"--data-dir {path} is a file, not a directory"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--data-dir {path}: no permission to write in {existing}"
    return None


def _startup_problem(settings: Any) -> str | None:
    """Why the server cannot start with ``settings``, found before anything is loaded.

    Checked: the engine and backend are available here, the data directory can be
    written, the port (and metrics port) can be bound, the TLS and token files read.
    """
    from geonear.service.engines import ENGINES, gpu_available

    if settings.engine is not None and settings.engine not in ENGINES:
        return f"unknown --engine {settings.engine!r}; choose one of {', '.join(ENGINES)}"
    wants_gpu = settings.backend == "gpu" or (
        settings.engine is not None and ENGINES[settings.engine].device_kind == "gpu"
    )
    if wants_gpu:
        ok, why = gpu_available()
        if not ok:
            asked = "--backend gpu" if settings.backend == "gpu" else f"--engine {settings.engine}"
            return f"{asked} needs a working GPU, but {why}; use --backend cpu or auto"
    for flag, path in (
        ("--tls-cert", settings.tls_cert),
        ("--tls-key", settings.tls_key),
        ("--tls-client-ca", settings.tls_client_ca),
        ("--auth-tokens", settings.auth_tokens),
    ):
        if path is not None and not os.access(path, os.R_OK):
            return f"{flag} {path}: cannot read the file"
    if settings.auth_tokens is not None:
        from geonear.service.auth import load_tokens

        load_tokens(settings.auth_tokens)  # raises TokenFileError naming the line
    problem = _data_dir_problem(settings.data_dir)
    if problem:
        return problem
    problem = _port_problem(settings.host, settings.port, "port")
    if problem is None and settings.metrics_port:
        problem = _port_problem(settings.host, settings.metrics_port, "--metrics-port")
    return problem


def _serve(args: argparse.Namespace) -> int:
    import pydantic

    from geonear.service.auth import TokenFileError
    from geonear.service.engines import EngineUnavailable
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
        problem = _startup_problem(settings)
    except pydantic.ValidationError as exc:
        raise ValueError(_settings_error(exc)) from exc
    except TokenFileError as exc:
        raise ValueError(str(exc)) from exc
    if problem:
        raise ValueError(problem)
    try:
        serve(settings)
    except EngineUnavailable as exc:
        raise ValueError(str(exc)) from exc
    except RuntimeError as exc:
        # Another process took the port between the check above and the bind.
        if "bind" not in str(exc):
            raise
        raise OSError(str(exc).split(";")[0]) from exc
    return 0


# -- client commands -------------------------------------------------------------------
def _client_parser(sub: Any, name: str, help: str, func: Callable[..., int]) -> Any:
    p = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
    add_connection_arguments(p)
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of the call, seconds")
    p.set_defaults(func=func)
    return p


def _add_output(p: argparse.ArgumentParser, what: str = "the results") -> None:
    p.add_argument(
        "--out",
        metavar="FILE",
        help=f"write {what} to FILE (.parquet, .csv or .arrow) instead of printing them",
    )
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--limit", type=int, default=PRINT_ROWS, metavar="N", help="rows to print")
    shown.add_argument("--all", action="store_true", help="print every row")


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
    p.add_argument(
        "--lat",
        type=_floats,
        metavar="DEGREES",
        help="query latitude(s), comma-separated: 51.47,40.64",
    )
    p.add_argument(
        "--lon",
        type=_floats,
        metavar="DEGREES",
        help="query longitude(s); a list that starts with a minus: --lon=-0.45,-73.78",
    )
    p.add_argument(
        "--queries",
        metavar="FILE",
        help="query points from a file (CSV, Parquet, Arrow, GeoJSON, GeoParquet; "
        "lat/lon columns detected) instead of --lat/--lon; its columns come along in "
        "the results (query_NAME where a name is taken, and query_lat, query_lon)",
    )


def _add_columns(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--columns",
        default="",
        metavar="NAMES",
        help="dataset attribute columns to add, comma-separated",
    )


class _WhereAction(argparse.Action):
    """``--where`` and ``--or-where`` append to one list, in command-line order."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        items.append(("or" if option == "--or-where" else "and", str(values)))
        setattr(namespace, self.dest, items)


def _add_where(p: argparse.ArgumentParser, what: str = "search only the points") -> None:
    p.add_argument(
        "--where",
        action=_WhereAction,
        dest="where",
        metavar="EXPR",
        help=f"{what} where EXPR holds: COLUMN OP VALUE with OP one of ==, "
        "!=, <, <=, >, >=, in, not in, e.g. \"country == 'FR'\", 'pop >= 10000', "
        "\"kind in ('a', 'b')\"; repeat to AND them (default: every point)",
    )
    p.add_argument(
        "--or-where",
        action=_WhereAction,
        dest="where",
        metavar="EXPR",
        help="start another group of --where conditions, ORed with the ones before: "
        "--where A --where B --or-where C reads (A and B) or C",
    )


def _where(args: argparse.Namespace) -> Any:
    return where_from_arguments(getattr(args, "where", None))


_BBOX_HELP = (
    "a box, degrees, bounds included; MIN_LON > MAX_LON crosses the antimeridian; "
    "one that starts with a minus: {flag}=-10,170,10,-170"
)
_POLYGON_HELP = (
    "a GeoJSON Polygon or MultiPolygon (or a Feature of one), a file or the text itself; "
    "edges are great-circle arcs and the boundary is inside"
)


def _add_selection(p: argparse.ArgumentParser, what: str = "search only the points") -> None:
    """``--where``/``--or-where`` and ``--within-bbox``/``--within-polygon``, ANDed."""
    _add_where(p, what)
    _add_within(p, what)


def _add_within(p: argparse.ArgumentParser, what: str = "search only the points") -> None:
    p.add_argument(
        "--within-bbox",
        type=_floats,
        metavar="MIN_LAT,MIN_LON,MAX_LAT,MAX_LON",
        help=f"{what} in this box (and matching --where): "
        + _BBOX_HELP.format(flag="--within-bbox"),
    )
    p.add_argument(
        "--within-polygon",
        metavar="FILE_OR_GEOJSON",
        help=f"{what} in this polygon (and matching --where): {_POLYGON_HELP}",
    )


def _bbox(values: list[float], flag: str) -> list[float]:
    if len(values) != 4:
        raise ValueError(
            f"{flag} takes 4 numbers, MIN_LAT,MIN_LON,MAX_LAT,MAX_LON; got {len(values)}"
        )
    return values


def _polygon(text: str) -> str:
    """GeoJSON given on the command line, or read from the file it names."""
    if text.lstrip().startswith("{"):
        return text
    return Path(text).read_text(encoding="utf-8")


def _within_area(args: argparse.Namespace) -> Any:
    """The area of --within-bbox or --within-polygon, for ``within=``; None without."""
    bbox, polygon = args.within_bbox, args.within_polygon
    if bbox is not None and polygon is not None:
        raise ValueError("give --within-bbox or --within-polygon, not both")
    if bbox is not None:
        return tuple(_bbox(bbox, "--within-bbox"))
    return None if polygon is None else _polygon(polygon)


def _query_points(args: argparse.Namespace) -> tuple[Any, Any]:
    """(queries, None) for --queries FILE, else (lat, lon) of --lat/--lon."""
    if args.queries:
        if args.lat is not None or args.lon is not None:
            raise ValueError("give --queries or --lat/--lon, not both")
        from geonear.loaders import read_query_frame

        return read_query_frame(args.queries), None
    if args.lat is None or args.lon is None:
        raise ValueError("give query points with --lat and --lon, or --queries FILE")
    if len(args.lat) != len(args.lon):
        raise ValueError(
            f"--lat has {len(args.lat)} values and --lon {len(args.lon)}: give one "
            "longitude per latitude; use a decimal point (40.7); separate several points "
            "with commas"
        )
    return args.lat, args.lon


def _write_or_print(frame: pd.DataFrame, args: argparse.Namespace, title: str) -> None:
    if args.out:
        from geonear.loaders import write_table

        rows = write_table(frame.reset_index(drop=True), args.out)
        _console.print(f"wrote {rows} rows to {args.out}", highlight=False)
    else:
        _print_frame(frame.reset_index(drop=True), title, _limit(args))


def _columns(args: argparse.Namespace) -> list[str]:
    return [c.strip() for c in args.columns.split(",") if c.strip()]


def _knn(client: Client, args: argparse.Namespace) -> int:
    lat, lon = _query_points(args)
    frame = client.knn(
        args.name,
        lat,
        lon,
        k=args.k,
        max_distance_m=args.max_distance_m,
        where=_where(args),
        within=_within_area(args),
        columns=_columns(args),
        query_columns=True if lon is None else None,
    )
    _write_or_print(frame, args, f"{args.k} nearest in {args.name}")
    return 0


def _radius(client: Client, args: argparse.Namespace) -> int:
    lat, lon = _query_points(args)
    frame = client.radius(
        args.name,
        lat,
        lon,
        radius_m=args.radius_m,
        where=_where(args),
        within=_within_area(args),
        columns=_columns(args),
        query_columns=True if lon is None else None,
        max_per_query=args.max_per_query,
        sort=args.sort,
    )
    _write_or_print(frame, args, f"within {args.radius_m} m in {args.name}")
    return 0


def _names(text: str) -> list[str]:
    return [c.strip() for c in text.split(",") if c.strip()]


def _knn_join(client: Client, args: argparse.Namespace) -> int:
    frame = client.knn_join(
        args.left,
        args.right,
        args.k,
        max_distance_m=args.max_distance_m,
        where=_where(args),
        within=_within_area(args),
        left_columns=_names(args.left_columns),
        right_columns=_names(args.right_columns),
    )
    _write_or_print(frame, args, f"{args.k} nearest in {args.right} of each point of {args.left}")
    return 0


def _radius_join(client: Client, args: argparse.Namespace) -> int:
    frame = client.radius_join(
        args.left,
        args.right,
        args.radius_m,
        where=_where(args),
        within=_within_area(args),
        left_columns=_names(args.left_columns),
        right_columns=_names(args.right_columns),
    )
    _write_or_print(
        frame, args, f"points of {args.right} within {args.radius_m} m of each of {args.left}"
    )
    return 0


def _count_within(client: Client, args: argparse.Namespace) -> int:
    if args.left is not None:
        if args.queries or args.lat is not None or args.lon is not None:
            raise ValueError("give --left NAME or query points (--lat/--lon, --queries), not both")
        frame = client.count_within(
            args.name,
            left=args.left,
            radius_m=args.radius_m,
            where=_where(args),
            within=_within_area(args),
        )
        title = f"points of {args.name} within {args.radius_m} m of each of {args.left}"
    else:
        lat, lon = _query_points(args)
        frame = client.count_within(
            args.name, lat, lon, args.radius_m, where=_where(args), within=_within_area(args)
        )
        title = f"points of {args.name} within {args.radius_m} m"
    _write_or_print(frame, args, title)
    return 0


def _matrix(client: Client, args: argparse.Namespace) -> int:
    if args.name is None and args.lat2 is None:
        raise ValueError("give a dataset NAME or --lat2/--lon2")
    lat, lon = _query_points(args)
    where, within = _where(args), _within_area(args)
    selected = where is not None or within is not None
    if selected and args.name is None:
        raise ValueError("--where and --within-* select a dataset's points: give NAME")

    def check_printable(columns: int) -> None:
        # A matrix wider than a screen is no use printed.
        if not args.out and columns > PRINT_MATRIX_COLUMNS:
            raise ValueError(
                f"a {len(lat):,} x {columns:,} matrix is too wide to print (more than "
                f"{PRINT_MATRIX_COLUMNS} columns): {_OUT_HINT.replace('.arrow', '.arrow or .npy')}"
            )

    if not selected:  # refused before the work
        check_printable(client.info(args.name).rows if args.name is not None else len(args.lat2))
    m = client.distance_matrix(
        lat,
        lon,
        name=args.name,
        lat2=args.lat2,
        lon2=args.lon2,
        where=where,
        within=within,
        dtype=args.dtype,
    )
    check_printable(m.shape[1])
    if args.out and args.out.endswith(".npy"):
        np.save(args.out, m)
        _console.print(
            f"wrote a {m.shape[0]} x {m.shape[1]} {m.dtype} matrix to {args.out}", highlight=False
        )
    elif args.out:
        # Long form, one row per (query, column) pair: what Parquet/CSV readers expect.
        rows_i, cols_i = np.indices(m.shape)
        frame = pd.DataFrame(
            {
                "query_index": rows_i.ravel(),
                "column_index": cols_i.ravel(),
                "distance_m": m.ravel(),
            }
        )
        _write_or_print(frame, args, "distance matrix, metres")
    else:
        _print_frame(
            pd.DataFrame(m, columns=[f"col {j}" for j in range(m.shape[1])]),
            "distance matrix, metres",
            _limit(args),
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
        where=_where(args),
        within=_within_area(args),
        return_labels=bool(args.out),
    )
    _print_frame(out.centroids, f"{args.k} clusters of {args.name}", _limit(args))
    _console.print(f"inertia {out.inertia_m2:.6g} m^2 after {out.n_iter} iterations")
    if args.out:
        from geonear.loaders import write_table

        assert out.labels is not None
        rows = write_table(out.labels, args.out)
        _console.print(f"wrote {rows} labels (id, cluster) to {args.out}", highlight=False)
    return 0


def _dbscan(client: Client, args: argparse.Namespace) -> int:
    out = client.dbscan(
        args.name,
        args.eps_m,
        args.min_samples,
        where=_where(args),
        within=_within_area(args),
        return_labels=bool(args.out),
    )
    sizes = pd.DataFrame({"cluster": range(out.n_clusters), "size": list(out.sizes)})
    _print_frame(sizes, f"{out.n_clusters} clusters of {args.name}", _limit(args))
    _console.print(f"{out.n_noise} noise points", highlight=False)
    if args.out:
        from geonear.loaders import write_table

        assert out.labels is not None
        rows = write_table(out.labels, args.out)
        _console.print(f"wrote {rows} labels (id, cluster) to {args.out}", highlight=False)
    return 0


def _within(client: Client, args: argparse.Namespace) -> int:
    if (args.bbox is None) == (args.polygon is None):
        raise ValueError("give --bbox MIN_LAT,MIN_LON,MAX_LAT,MAX_LON or --polygon FILE")
    if args.bbox is not None:
        bbox = _bbox(args.bbox, "--bbox")
        frame = client.within(args.name, bbox=bbox, columns=_columns(args), where=_where(args))
        title = f"points of {args.name} in the box"
    else:
        frame = client.within(
            args.name, polygon=_polygon(args.polygon), columns=_columns(args), where=_where(args)
        )
        title = f"points of {args.name} in the polygon"
    _write_or_print(frame, args, title)
    return 0


def _server_info(client: Client, args: argparse.Namespace) -> int:
    i = client.server_info()
    _console.print(
        f"geonear {i.version}: backend {i.backend} on {i.device}; earth radius "
        f"{i.earth_radius_m} m; engines {', '.join(i.engines)}"
    )
    for e in i.engine_descriptions:
        _console.print(
            f"  {e.name} ({e.device_kind}): {', '.join(e.capabilities)}", highlight=False
        )
    _console.print(i.limits.describe(), highlight=False)
    return 0


def _run_client(func: Callable[[Client, argparse.Namespace], int]) -> Callable[..., int]:
    def run(args: argparse.Namespace) -> int:
        options = connection_options(args)
        with Client(
            options.target, timeout_s=args.timeout_s, **options.client_keywords()
        ) as client:
            return func(client, args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geonear",
        description="geonear: geospatial nearest-neighbour analytics over gRPC. Client "
        "commands reach the server at --target, default GEONEAR_TARGET or "
        "localhost:50051; GEONEAR_TOKEN and GEONEAR_TLS* set the token and TLS.",
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
        _client_parser(sub, name, help_text, _run_client(func)).add_argument(
            "name", help="dataset name"
        )
    p = _client_parser(sub, "knn", "k nearest neighbours of query points", _run_client(_knn))
    p.add_argument("name", help="dataset to search")
    _add_points(p)
    p.add_argument("-k", type=int, default=10, help="neighbours per query")
    p.add_argument(
        "--max-distance-m",
        type=float,
        default=None,
        metavar="METRES",
        help="leave out neighbours farther than this (default: no bound)",
    )
    _add_columns(p)
    _add_selection(p)
    _add_output(p)
    p = _client_parser(
        sub, "radius", "points within a radius of query points", _run_client(_radius)
    )
    p.add_argument("name", help="dataset to search")
    _add_points(p)
    p.add_argument(
        "--radius-m", type=float, required=True, metavar="METRES", help="search radius, metres"
    )
    p.add_argument(
        "--max-per-query",
        type=int,
        default=None,
        metavar="N",
        help="keep the first N points of each query in --sort order, like GEOSEARCH COUNT "
        "(applied by this client to what the server sends; default: all)",
    )
    p.add_argument(
        "--sort",
        choices=["asc", "desc"],
        default="asc",
        help="order of each query's points by distance",
    )
    _add_columns(p)
    _add_selection(p)
    _add_output(p)
    _add_join_commands(sub)
    p = _client_parser(sub, "matrix", "great-circle distance matrix, metres", _run_client(_matrix))
    p.add_argument("name", nargs="?", default=None, help="dataset whose points are the columns")
    _add_points(p)
    p.add_argument(
        "--lat2", type=_floats, metavar="DEGREES", help="column latitudes (instead of a dataset)"
    )
    p.add_argument("--lon2", type=_floats, metavar="DEGREES", help="column longitudes")
    p.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="float32 halves the bytes, about 1-4 m error",
    )
    _add_selection(p, "use as columns only the points of NAME (in row order)")
    _add_output(p, "the matrix (also .npy; Parquet/CSV/Arrow in long form)")
    p = _client_parser(sub, "kmeans", "spherical k-means of a dataset", _run_client(_kmeans))
    p.add_argument("name", help="dataset to cluster")
    p.add_argument("-k", type=int, required=True, help="number of clusters")
    p.add_argument("--seed", type=int, default=0, help="seed of the k-means++ initialisation")
    p.add_argument(
        "--n-init", type=int, default=1, help="initialisations run; the lowest inertia wins"
    )
    p.add_argument("--max-iter", type=int, default=100, help="most iterations of each run")
    p.add_argument(
        "--tol",
        type=float,
        default=1e-6,
        help="stop when no centroid moves more than this, radians",
    )
    p.add_argument("--weights", default=None, help="numeric column holding point weights")
    _add_selection(p, "cluster only the points")
    _add_output(p, "each clustered point's cluster (id, cluster)")
    _add_area_commands(sub)
    _add_tool_commands(sub)
    return parser


def _add_join_commands(sub: Any) -> None:
    """knn-join, radius-join and count-within: stored datasets queried in the server."""
    p = _client_parser(
        sub,
        "knn-join",
        "the k nearest points of RIGHT to every point of LEFT, both stored datasets",
        _run_client(_knn_join),
    )
    p.add_argument("left", help="dataset whose points are the queries")
    p.add_argument("right", help="dataset searched (may be LEFT itself)")
    p.add_argument("-k", type=int, default=1, help="neighbours per left point")
    p.add_argument(
        "--max-distance-m",
        type=float,
        default=None,
        metavar="METRES",
        help="leave out neighbours farther than this (default: no bound)",
    )
    _add_join_columns(p)
    _add_selection(p, "search only the points of RIGHT")
    _add_output(p)
    p = _client_parser(
        sub,
        "radius-join",
        "every point of RIGHT within a radius of each point of LEFT, both stored datasets",
        _run_client(_radius_join),
    )
    p.add_argument("left", help="dataset whose points are the queries")
    p.add_argument("right", help="dataset searched (may be LEFT itself)")
    p.add_argument(
        "--radius-m", type=float, required=True, metavar="METRES", help="search radius, metres"
    )
    _add_join_columns(p)
    _add_selection(p, "search only the points of RIGHT")
    _add_output(p)
    p = _client_parser(
        sub,
        "count-within",
        "how many points of a dataset lie within a radius of each query point, or of "
        "each point of another dataset (--left); only the counts are sent",
        _run_client(_count_within),
    )
    p.add_argument("name", help="dataset whose points are counted")
    _add_points(p)
    p.add_argument("--left", metavar="NAME", help="count around every point of this stored dataset")
    p.add_argument("--radius-m", type=float, required=True, metavar="METRES", help="radius, metres")
    _add_selection(p, "count only the points of NAME")
    _add_output(p)


def _add_area_commands(sub: Any) -> None:
    """dbscan and within: density clusters of a dataset, and its points in an area."""
    p = _client_parser(sub, "dbscan", "DBSCAN density clusters of a dataset", _run_client(_dbscan))
    p.add_argument("name", help="dataset to cluster")
    p.add_argument(
        "--eps-m",
        type=float,
        required=True,
        metavar="METRES",
        help="neighbourhood radius, great-circle metres",
    )
    p.add_argument(
        "--min-samples",
        type=int,
        required=True,
        metavar="N",
        help="points a neighbourhood needs (the point included) for a core point",
    )
    _add_selection(p, "cluster only the points")
    _add_output(p, "each clustered point's cluster (id, cluster; -1 noise)")
    p = _client_parser(
        sub,
        "within",
        "the points of a dataset inside a box or a polygon",
        _run_client(_within),
    )
    p.add_argument("name", help="dataset whose points are returned")
    p.add_argument(
        "--bbox",
        type=_floats,
        metavar="MIN_LAT,MIN_LON,MAX_LAT,MAX_LON",
        help=_BBOX_HELP.format(flag="--bbox"),
    )
    p.add_argument("--polygon", metavar="FILE_OR_GEOJSON", help=_POLYGON_HELP)
    _add_columns(p)
    _add_where(p, "return only the points")
    _add_output(p)


def _add_join_columns(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--left-columns",
        default="",
        metavar="NAMES",
        help="columns of LEFT to add, comma-separated (a name taken on both sides ends in _left)",
    )
    p.add_argument(
        "--right-columns",
        default="",
        metavar="NAMES",
        help="columns of RIGHT to add, comma-separated (a name taken on both sides ends in _right)",
    )


def _add_tool_commands(sub: Any) -> None:
    """Commands of the packages beside this one: bench, load test, loaders. This module
    is the only one that imports the bench and the load test (pyproject.toml's contracts)."""
    from geonear import bench, loadtest
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


#: API words in messages (the server's and the loaders') and the command line's for them.
_CLI_WORDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), words)
    for pattern, words in (
        (r"ListDatasets shows the names there are", "`geonear datasets` lists them"),
        (r"use mode replace or append", "use --mode replace or --mode append"),
        (r"(?<!-)\bmode (create|replace|append)\b", r"--mode \1"),
        (r"pass --format / format=", "pass --format"),
        (r"\bpass format=", "pass --format"),
        (r"name it with the (lat|lon|id)_column option", r"name it with --\1"),
        (r"(--[a-z-]+) / [a-z_]+=", r"\1"),
        (r" \((skip_invalid=True|id=False|id='COLUMN')\)", ""),
        (r"pass id=False / --row-ids", "pass --row-ids"),
        (r"\bmax_distance_m\b", "--max-distance-m"),
        (r"\bradius_m\b", "--radius-m"),
        (r"^where: ", "--where: "),
    )
)


def cli_message(text: str) -> str:
    """A message in the command line's words (``--mode replace``, not ``mode replace``)."""
    for pattern, words in _CLI_WORDS:
        text = pattern.sub(words, text)
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GeoNearError as exc:
        print(f"geonear: {exc.code.name}: {cli_message(exc.message)}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ImportError) as exc:
        print(f"geonear: {cli_message(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
