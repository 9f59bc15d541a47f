"""benchmarks/transport.py: every variant delivers the table it was sent, and the
hand-written ArrowData is the protobuf message geonear.wire writes. No test asserts a
duration."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import benchmark_scripts
import pyarrow as pa
import pytest

from geonear import wire
from geonear.v1 import geonear_pb2 as pb


@pytest.fixture(scope="module")
def transport() -> ModuleType:
    return benchmark_scripts.load("transport")


def test_every_variant_delivers_the_table(transport: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    report = transport.main(["--rows", "2000", "--repeat", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["host"]["cpu_count"] >= 1 and report["host"]["grpcio"]
    assert set(report["layouts"]) == {"rows", "per_query"}
    for name, layout in report["layouts"].items():
        assert layout["preencoded_bytes_identical"], name
        assert set(layout["variants"]) == set(transport.VARIANTS)
        for variant, entry in layout["variants"].items():
            if variant == "flight-do_get" and transport.FLIGHT_MISSING:
                assert entry["status"] == "skipped" and "pyarrow.flight" in entry["reason"]
                continue
            assert entry["status"] == "ok", (name, variant, entry.get("reason"))
            assert entry["equal"] is True
            assert len(entry["times_ms"]) == 1
            assert entry["fastest_ms"] > 0 and entry["median_ms"] > 0 and entry["mb_per_s"] > 0
            assert entry["client_cpu_ms"] >= 0
            if variant in transport.SERVED:
                assert entry["server_cpu_ms"] >= 0


def test_flight_missing_is_reported_skipped(
    transport: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "FLIGHT_MISSING", "pyarrow.flight is not importable: test")
    report = transport.main(["--rows", "200", "--repeat", "1"])
    for layout in report["layouts"].values():
        for variant, entry in layout["variants"].items():
            if variant == "flight-do_get":
                assert entry["status"] == "skipped"
                assert entry["reason"] == "pyarrow.flight is not importable: test"
            else:
                assert entry["status"] == "ok" and entry["equal"] is True


@pytest.mark.parametrize("layout", ["rows", "per_query"])
def test_preencoded_bytes_are_the_arrowdata_messages(transport: ModuleType, layout: str) -> None:
    table = transport.build_table(layout, 3000, 10)
    batch_bytes = 16 << 10  # several messages
    expected = list(wire.table_to_messages(table, batch_bytes))
    written = list(transport.preencoded_messages(table, batch_bytes))
    assert len(expected) > 2
    assert [pb.ArrowData.FromString(data) for data in written] == expected
    assert written == [message.SerializeToString() for message in expected]
    assert transport.check_preencoded(table, batch_bytes)["bytes_identical"]
    # Read back by hand (no protobuf objects), through geonear.wire's checks.
    for data, message in zip(written, expected, strict=True):
        fields = wire.read_arrowdata(data)
        assert bytes(fields.schema) == message.schema
        assert bytes(fields.record_batch) == message.record_batch
        assert fields.row_count == message.row_count
    received = wire.messages_to_table(iter(written))
    assert received.equals(table, check_metadata=True)
    assert received.equals(wire.messages_to_table(expected), check_metadata=True)


def test_preencoded_empty_table_carries_the_schema(transport: ModuleType) -> None:
    table = transport.build_table("rows", 10, 10).slice(0, 0)
    written = list(transport.preencoded_messages(table))
    assert [pb.ArrowData.FromString(d) for d in written] == list(wire.table_to_messages(table))
    received = wire.messages_to_table(iter(written))
    assert received.num_rows == 0 and received.schema.equals(table.schema, check_metadata=True)


def test_hand_parser_refuses_truncated_messages(transport: ModuleType) -> None:
    table = transport.build_table("rows", 100, 10)
    (data,) = transport.preencoded_messages(table)
    with pytest.raises(wire.WireError):
        wire.read_arrowdata(data[:-3])
    assert isinstance(wire.read_arrowdata(data).record_batch, pa.Buffer)
