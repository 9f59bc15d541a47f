"""Importing geonear must not import CuPy or RAPIDS (a CPU host may have neither), and the
server must not load the client or pandas."""

from __future__ import annotations

import json
import subprocess
import sys

GPU_PACKAGES = ("cupy", "cupyx", "rmm", "cudf", "cuml", "dask_cuda")

_PROBE = """
import json, sys
import geonear
import geonear.service.engines
import geonear.service.engines.gpu_kernels
import geonear.service.engines.gpu_memory
geonear.service.engines.engine_names()
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_geonear_imports_no_gpu_library() -> None:
    # A fresh interpreter: this test process may have imported CuPy through other tests.
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], check=True, capture_output=True, text=True
    ).stdout
    modules = json.loads(out.strip().splitlines()[-1])
    assert "geonear.service.engines" in modules  # the probe really imported the package
    loaded = [m for m in modules if m.split(".")[0] in GPU_PACKAGES]
    assert loaded == [], f"importing geonear imported {loaded}"


_SERVER_PROBE = """
import json, sys
import geonear.service.server
print(json.dumps(sorted(sys.modules)))
"""


def test_the_server_loads_neither_the_client_nor_pandas() -> None:
    """The import contracts (.ci/imports) forbid the imports; this checks what a server
    process really loads, lazy imports of the package root included."""
    out = subprocess.run(
        [sys.executable, "-c", _SERVER_PROBE], check=True, capture_output=True, text=True
    ).stdout
    modules = json.loads(out.strip().splitlines()[-1])
    assert "geonear.service.servicer" in modules
    assert [m for m in modules if m.startswith("geonear.clients")] == []
    assert "pandas" not in modules
