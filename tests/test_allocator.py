"""The allocation thresholds: set by a client and by a server, left alone where the
environment chose (checked in fresh processes, since thresholds are the process's);
and what an upload leaves resident in a server under them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from server_process import resident_bytes, start_server

import geonear
from geonear.allocator import libc

pytestmark = pytest.mark.skipif(libc is None, reason="glibc only")

#: Prints whether a 4 MiB allocation lands on the main heap (below the 8 MiB threshold)
#: rather than in a mapping of its own (glibc's default, 128 KiB to 32 MiB).
_ON_HEAP = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
at = libc.malloc(4 << 20)
heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
low, high = (int(x, 16) for x in heap[0].split("-")) if heap else (0, 0)
print(low <= at < high)
"""


def _run(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.pop("GEONEAR_TUNE_MALLOC", None)
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", code + _ON_HEAP],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def test_a_client_sets_the_thresholds() -> None:
    code = "import geonear, geonear.allocator as a\n"
    assert _run(code) == "False"  # glibc's own threshold: the 4 MiB are mapped
    assert _run(code + "c = geonear.Client('127.0.0.1:1')") == "True"


def test_a_server_sets_the_thresholds() -> None:
    code = "import geonear\ns = geonear.connect(); s.close()"
    assert _run(code) == "True"


def test_the_environment_and_the_opt_out_are_left_alone() -> None:
    code = "import geonear.allocator as a; print(a.tune_allocator())"
    assert _run(code, MALLOC_MMAP_THRESHOLD_="131072") == "False False"
    assert _run(code, GEONEAR_TUNE_MALLOC="0") == "False False"
    assert _run(code) == "True True"


@pytest.mark.parametrize("refused", [False, True], ids=["stored", "refused"])
def test_an_upload_leaves_the_server_holding_about_the_dataset(
    tmp_path: Path, refused: bool
) -> None:
    """An upload's messages lie on the heap (1 MiB, below the threshold): handed back
    once the change is stored, about 70 bytes a point stay resident (the dataset, its
    index and ids); kept, they add about 25 more. A refused upload (its dataset exists,
    found as the change commits) leaves little."""
    points = 3_000_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(points, dtype=np.int64),
            "lat": rng.uniform(-90, 90, points),
            "lon": rng.uniform(-180, 180, points),
        }
    )
    args = ["-m", "geonear", "serve", "--engine", "cpu", "--memory-only", "--port", "0"]
    proc, target = start_server(args, tmp_path / "serve.log", cwd=tmp_path)
    try:
        client = geonear.connect(target)
        if refused:
            client.upload("points", table.slice(0, 10))
        before = resident_bytes(proc.pid)
        if refused:
            with pytest.raises(geonear.GeoNearError, match="exists"):
                client.upload("points", table)
            assert [d.rows for d in client.datasets()] == [10]
        else:
            client.upload("points", table)
        held = (resident_bytes(proc.pid) - before) / points
        client.close()
    finally:
        proc.kill()
        proc.wait()
    assert held < (15 if refused else 85), f"{held:.1f} bytes a point resident after it"
