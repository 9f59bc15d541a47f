"""``geonear loadtest``: drive running servers over gRPC, the way ghz, k6 or wrk2 do.

Closed loop (``--concurrency``) or open loop (``--rate``, latency from the scheduled
send time), from several worker processes, with latencies in HdrHistogram; results as
JSON (mergeable), a terminal table, an HTML page with plots, and a PNG.

Built on the public API only (``geonear.v1``, ``geonear.wire``, ``geonear.loaders`` and
the shared connection options of ``geonear.clients.cli_options``), as any tool outside
this package could be; the import contracts in pyproject.toml hold it to that. Modules:

- :mod:`.scenarios`: what is sent (ping, knn, radius, matrix, kmeans, upload, mixed).
- :mod:`.runner`: worker processes, closed and open loops.
- :mod:`.results`: histograms, per-target summaries, the JSON form and merging.
- :mod:`.report`: the terminal table, the HTML page and its matplotlib plots.
- :mod:`.progress`: the live display.
- :mod:`.command`: the command line.
"""

from __future__ import annotations

from geonear.loadtest.command import add_loadtest_arguments, run_loadtest

__all__ = ["add_loadtest_arguments", "run_loadtest"]
