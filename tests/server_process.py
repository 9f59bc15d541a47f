"""A geonear server in a process of its own, for the tests that kill, restart or measure it.

``start_server(args, log_path, cwd)`` runs ``python ARGS`` (``-m geonear serve ...``, or
a script that calls ``serve``) with stderr to ``log_path``, waits for the "listening on"
line and returns the process and its target; ``resident_bytes(pid)`` is a process's
resident memory.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def start_server(
    args: list[str], log_path: Path, cwd: Path, timeout_s: float = 60.0
) -> tuple[subprocess.Popen, str]:
    """Start ``python ARGS`` in ``cwd`` and wait until it listens; (process, "host:port").

    ``cwd`` should lie outside the repository, so that the source folders do not shadow
    the installed package. Raises AssertionError, with the log, if the process exits or
    does not listen within ``timeout_s``.
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=log
        )
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace")
        if "listening on" in text:
            line = next(ln for ln in text.splitlines() if "listening on" in ln)
            return proc, f"127.0.0.1:{int(line.rsplit(':', 1)[1])}"
        if proc.poll() is not None:
            raise AssertionError(f"the server exited at start:\n{text}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start within {timeout_s} s:\n{text}")
        time.sleep(0.02)


def resident_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (VmRSS, Linux), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
