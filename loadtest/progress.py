"""The live display of a running load test (rich), shown only on a terminal.

One row per target: finished targets keep their final numbers, the running one shows
its phase, elapsed time, requests done, the rate and latency of the last second.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from geonear.loadtest.results import decode_histograms, latency_summary_ms
from geonear.loadtest.runner import LoadPlan, ProgressSink

#: Seconds of recent progress the live rate and latency are computed over.
_RECENT_S = 1.0


class LiveProgress(ProgressSink):
    """A rich Live table fed by the workers' progress messages."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.finished: list[dict[str, Any]] = []
        self.name = ""
        self.plan: LoadPlan | None = None
        self.t_start: float | None = None
        self.done: dict[int, int] = {}
        self.failed: dict[int, int] = {}
        # (time, total done, encoded histogram of that interval) per worker message.
        self.recent: list[tuple[float, int, str]] = []
        self.live = Live(
            self._render(), console=self.console, refresh_per_second=4, transient=False
        )

    def __enter__(self) -> LiveProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.update(self._render())
        self.live.__exit__(None, None, None)

    # -- ProgressSink --------------------------------------------------------------------
    def begin(self, name: str, plan: LoadPlan) -> None:
        self.name, self.plan, self.t_start = name, plan, None
        self.done, self.failed, self.recent = {}, {}, []
        self.live.update(self._render())

    def started(self) -> None:
        self.t_start = time.monotonic()

    def update(self, worker: int, done: int, failed: int, recent_histogram: str) -> None:
        now = time.monotonic()
        self.done[worker], self.failed[worker] = done, failed
        self.recent.append((now, sum(self.done.values()), recent_histogram))
        self.recent = [r for r in self.recent if now - r[0] <= _RECENT_S + 0.5]
        self.live.update(self._render())

    def end(self, run: dict[str, Any]) -> None:
        self.finished.append(run)
        self.plan = None
        self.live.update(self._render())

    # -- rendering -----------------------------------------------------------------------
    def _render(self) -> Any:
        table = Table(title="geonear loadtest", expand=False)
        for column in ("target", "phase", "requests", "errors", "req/s", "p50 ms", "p99 ms"):
            table.add_column(column, justify="left" if column in ("target", "phase") else "right")
        for run in self.finished:
            lat = run["latency_ms"]
            table.add_row(
                run["name"],
                "done",
                f"{run['requests']:,}",
                f"{sum(run['errors'].values()):,}",
                f"{run['throughput_rps']:,.0f}",
                f"{lat['p50']:.2f}",
                f"{lat['p99']:.2f}",
            )
        if self.plan is None:
            return table
        parts: list[Any] = [table]
        if self.t_start is None:
            table.add_row(self.name, "starting", "", "", "", "", "")
            return Group(*parts)
        elapsed = time.monotonic() - self.t_start
        total = self.plan.warmup_s + self.plan.duration_s
        phase = "warm-up" if elapsed < self.plan.warmup_s else "measuring"
        if elapsed >= total:
            phase = "draining"
        rate, p50, p99 = "", "", ""
        if len(self.recent) >= 2:
            (t0, n0, _), (t1, n1, _) = self.recent[0], self.recent[-1]
            if t1 > t0:
                rate = f"{(n1 - n0) / (t1 - t0):,.0f}"
            lat = latency_summary_ms(decode_histograms(h for _, _, h in self.recent[1:]))
            p50, p99 = f"{lat['p50']:.2f}", f"{lat['p99']:.2f}"
        table.add_row(
            self.name,
            phase,
            f"{sum(self.done.values()):,}",
            f"{sum(self.failed.values()):,}",
            rate,
            p50,
            p99,
        )
        parts.append(ProgressBar(total=total, completed=min(elapsed, total), width=60))
        return Group(*parts)
