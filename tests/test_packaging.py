"""The Docker image's build steps, run in a fresh virtual environment.

No Docker engine runs in CI, so the Dockerfile delegates its install to
docker/install.sh and this test runs that script into a new venv, then serves from the
installed package (not the source tree) and answers a query.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_install_script_builds_a_working_server(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    result = subprocess.run(
        ["bash", str(ROOT / "docker" / "install.sh"), str(python)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "installed" in result.stdout

    # The installed package, run from an unrelated directory, answers a real query.
    script = (
        "import geonear\n"
        "c = geonear.connect(demo=True)\n"
        "r = c.knn('airports', 51.47, -0.45, k=1)\n"
        "print(r['id'][0])\n"
        "c.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(python), "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "EGLL"
    module_path = subprocess.run(
        [str(python), "-c", "import geonear.service.server as s; print(s.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    ).stdout
    assert str(env_dir) in module_path and sys.prefix not in module_path
