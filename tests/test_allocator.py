"""The allocation policies: the server's wins, a client sets its own only where nothing
serves, and the environment's choice is left alone (checked in fresh processes, since a
policy is the process's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from geonear.allocator import libc

pytestmark = pytest.mark.skipif(libc is None, reason="glibc only")


def _run(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.pop("GEONEAR_TUNE_MALLOC", None)
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_client_alone_takes_the_client_policy() -> None:
    code = "import geonear, geonear.allocator as a; c = geonear.Client('127.0.0.1:1')\n"
    code += "print(a.policy_in_force())"
    assert _run(code) == "client"


def test_a_process_that_serves_keeps_the_server_policy() -> None:
    code = (
        "import geonear, geonear.allocator as a\n"
        "c = geonear.Client('127.0.0.1:1'); first = a.policy_in_force()\n"
        "s = geonear.connect(); print(first, a.policy_in_force()); s.close()"
    )
    assert _run(code) == "client server"


def test_the_environment_and_the_opt_out_are_left_alone() -> None:
    code = "import geonear.allocator as a; print(a.tune_allocator('client'))"
    assert _run(code, MALLOC_MMAP_THRESHOLD_="131072") == "None"
    assert _run(code, GEONEAR_TUNE_MALLOC="0") == "None"
    assert _run(code) == "client"
