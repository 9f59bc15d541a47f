"""Load-test results: latency histograms, per-target summaries and their JSON form.

Latencies are recorded in HdrHistogram (microseconds, 3 significant digits, 1 µs to
10 min), so worker processes and separate runs merge exactly: each worker sends its
histogram in HdrHistogram's encoded (compressed, base64) form and the parent adds them.
The JSON file keeps that encoded histogram next to the summary numbers, so ``geonear
loadtest report`` can re-derive any percentile, and merge runs, without the raw samples.

JSON layout (``format`` is :data:`FORMAT`)::

    {"format": "geonear-loadtest/1", "created_unix_s": ..., "client": {...},
     "runs": [{"name": "cpu", "target": "host:port", "scenario": "knn", "mode": "closed",
               "config": {...}, "server": {...}, "duration_s": 15.0,
               "requests": N, "successes": N, "errors": {"NOT_FOUND": n}, "rows": N,
               "error_messages": [{"code": "NOT_FOUND", "message": "...", "count": n}],
               "throughput_rps": ..., "latency_ms": {"p50": ..., "p90": ..., "p99": ...,
               "p999": ..., "max": ..., "mean": ...},
               "timeline": {"interval_s": 1.0, "successes": [...], "errors": [...]},
               "histogram": "<HdrHistogram encoded>"}]}
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

FORMAT = "geonear-loadtest/1"
#: Histogram range, microseconds: 1 µs to 10 minutes (longer is clamped to it).
LOWEST_US = 1
HIGHEST_US = 600_000_000
SIGNIFICANT_DIGITS = 3
#: Percentiles of the summary, as (JSON key, percentile).
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p999", 99.9))
#: Distinct error messages kept per worker and per run; the rest count as "other".
ERROR_MESSAGES = 20
OTHER_MESSAGES = "(other messages)"


def count_error_message(counts: Counter[str], code: str, message: str) -> None:
    """Count one failure as ``CODE: message``, keeping at most ERROR_MESSAGES distinct."""
    key = f"{code}: {message}" if message else code
    if key not in counts and len(counts) >= ERROR_MESSAGES:
        key = f"{code}: {OTHER_MESSAGES}"
    counts[key] += 1


def error_message_list(counts: Counter[str]) -> list[dict[str, Any]]:
    """The distinct errors, most frequent first, as stored in the JSON file."""
    out = []
    for key, n in counts.most_common(ERROR_MESSAGES):
        code, _, message = key.partition(": ")
        out.append({"code": code, "message": message, "count": n})
    return out


def _error_counter(run: dict[str, Any]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for e in run.get("error_messages", ()):
        counts[f"{e['code']}: {e['message']}" if e["message"] else e["code"]] += e["count"]
    return counts


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


def record_latency(histogram: HdrHistogram, seconds: float) -> None:
    """Record one latency, clamped to the histogram's range (hdrh drops values beyond it)."""
    histogram.record_value(min(HIGHEST_US, max(LOWEST_US, round(seconds * 1e6))))


def encode_histogram(histogram: HdrHistogram) -> str:
    return histogram.encode().decode("ascii")


def decode_histograms(encoded: Iterable[str]) -> HdrHistogram:
    """One histogram holding the sum of the encoded ones."""
    merged = new_histogram()
    for text in encoded:
        if text:
            merged.decode_and_add(text.encode("ascii"))
    return merged


def latency_summary_ms(histogram: HdrHistogram) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean in milliseconds; all 0 for an empty histogram."""
    if histogram.get_total_count() == 0:
        return {**{key: 0.0 for key, _ in PERCENTILES}, "max": 0.0, "mean": 0.0}
    out = {key: histogram.get_value_at_percentile(p) / 1e3 for key, p in PERCENTILES}
    # get_max_value is the highest value equivalent to the largest sample, so it is never
    # below a percentile (which hdrh reports the same way).
    out["max"] = histogram.get_max_value() / 1e3
    out["mean"] = histogram.get_mean_value() / 1e3
    return out


def add_series(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Element-wise sum of two per-interval count series of any lengths."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class WorkerTotals:
    """What one worker process measured in the measurement window (warm-up excluded)."""

    successes: int = 0
    rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    #: Failures by ``CODE: message`` (see count_error_message).
    error_messages: Counter[str] = field(default_factory=Counter)
    #: Completions per second of the window, successes and errors apart.
    timeline_successes: list[int] = field(default_factory=list)
    timeline_errors: list[int] = field(default_factory=list)
    #: Requests the open loop could not send on time because max-in-flight was reached.
    late_sends: int = 0
    histogram: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "successes": self.successes,
            "rows": self.rows,
            "errors": dict(self.errors),
            "error_messages": dict(self.error_messages),
            "timeline_successes": self.timeline_successes,
            "timeline_errors": self.timeline_errors,
            "late_sends": self.late_sends,
            "histogram": self.histogram,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerTotals:
        return cls(
            successes=d["successes"],
            rows=d["rows"],
            errors=Counter(d["errors"]),
            error_messages=Counter(d.get("error_messages", {})),
            timeline_successes=list(d["timeline_successes"]),
            timeline_errors=list(d["timeline_errors"]),
            late_sends=d["late_sends"],
            histogram=d["histogram"],
        )


def summarise_run(
    name: str,
    target: str,
    scenario: str,
    mode: str,
    config: dict[str, Any],
    server: dict[str, Any] | None,
    duration_s: float,
    workers: Sequence[WorkerTotals],
) -> dict[str, Any]:
    """One target's run, as stored in the JSON file, from its workers' totals."""
    histogram = decode_histograms(w.histogram for w in workers)
    errors: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    timeline_ok: list[int] = []
    timeline_err: list[int] = []
    for w in workers:
        errors.update(w.errors)
        messages.update(w.error_messages)
        timeline_ok = add_series(timeline_ok, w.timeline_successes)
        timeline_err = add_series(timeline_err, w.timeline_errors)
    run = {
        "name": name,
        "target": target,
        "scenario": scenario,
        "mode": mode,
        "config": config,
        "server": server,
        "duration_s": duration_s,
        "successes": sum(w.successes for w in workers),
        "errors": dict(sorted(errors.items())),
        "error_messages": error_message_list(messages),
        "rows": sum(w.rows for w in workers),
        "late_sends": sum(w.late_sends for w in workers),
        "timeline": {"interval_s": 1.0, "successes": timeline_ok, "errors": timeline_err},
        "histogram": encode_histogram(histogram),
    }
    return _with_derived(run, histogram)


def _with_derived(run: dict[str, Any], histogram: HdrHistogram) -> dict[str, Any]:
    """Fill the numbers that follow from the counts and the histogram."""
    run["requests"] = run["successes"] + sum(run["errors"].values())
    run["throughput_rps"] = run["successes"] / run["duration_s"] if run["duration_s"] else 0.0
    run["latency_ms"] = latency_summary_ms(histogram)
    return run


def merge_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one target by load generators that ran at the same time, as one run.

    Counts, rows and timelines add up, histograms merge, and the throughput is the sum
    of the generators' (over the longest window among them).
    """
    if not runs:
        raise ValueError("nothing to merge")
    first = runs[0]
    errors: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    timeline_ok: list[int] = []
    timeline_err: list[int] = []
    for run in runs:
        errors.update(run["errors"])
        messages.update(_error_counter(run))
        timeline_ok = add_series(timeline_ok, run["timeline"]["successes"])
        timeline_err = add_series(timeline_err, run["timeline"]["errors"])
    histogram = decode_histograms(r["histogram"] for r in runs)
    merged = {
        **first,
        "duration_s": max(r["duration_s"] for r in runs),
        "successes": sum(r["successes"] for r in runs),
        "errors": dict(sorted(errors.items())),
        "error_messages": error_message_list(messages),
        "rows": sum(r["rows"] for r in runs),
        "late_sends": sum(r.get("late_sends", 0) for r in runs),
        "timeline": {
            "interval_s": first["timeline"]["interval_s"],
            "successes": timeline_ok,
            "errors": timeline_err,
        },
        "histogram": encode_histogram(histogram),
        "merged_from": len(runs),
    }
    return _with_derived(merged, histogram)


def client_description() -> dict[str, Any]:
    """The load generator's machine, for the record."""
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def results_document(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "created_unix_s": time.time(),
        "client": client_description(),
        "runs": list(runs),
    }


def write_results(path: str | Path, runs: Sequence[dict[str, Any]]) -> None:
    Path(path).write_text(json.dumps(results_document(runs), indent=1) + "\n")


def read_results(paths: Sequence[str | Path], merge: bool = False) -> list[dict[str, Any]]:
    """The runs of several JSON files, in order.

    Runs with the same name are kept side by side (renamed ``name (file)``), or combined
    with :func:`merge_runs` when ``merge`` is true (load generators run in parallel).
    """
    loaded: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(
                f"{path} is not a geonear load-test result (format "
                f"{doc.get('format')!r}, expected {FORMAT!r})"
            )
        loaded.extend((Path(path).stem, run) for run in doc["runs"])
    by_name: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for source, run in loaded:
        by_name.setdefault(run["name"], []).append((source, run))
    out = []
    for name, group in by_name.items():
        if merge or len(group) == 1:
            out.append(merge_runs([r for _, r in group]) if len(group) > 1 else group[0][1])
            continue
        sources = [source for source, _ in group]
        for j, (source, run) in enumerate(group):
            label = source if sources.count(source) == 1 else f"{source} #{j + 1}"
            out.append({**run, "name": f"{name} ({label})"})
    return out


def check_consistent(run: dict[str, Any]) -> list[str]:
    """Ways in which a run's numbers contradict each other (empty when they agree)."""
    problems = []
    if run["requests"] != run["successes"] + sum(run["errors"].values()):
        problems.append("requests != successes + errors")
    lat = run["latency_ms"]
    order = [lat[k] for k, _ in PERCENTILES] + [lat["max"]]
    if any(a > b for a, b in itertools.pairwise(order)):
        problems.append(f"percentiles out of order: {order}")
    if sum(run["timeline"]["successes"]) != run["successes"]:
        problems.append("timeline successes do not add up to successes")
    if decode_histograms([run["histogram"]]).get_total_count() != run["successes"]:
        problems.append("the histogram does not hold one latency per success")
    return problems
