"""The committed stubs are what proto/generate.py makes from the committed .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB_DIR = ROOT / "proto" / "geonear" / "v1"
STUBS = ("geonear_pb2.py", "geonear_pb2.pyi", "geonear_pb2_grpc.py")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "geonear_proto_generate", ROOT / "proto" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("stubs")
    paths = _load_generator().generate(out)
    return {p.name: p.read_bytes() for p in paths}


def test_generator_writes_the_three_stubs(regenerated: dict[str, bytes]) -> None:
    assert sorted(regenerated) == sorted(STUBS)


@pytest.mark.parametrize("name", STUBS)
def test_committed_stub_is_up_to_date(regenerated: dict[str, bytes], name: str) -> None:
    committed = (STUB_DIR / name).read_bytes()
    assert regenerated[name] == committed, (
        f"proto/geonear/v1/{name} is stale: run `python proto/generate.py` and commit the result"
    )


def test_installed_stubs_are_the_committed_ones() -> None:
    from geonear.v1 import geonear_pb2

    assert Path(geonear_pb2.__file__).resolve().parent == STUB_DIR
    service = geonear_pb2.DESCRIPTOR.services_by_name["GeoNear"]
    assert {m.name for m in service.methods} == {
        "Upload",
        "DeleteRows",
        "ListDatasets",
        "GetDataset",
        "DropDataset",
        "Knn",
        "Radius",
        "KnnStream",
        "RadiusStream",
        "KnnCompact",
        "RadiusCompact",
        "DistanceMatrix",
        "KMeans",
        "ServerInfo",
        "CountWithin",
        "KnnJoin",
        "RadiusJoin",
        "Dbscan",
        "Within",
    }
