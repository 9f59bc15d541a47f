"""Regenerate the Python stubs of the contract: ``python proto/generate.py``.

The stubs (``geonear_pb2.py``, ``geonear_pb2.pyi``, ``geonear_pb2_grpc.py``) are
committed next to the .proto; ``tests/test_proto_stubs.py`` fails when they are stale.
grpcio-tools is pinned in pyproject.toml so the output is reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = PROTO_ROOT / "geonear" / "v1" / "geonear.proto"


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Run grpcio-tools' protoc on the contract, writing stubs under ``out_dir``."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    # The well-known types (google/protobuf/timestamp.proto) ship with grpcio-tools.
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + str(PROTO_FILE))
    stub_dir = out_dir / "geonear" / "v1"
    return sorted(stub_dir.glob("geonear_pb2*"))


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
