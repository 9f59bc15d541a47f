"""Importing geonear must not import CuPy or RAPIDS: a CPU host may have neither."""

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
