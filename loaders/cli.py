"""``geonear load`` and ``geonear generate``.

``geonear load SOURCE --name NAME`` streams a file, glob, directory, ``-`` (standard
input, CSV unless ``--format`` or its first bytes say otherwise) or bundled data set
into a server in record batches, validating each on
the way; ``geonear generate --n N --out FILE`` writes a synthetic point set in chunks.
Both show a progress bar (rows, rows/s, time left) on a terminal and stay quiet
otherwise. The command line wires them in through ``add_*_arguments`` / ``run_*``.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from geonear.clients.cli_options import (
    HelpFormatter,
    add_connection_arguments,
    connection_options,
)
from geonear.loaders.bundled import DATA_SETS
from geonear.loaders.points import PointStream, upload_points
from geonear.loaders.readers import FORMATS
from geonear.loaders.source import BATCH_ROWS
from geonear.loaders.synthetic import write_points
from geonear.loaders.writers import WRITE_FORMATS


def _progress(console: Console) -> Progress:
    """A bar with rows, rows/s and time left; disabled when stderr is not a terminal."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[rows]:>12,} rows"),
        TextColumn("{task.fields[rate]:>10,.0f} rows/s"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=False,
    )


def _dataset_name(source: str) -> str:
    """A valid dataset name from a source: the bundled name or the file's stem."""
    if source in DATA_SETS:
        return source
    stem = Path(source.rstrip("/*")).name.split(".")[0] or "points"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:128]


# -- load ----------------------------------------------------------------------------------
def add_load_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.add_argument(
        "source",
        help="file, glob, directory, '-' (standard input: CSV unless --format says "
        f"otherwise) or a bundled data set ({', '.join(DATA_SETS)})",
    )
    p.add_argument("--name", help="dataset name (default: the bundled name or file stem)")
    p.add_argument("--lat", help="latitude column (default: detected: lat, latitude, y)")
    p.add_argument(
        "--lon", help="longitude column (default: detected: lon, lng, long, longitude, x)"
    )
    p.add_argument("--id", help="id column (default: detected: id, name, code; else row numbers)")
    p.add_argument(
        "--row-ids",
        action="store_true",
        help="number the rows as ids even if an id-like column exists",
    )
    p.add_argument(
        "--mode",
        choices=["create", "replace", "append"],
        default="create",
        help="create fails if the dataset exists",
    )
    p.add_argument(
        "--skip-invalid",
        action="store_true",
        help="drop rows with bad coordinates or ids instead of failing",
    )
    p.add_argument(
        "--format",
        choices=list(FORMATS),
        help="format of the source, standard input included (default: detected from the "
        "extension, else the first bytes)",
    )
    p.add_argument("--delimiter", help="CSV delimiter (default: detected)")
    p.add_argument("--batch-rows", type=int, default=BATCH_ROWS, help="rows per uploaded batch")
    add_connection_arguments(p, title="server")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of the upload")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")


def run_load(args: argparse.Namespace) -> int:
    from geonear.clients.client import Client

    if args.row_ids and args.id:
        raise ValueError("give --id or --row-ids, not both")
    name = args.name or _dataset_name(args.source)
    err = Console(stderr=True)
    progress = _progress(err)
    task: TaskID | None = None
    start = time.perf_counter()

    def on_batch(rows: int, stream: PointStream) -> None:
        nonlocal task
        source, read = stream.source, stream.report.rows_read
        if task is None:
            total = source.total_rows or source.total_bytes
            task = progress.add_task(f"loading {name}", total=total, rows=0, rate=0.0)
        done = source.bytes_read() if source.total_rows is None and source.bytes_read else read
        elapsed = max(time.perf_counter() - start, 1e-9)
        progress.update(task, completed=done, rows=read, rate=read / elapsed)

    def on_sent(stream: PointStream) -> None:
        if task is not None:
            total = progress.tasks[0].total
            progress.update(task, description=f"storing {name}", completed=total if total else None)

    options = connection_options(args)
    client = Client(options.target, timeout_s=args.timeout_s, **options.client_keywords())
    with client, progress:
        result = upload_points(
            client,
            name,
            "-" if args.source == "-" else args.source,
            mode=args.mode,
            lat=args.lat,
            lon=args.lon,
            id=False if args.row_ids else args.id,
            skip_invalid=args.skip_invalid,
            format=args.format,
            delimiter=args.delimiter,
            batch_rows=args.batch_rows,
            on_batch=on_batch,
            on_sent=on_sent,
            timeout_s=args.timeout_s,
        )
    if not args.quiet:
        Console().print(result.describe(), highlight=False, soft_wrap=True)
    return 0


# -- generate ------------------------------------------------------------------------------
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.add_argument("--n", type=int, required=True, help="number of points")
    p.add_argument("--out", required=True, help="output file: .parquet, .csv or .arrow/.feather")
    p.add_argument(
        "--clustered",
        action="store_true",
        help="Gaussian clusters of unequal sizes (without it: uniform on the sphere)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random points")
    p.add_argument("--clusters", type=int, default=200, help="clusters with --clustered")
    p.add_argument(
        "--spread-m",
        type=float,
        default=50_000.0,
        help="typical cluster radius, metres, with --clustered",
    )
    p.add_argument("--format", choices=list(WRITE_FORMATS), help="override the extension")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")


def run_generate(args: argparse.Namespace) -> int:
    if args.n < 0:
        raise ValueError(f"--n must be at least 0, got {args.n}")
    err = Console(stderr=True)
    start = time.perf_counter()
    with _progress(err) as progress:
        task = progress.add_task(f"writing {args.out}", total=args.n, rows=0, rate=0.0)
        done = 0

        def on_batch(rows: int) -> None:
            nonlocal done
            done += rows
            elapsed = max(time.perf_counter() - start, 1e-9)
            progress.update(task, completed=done, rows=done, rate=done / elapsed)

        rows = write_points(
            args.out,
            args.n,
            clustered=args.clustered,
            seed=args.seed,
            n_clusters=args.clusters,
            spread_m=args.spread_m,
            format=args.format,
            on_batch=on_batch,
        )
    seconds = time.perf_counter() - start
    if not args.quiet:
        size_mb = Path(args.out).stat().st_size / 1e6
        kind = "clustered" if args.clustered else "uniform"
        Console().print(
            f"wrote {rows:,} {kind} points (seed {args.seed}) to {args.out} "
            f"({size_mb:,.1f} MB) in {seconds:.1f} s",
            highlight=False,
            soft_wrap=True,
        )
    return 0
