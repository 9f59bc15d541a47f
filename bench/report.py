"""What ``geonear bench`` writes: the results document, the terminal table, markdown.

Document layout (``format`` is :data:`FORMAT`)::

    {"format": "geonear-bench/1", "created_unix_s": ..., "command": "geonear bench ...",
     "machine": {"platform", "processor", "cpus", "memory_gib", "gpus"},
     "versions": {"python", "geonear", "numpy", "scipy", "scikit-learn", "cupy", "cuml"},
     "config": {...}, "data": {"description", "n_points", "n_queries", "ref_queries"},
     "throughput_unit": "queries/s",
     "results": [{"engine", "status", "reason", "device", "build_s", "cold_s",
                  "warm_min_s", "warm_median_s", "repeats", "queries_run", "scale",
                  "throughput", "speedup_vs_sklearn", "speedup_vs_cpu",
                  "exactness": {...}, "exact", "notes"}]}

Times are seconds; a version is null where the package is not installed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = "geonear-bench/1"

#: Exactness columns per op: (heading, key in ``exactness``, format).
_EXACTNESS_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "knn": [
        ("recall", "recall", "{:.4f}"),
        ("order", "order_agreement", "{:.4f}"),
        ("max err m", "max_distance_error_m", "{:.2g}"),
    ],
    "radius": [
        ("found/query", "mean_neighbours", "{:.3g}"),
        ("recall", "recall", "{:.4f}"),
        ("order", "order_agreement", "{:.4f}"),
        ("max err m", "max_distance_error_m", "{:.2g}"),
    ],
    "matrix": [("max err m", "max_abs_error_m", "{:.2g}")],
    "kmeans": [
        ("iters", "n_iter", "{}"),
        ("inertia Δ", "inertia_rel_diff", "{:.2g}"),
        ("labels =", "label_agreement", "{:.4f}"),
    ],
    "build": [("host MiB", "host_mib", "{:,.1f}"), ("device MiB", "device_mib", "{:,.1f}")],
    "knn-join": [
        ("recall", "recall", "{:.4f}"),
        ("order", "order_agreement", "{:.4f}"),
        ("max err m", "max_distance_error_m", "{:.2g}"),
    ],
    "count-within": [
        ("found/point", "mean_count", "{:.3g}"),
        ("wrong", "wrong_counts", "{}"),
    ],
    "filtered-knn": [
        ("selected", "selected_share", "{:.1%}"),
        ("sel build s", "selected_build_s", "{:.3g}"),
        ("÷ bound", "bound_ratio", "{:.2f}"),
        ("recall", "recall", "{:.4f}"),
        ("max err m", "max_distance_error_m", "{:.2g}"),
    ],
    "dbscan": [
        ("clusters", "n_clusters", "{}"),
        ("noise", "noise_share", "{:.1%}"),
        ("labels =", "label_agreement", "{:.4f}"),
    ],
    "within": [("inside", "n_inside", "{:,}"), ("wrong", "wrong_points", "{}")],
}


def _version(*distributions: str) -> str | None:
    """Installed version of the first of ``distributions`` present (read without importing)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    cuda = ("13x", "12x", "11x")
    return {
        "python": platform.python_version(),
        "geonear": _version("geonear"),
        "numpy": _version("numpy"),
        "scipy": _version("scipy"),
        "scikit-learn": _version("scikit-learn"),
        "cupy": _version("cupy", *(f"cupy-cuda{c}" for c in cuda)),
        "cuml": _version("cuml", "cuml-cu13", "cuml-cu12"),
    }


def _processor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The host of the run; GPUs as described by the GPU engines that ran."""
    gpus = sorted(
        {
            r["device"]
            for r in results
            if r["status"] == "ok" and r["device"] and not r["device"].startswith("cpu")
        }
    )
    memory = memory_gib()
    return {
        "platform": platform.platform(),
        "processor": _processor(),
        "cpus": os.cpu_count(),
        "memory_gib": None if memory is None else round(memory, 1),
        "gpus": gpus,
    }


def results_document(**parts: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "created_unix_s": time.time(),
        "command": parts.pop("command"),
        "machine": machine(parts["results"]),
        "versions": versions(),
        **parts,
    }


def write_json(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    # Infinite errors (a missing row) are written as null: JSON has no infinity.
    Path(path).write_text(json.dumps(_finite(doc), indent=1) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _seconds(value: float | None) -> str:
    if value is None:
        return ""
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value >= 0.001 else f"{value:.2e}"


def _rate(value: float | None) -> str:
    if value is None:
        return ""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def _speedup(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.3g}x" if value >= 0.001 else f"{value:.1e}x"


def _headings(doc: dict[str, Any]) -> list[str]:
    unit = doc["throughput_unit"]
    columns = _EXACTNESS_COLUMNS[doc["config"]["op"]]
    return [
        "engine",
        "build s",
        "cold s",
        "warm min s",
        "warm med s",
        unit,
        "vs sklearn",
        "vs cpu",
        *(c[0] for c in columns),
        "exact",
        "note",
    ]


def _cells(doc: dict[str, Any], row: dict[str, Any]) -> list[str]:
    columns = _EXACTNESS_COLUMNS[doc["config"]["op"]]
    if row["status"] != "ok":
        blank = [""] * (len(_headings(doc)) - 2)
        return [row["engine"], *blank, f"{row['status']}: {row['reason']}"]
    exactness = row["exactness"]
    checks = []
    for _, key, fmt in columns:
        value = exactness.get(key)
        checks.append("" if value is None else fmt.format(value))
    exact = {True: "yes", False: "NO", None: "n/a"}[row["exact"]]
    return [
        row["engine"],
        _seconds(row["build_s"]),
        _seconds(row["cold_s"]),
        _seconds(row["warm_min_s"]),
        _seconds(row["warm_median_s"]),
        _rate(row["throughput"]),
        _speedup(row["speedup_vs_sklearn"]),
        _speedup(row["speedup_vs_cpu"]),
        *checks,
        exact,
        "; ".join(row["notes"]),
    ]


def _notes(doc: dict[str, Any]) -> list[str]:
    """Notes on the whole table (each row's own notes are in its last column)."""
    notes = []
    data = doc["data"]
    if doc["config"]["op"] in ("knn", "radius", "matrix"):
        notes.append(
            f"exactness checked on the first {data['ref_queries']:,} queries against "
            "the float64 reference (numpy-brute's great-circle formula)"
        )
    if doc["config"]["op"] == "kmeans":
        notes.append(
            "every row starts from the same k-means++ centres; inertia Δ and labels "
            "are against the cpu engine; sklearn-kmeans is Euclidean KMeans(n_init=1) "
            "on unit vectors, timed with the seeding"
        )
    notes.extend(doc.get("notes", ()))  # the analytics ops say how they ran and checked
    return notes


def title(doc: dict[str, Any]) -> str:
    c, d = doc["config"], doc["data"]
    parts = [c["op"], d["description"], f"{d['n_points']:,} points"]
    if c["op"] in ("knn-join", "count-within"):
        parts[-1] = f"{d['n_queries']:,} x {d['n_points']:,} points"
    if c["op"] in ("knn", "radius", "matrix", "filtered-knn"):
        parts.append(f"{d['n_queries']:,} queries")
    if c["op"] in ("knn", "kmeans", "knn-join", "filtered-knn"):
        parts.append(f"k={c['k']}")
    if c["op"] == "radius":
        parts.append(f"radius {c['radius_m']:g} m")
    if c["op"] == "count-within":
        parts.append(f"radius {d['radius_m']:,.0f} m")
    if c["op"] == "dbscan":
        parts.append(f"eps {d['eps_m']:,.0f} m, min_samples {d['min_samples']}")
    if c["op"] == "within":
        parts.append(d["polygon"])
    if c["op"] == "matrix":
        parts.append(c["dtype"])
    return " · ".join(parts)


#: Terminals narrower than this get the compact table (the full one is about 150 wide).
FULL_TABLE_WIDTH = 150
#: Columns of the compact table: the full table's, without the warm median, the
#: exactness details (the "exact" column still says yes or NO) and the notes, which are
#: printed under the table, one line an engine.
_COMPACT_DROP = ("warm med s", "note")


def print_table(doc: dict[str, Any], console: Any) -> None:
    """The results as a rich table, inexact engines in red, then the notes.

    A console narrower than FULL_TABLE_WIDTH gets a compact table that fits in 100
    columns; each engine's notes and the exactness details then follow the table.
    """
    from rich.table import Table
    from rich.text import Text

    compact = console.width < FULL_TABLE_WIDTH
    table = Table(title=title(doc), title_justify="left")
    headings = _headings(doc)
    details = {c[0] for c in _EXACTNESS_COLUMNS[doc["config"]["op"]]}
    keep = [
        i
        for i, h in enumerate(headings)
        if not compact or (h not in _COMPACT_DROP and h not in details)
    ]
    for n, i in enumerate(keep):
        last = n == len(keep) - 1 and not compact
        table.add_column(
            headings[i],
            justify="left" if n == 0 or last else "right",
            no_wrap=not last,
            overflow="fold",
        )
    below = []
    for row in doc["results"]:
        style = "red" if row["exact"] is False else ("dim" if row["status"] != "ok" else None)
        cells = _cells(doc, row)
        if compact and row["status"] != "ok":
            kept = [row["engine"], *[""] * (len(keep) - 1)]
            below.append(f"{row['engine']}: {cells[-1]}")
        else:
            kept = [cells[i] for i in keep]
            if compact:
                checks = [f"{h} {cells[i]}" for i, h in enumerate(headings) if h in details]
                note = "; ".join([*row["notes"], ", ".join(c for c in checks if c.strip())])
                below.append(f"{row['engine']}: {note}")
        # Text, not markup: reasons hold brackets such as "geonear[gpu]".
        table.add_row(*(Text(cell) for cell in kept), style=style)
    console.print(table)
    for line in [*below, *_notes(doc)]:
        console.print(f"  {line}", highlight=False, markup=False)


def _machine_line(doc: dict[str, Any]) -> str:
    m, v = doc["machine"], doc["versions"]
    memory = "" if m["memory_gib"] is None else f", {m['memory_gib']:g} GiB"
    gpus = f"; GPU: {', '.join(m['gpus'])}" if m["gpus"] else ""
    installed = ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)
    return f"{m['processor']}, {m['cpus']} cores{memory}{gpus}; {m['platform']}; {installed}"


def markdown(doc: dict[str, Any]) -> str:
    """A section for docs/benchmarks.md: the title, the command, the machine and the table."""
    headings = _headings(doc)
    when = time.strftime("%Y-%m-%d", time.gmtime(doc["created_unix_s"]))
    lines = [
        f"### {title(doc)}",
        "",
        "```",
        doc["command"],
        "```",
        "",
        f"Machine ({when}): {_machine_line(doc)}",
        "",
        "| " + " | ".join(headings) + " |",
        "|" + "|".join(["---", *["---:"] * (len(headings) - 2), "---"]) + "|",
    ]
    for row in doc["results"]:
        lines.append("| " + " | ".join(_cells(doc, row)) + " |")
    lines.append("")
    lines.extend(f"- {note}" for note in _notes(doc))
    return "\n".join(lines) + "\n\n"
