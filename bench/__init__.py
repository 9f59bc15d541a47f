"""``geonear bench``: engines side by side on the same data, in one process or served.

Built on the public API only (``geonear``, ``geonear.wire``, ``geonear.v1``,
``geonear.geometry``, ``geonear.loaders`` and the engines package
``geonear.service.engines``), as any tool outside this package could be; the import
contracts in pyproject.toml hold it to that. Modules:

- :mod:`.command`: the command line, the run configuration and the in-process runner.
- :mod:`.exactness`: each answer checked against the float64 reference.
- :mod:`.report`: the results document, the terminal table and markdown.
- :mod:`.served`: ``--served``, one query in-process and through a real server.
- :mod:`.analytics`: the server-side analytics ops (joins, counts, filtered KNN,
  DBSCAN, within), each engine through a server of its own, beside peers.
"""

from __future__ import annotations

from geonear.bench.command import add_arguments, run

__all__ = ["add_arguments", "run"]
