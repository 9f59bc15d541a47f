"""The README's Python examples run as written, and show what they print.

Each ```python block runs on its own, in a fresh namespace (each starts its own
in-process server with ``geonear.connect()``). Comment lines right after a ``print(...)``
are the output the reader is shown: they must appear in what the block printed, in
order (``...`` stands for anything, such as a port). The README's tables of defaults
must agree with the code.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from geonear.service.settings import Limits

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def expected_output(block: str) -> list[str]:
    """The comment lines that follow each print(...) of ``block``."""
    shown: list[str] = []
    after_print = False
    for line in block.splitlines():
        if line.startswith("print("):
            after_print = True
        elif after_print and line.startswith("# "):
            shown.append(line[2:])
        else:
            after_print = False
    return shown


def _matches(expected: str, line: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.rstrip().split("..."))
    return re.fullmatch(pattern, line.rstrip()) is not None


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 3
    assert all(expected_output(b) or "def " in b for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_example_runs_and_prints_what_it_shows(block: str) -> None:
    if "import geopandas" in block:
        pytest.importorskip("geopandas")
    printed = io.StringIO()
    namespace: dict[str, object] = {"__name__": "readme_example"}
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), namespace)
    lines = printed.getvalue().splitlines()
    at = 0
    for want in expected_output(block):
        while at < len(lines) and not _matches(want, lines[at]):
            at += 1
        assert at < len(lines), f"README shows {want!r}; the example printed:\n{printed.getvalue()}"
        at += 1


def _number(text: str) -> float | None:
    """A default as the README writes it: ``10 000``, ``2e9``, ``64 MiB (at least 4 MiB)``."""
    text = text.split("(")[0].strip()
    scale = 1
    if text.endswith("MiB"):
        text, scale = text[:-3], 2**20
    try:
        return float(text.replace(" ", "").replace(",", "")) * scale
    except ValueError:
        return None  # "3/4 of RAM", "the device's"


def test_the_readme_limits_table_states_the_real_defaults() -> None:
    rows = re.findall(r"^\| `--([a-z-]+)` / `GEONEAR_[A-Z_]+` \| ([^|]+) \|", README, re.M)
    compared = 0
    for flag, written in rows:
        field = flag.replace("-", "_")
        assert field in Limits.model_fields, flag
        value = _number(written)
        if value is not None:
            assert value == Limits.model_fields[field].default, (flag, written)
            compared += 1
    assert compared >= 6


@pytest.mark.parametrize("path", ["README.md", "docs/loadtest.md"])
def test_docs_speak_of_the_project_not_of_its_tracker(path: str) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    assert not re.search(r"\bissue\s*#?\d+", text, flags=re.IGNORECASE)


def test_the_readme_credits_geonames() -> None:
    assert "Contains data from GeoNames (geonames.org), licensed under CC BY 4.0" in " ".join(
        README.split()
    )
