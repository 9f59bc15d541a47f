"""Reports of load-test runs: a terminal table, one self-contained HTML page, a PNG.

The HTML page carries a summary table and matplotlib plots embedded as base64 PNG data
URIs (no files beside it, no scripts): latency by percentile per target, throughput
over time, throughput and tail latency side by side, and errors by status code.
Matplotlib runs on its Agg backend, so no display is needed.
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from geonear.loadtest.results import decode_histograms

#: Percentiles drawn on the latency curve, up to 99.999 when the run has the samples.
_CURVE_NINES = 5
_DPI = 90


def _load(run: dict[str, Any]) -> str:
    config = run["config"]
    if run["mode"] == "closed":
        return f"closed c={config['concurrency']}"
    return f"open {config['rate']:g}/s"


def _summary_rows(runs: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for run in runs:
        lat = run["latency_ms"]
        errors = ", ".join(f"{code} {n:,}" for code, n in run["errors"].items()) or "0"
        rows.append(
            [
                run["name"],
                run["target"],
                run["scenario"],
                _load(run),
                f"{run['requests']:,}",
                errors,
                f"{run['rows']:,}",
                f"{run['throughput_rps']:,.1f}",
                *(f"{lat[key]:.2f}" for key in ("p50", "p90", "p99", "p999", "max")),
            ]
        )
    return rows


#: Distinct errors shown per target in the terminal (the JSON and HTML keep more).
SHOWN_ERRORS = 5


def error_lines(run: dict[str, Any], shown: int = SHOWN_ERRORS) -> list[str]:
    """``cpu: 1,234 requests failed; first distinct errors:`` and one line per error."""
    failed = sum(run["errors"].values())
    if not failed:
        return []
    lines = [f"{run['name']}: {failed:,} of {run['requests']:,} requests failed:"]
    for e in run.get("error_messages", [])[:shown]:
        lines.append(f"  {e['count']:,} x {e['code']}: {e['message']}")
    return lines


_HEADERS = [
    "target",
    "address",
    "scenario",
    "load",
    "requests",
    "errors",
    "rows",
    "req/s",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "p99.9 ms",
    "max ms",
]


def print_summary(runs: Sequence[dict[str, Any]], console: Console | None = None) -> None:
    """The summary table on the terminal (address and rows left to the HTML and JSON)."""
    console = console or Console()
    if not console.is_terminal:
        # Logs and pipes: one wide line per target rather than wrapped, truncated cells.
        console = Console(file=console.file, width=max(console.width, 160))
    table = Table(title="load test")
    keep = [i for i, h in enumerate(_HEADERS) if h not in ("address", "rows")]
    for i in keep:
        table.add_column(
            _HEADERS[i],
            justify="left" if _HEADERS[i] in ("target", "scenario", "load", "errors") else "right",
        )
    for row in _summary_rows(runs):
        table.add_row(*[row[i] for i in keep])
    console.print(table)
    for run in runs:
        for line in error_lines(run):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    for run in runs:
        if run.get("late_sends"):
            console.print(
                f"[yellow]{run['name']}: {run['late_sends']:,} requests went out more "
                "than 10 ms after their scheduled time; the load generator or "
                "--max-in-flight limited the rate (latency still counts from the "
                "schedule)[/]"
            )


# -- plots -----------------------------------------------------------------------------
def plot_latency_percentiles(ax: Axes, runs: Sequence[dict[str, Any]]) -> None:
    """Latency against percentile on a 'nines' axis (50%, 90%, 99%, ...), per target."""
    for i, run in enumerate(runs):
        histogram = decode_histograms([run["histogram"]])
        count = histogram.get_total_count()
        if count == 0:
            continue
        # Beyond 1 - 1/count the curve would only repeat the maximum.
        nines = min(_CURVE_NINES, max(1.0, math.log10(count)))
        xs = [i / 20 for i in range(int(nines * 20) + 1)]
        ys = [histogram.get_value_at_percentile(100 * (1 - 10**-x)) / 1e3 for x in xs]
        ax.plot(xs, ys, label=run["name"], linewidth=1.6, color=f"C{i}")
    ticks = list(range(_CURVE_NINES + 1))
    ax.set_xticks(ticks, ["0%", "90%", "99%", "99.9%", "99.99%", "99.999%"][: len(ticks)])
    ax.set_xlabel("percentile")
    ax.set_ylabel("latency, ms")
    ax.set_yscale("log")
    ax.set_title("latency by percentile")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no successful requests", ha="center", transform=ax.transAxes)


def plot_throughput_over_time(ax: Axes, runs: Sequence[dict[str, Any]]) -> None:
    """Successful responses per second of the measurement window, per target."""
    for i, run in enumerate(runs):
        series = run["timeline"]["successes"]
        step = run["timeline"]["interval_s"]
        # Buckets past the window hold only the stragglers that finished after it.
        shown = series[: max(1, math.ceil(run["duration_s"] / step))]
        ax.stairs(
            [n / step for n in shown],
            [j * step for j in range(len(shown) + 1)],
            label=run["name"],
            linewidth=1.6,
            color=f"C{i}",
        )
    ax.set_xlabel("seconds into the measurement")
    ax.set_ylabel("responses / s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput over time")
    ax.grid(True, alpha=0.3)
    if runs:
        ax.legend(fontsize="small")


def plot_throughput_and_tail(ax: Axes, runs: Sequence[dict[str, Any]]) -> None:
    """Throughput bars with p99 (and p50) markers on a second axis: the at-a-glance view."""
    names = [run["name"] for run in runs]
    xs = range(len(runs))
    ax.bar(
        xs,
        [run["throughput_rps"] for run in runs],
        alpha=0.75,
        color=[f"C{i}" for i in range(len(runs))],
    )
    ax.set_xticks(list(xs), names, rotation=15 if len(runs) > 3 else 0)
    ax.set_ylabel("responses / s")
    ax.set_title("throughput (bars) and latency (markers)")
    right = ax.twinx()
    right.plot(xs, [run["latency_ms"]["p99"] for run in runs], "o", color="tab:red", label="p99")
    right.plot(xs, [run["latency_ms"]["p50"] for run in runs], "s", color="black", label="p50")
    right.set_ylabel("latency, ms")
    top = max([run["latency_ms"]["p99"] for run in runs], default=0.0)
    right.set_ylim(0, top * 1.15 or 1.0)
    right.legend(fontsize="small", loc="upper right")


def plot_errors(ax: Axes, runs: Sequence[dict[str, Any]]) -> None:
    """Errors by status code, one group of bars per code, one bar per target."""
    codes = sorted({code for run in runs for code in run["errors"]})
    ax.set_title("errors by status code")
    if not codes:
        ax.text(
            0.5,
            0.5,
            "no errors",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize="large",
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        ax.bar(
            [c + i * width for c in range(len(codes))],
            [run["errors"].get(code, 0) for code in codes],
            width=width,
            label=run["name"],
            color=f"C{i}",
        )
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(codes))], codes)
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")


PLOTS: tuple[tuple[str, Callable[[Axes, Sequence[dict[str, Any]]], None]], ...] = (
    ("latency by percentile", plot_latency_percentiles),
    ("throughput over time", plot_throughput_over_time),
    ("throughput and latency", plot_throughput_and_tail),
    ("errors by status code", plot_errors),
)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def overview_png(runs: Sequence[dict[str, Any]], title: str = "geonear loadtest") -> bytes:
    """All four plots in one 2 x 2 figure, as PNG bytes (for READMEs and docs)."""
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (_, plot) in zip(axes.ravel(), PLOTS, strict=True):
        plot(ax, runs)
    figure.suptitle(title)
    figure.tight_layout()
    return _png(figure)


def write_png(
    path: str | Path, runs: Sequence[dict[str, Any]], title: str = "geonear loadtest"
) -> None:
    Path(path).write_bytes(overview_png(runs, title))


# -- HTML ------------------------------------------------------------------------------
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; }
img { max-width: 100%; margin: 0.5em 0 1.5em; }
.note { color: #555; font-size: 0.9em; }
"""


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool] | None = None
) -> str:
    numeric = numeric or [False] * len(headers)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=num' if num else ''}>{html.escape(str(v))}</td>"
            for v, num in zip(row, numeric, strict=False)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _details_rows(runs: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for run in runs:
        c, server = run["config"], run.get("server") or {}
        dataset = run.get("dataset") or {}
        rows.append(
            [
                run["name"],
                server.get("backend", "?"),
                server.get("device", "?"),
                server.get("engine", "?"),
                server.get("version", "?"),
                f"{dataset.get('name', c.get('dataset', ''))} ({dataset.get('rows', '?')} rows)"
                if run["scenario"] not in ("ping", "upload")
                else "-",
                f"batch {c['batch']}, k {c['k']}, radius {c['radius_m']:g} m",
                f"{c['duration_s']:g} s (+{c['warmup_s']:g} s warm-up)",
                f"{c['processes']} x {c['channels']}",
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.get("started_unix_s", 0))),
            ]
        )
    return rows


def render_html(
    runs: Sequence[dict[str, Any]],
    title: str = "geonear loadtest",
    client: dict[str, Any] | None = None,
) -> str:
    """One self-contained HTML page: the summary, the settings, the plots inline."""
    numeric = [False] * 4 + [True] * 9
    parts = [
        "<!DOCTYPE html>",
        "<html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<h2>Summary</h2>",
        _table(_HEADERS, _summary_rows(runs), numeric),
        "<p class=note>req/s counts successful responses over the measurement window. "
        "Latency: closed loop from the send; open loop from the scheduled send time "
        "(corrected for coordinated omission). rows: result rows (matrix: distances).</p>",
    ]
    failing = [run for run in runs if run.get("error_messages")]
    if failing:
        parts += [
            "<h2>Errors</h2>",
            _table(
                ["target", "status", "count", "message"],
                [
                    [run["name"], e["code"], f"{e['count']:,}", e["message"]]
                    for run in failing
                    for e in run["error_messages"]
                ],
                [False, False, True, False],
            ),
            "<p class=note>The distinct errors of each target, most frequent first.</p>",
        ]
    late = [run for run in runs if run.get("late_sends")]
    for run in late:
        parts.append(
            f"<p class=note>{html.escape(run['name'])}: {run['late_sends']:,} "
            "requests went out more than 10 ms after their scheduled time.</p>"
        )
    parts += [
        "<h2>Settings</h2>",
        _table(
            [
                "target",
                "backend",
                "device",
                "engine",
                "server version",
                "dataset",
                "request",
                "duration",
                "processes x channels",
                "started",
            ],
            _details_rows(runs),
        ),
    ]
    if client:
        parts.append(
            f"<p class=note>load generator: {html.escape(str(client.get('host')))}, "
            f"{client.get('cpus')} CPUs, Python {html.escape(str(client.get('python')))}"
            "</p>"
        )
    for heading, plot in PLOTS:
        figure, ax = plt.subplots(figsize=(9, 4.2))
        plot(ax, runs)
        figure.tight_layout()
        data = base64.b64encode(_png(figure)).decode("ascii")
        parts.append(
            f"<h2>{html.escape(heading.capitalize())}</h2>"
            f"<img alt='{html.escape(heading)}' src='data:image/png;base64,{data}'>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(
    path: str | Path,
    runs: Sequence[dict[str, Any]],
    title: str = "geonear loadtest",
    client: dict[str, Any] | None = None,
) -> None:
    Path(path).write_text(render_html(runs, title, client), encoding="utf-8")
