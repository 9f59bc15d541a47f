"""Integer columns sent narrower than they are (``narrow_integers``) read back the same.

A count or join answer asked with ``narrow_integers`` carries its ids, ranks and counts
in the smallest types that hold them, each such field marked with its own type; the
reader casts them back. Checked on the codec alone, then on a real server: the bytes on
the wire are narrower, and the table read from them equals the one sent without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import (
    WIDE_TYPE_KEY,
    BatchDecoder,
    Narrowing,
    WireError,
    messages_to_table,
    narrowed,
    narrowest_integer,
    serialized,
    tables_to_encoded,
)


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0, 0, pa.int8()),
        (-128, 127, pa.int8()),
        (0, 128, pa.int16()),
        (-129, 0, pa.int16()),
        (0, 2**15, pa.int32()),
        (-(2**31), 2**31 - 1, pa.int32()),
        (0, 2**31, pa.int64()),
        (-(2**63), 2**63 - 1, pa.int64()),
    ],
)
def test_the_narrowest_type_holds_both_bounds(low: int, high: int, expected: pa.DataType) -> None:
    assert narrowest_integer(low, high) == expected


def _sent(tables: list[pa.Table]) -> list[pb.ArrowData]:
    return [pb.ArrowData.FromString(e.data) for e in tables_to_encoded(tables, 4096)]


def test_narrowed_columns_read_back_in_their_own_types() -> None:
    rows = 3000
    ids = pa.array(np.arange(rows) * 1000 - 5_000_000)
    with_missing = pa.array(np.arange(rows * 3) % 700, mask=np.arange(rows * 3) % 11 == 0)
    table = pa.table(
        {
            "left_id": ids,
            "rank": pa.array(np.arange(rows) % 5, pa.int32()),
            "right_id": pa.FixedSizeListArray.from_arrays(with_missing, 3),
            "listed": pa.ListArray.from_arrays(
                pa.array(np.arange(rows + 1) * 2, pa.int32()), pa.array(np.arange(2 * rows))
            ),
            "distance_m": pa.array(np.linspace(0.0, 1e6, rows)),
            "name": pa.array([f"p{i}" for i in range(rows)]),
        }
    ).replace_schema_metadata({"geonear.layout": "rows"})
    types = {
        "left_id": Narrowing(narrowest_integer(-5_000_000, 1000 * rows)),
        "rank": Narrowing(pa.int8(), pa.int32()),
        "right_id": Narrowing(pa.int16()),
        "listed": Narrowing(pa.int16()),
        "distance_m": Narrowing(pa.int8()),  # not an integer column: left as it is
        "absent": Narrowing(pa.int8()),
    }
    slices = [narrowed(table.slice(i, 1000), types) for i in range(0, rows, 1000)]
    # A column already in its sent type (ids gathered narrow) is marked all the same.
    gathered = table.slice(0, 1000).set_column(
        0, "left_id", table["left_id"][:1000].cast(pa.int32())
    )
    assert narrowed(gathered, types).equals(slices[0], check_metadata=True)
    sent = slices[0].schema
    assert [sent.field(n).type for n in ("left_id", "rank")] == [pa.int32(), pa.int8()]
    assert sent.field("right_id").type == pa.list_(pa.int16(), 3)
    assert sent.field("listed").type == pa.list_(pa.int16())
    assert sent.field("rank").metadata == {WIDE_TYPE_KEY: b"int32"}
    assert sent.field("distance_m").type == pa.float64()
    assert sent.metadata == table.schema.metadata

    messages = _sent(slices)
    decoder = BatchDecoder()
    for message in messages:
        decoder.decode(message)
    assert decoder.schema == sent
    read = messages_to_table(messages)
    assert read.schema == table.schema
    assert read.equals(table)
    assert all(f.metadata is None for f in read.schema)
    assert sum(len(m.record_batch) for m in messages) < sum(
        len(m.record_batch) for m in _sent([table])
    )


@pytest.mark.parametrize(
    ("field", "words"),
    [
        (pa.field("x", pa.int8(), metadata={WIDE_TYPE_KEY: b"banana"}), "unknown type"),
        (pa.field("x", pa.int8(), metadata={WIDE_TYPE_KEY: b"utf8"}), "not an integer"),
        (pa.field("x", pa.float32(), metadata={WIDE_TYPE_KEY: b"int64"}), "not an integer"),
        (pa.field("x", pa.int8(), metadata={WIDE_TYPE_KEY: b"\xff\xfe"}), "unknown type"),
        (pa.field("x", pa.int64(), metadata={WIDE_TYPE_KEY: b"int8"}), "cannot be widened"),
        (pa.field("x", pa.uint32(), metadata={WIDE_TYPE_KEY: b"int64"}), "cannot be widened"),
    ],
)
def test_a_stream_naming_a_type_that_cannot_be_cast_back_is_refused(
    field: pa.Field, words: str
) -> None:
    message = pb.ArrowData(schema=pa.schema([field]).serialize().to_pybytes())
    with pytest.raises(WireError, match=words):
        messages_to_table([message])


# -- through a server ---------------------------------------------------------------------
def _points(ids: Any, seed: int, rows: int = 400) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": ids,
            "lat": rng.uniform(-60, 60, rows),
            "lon": rng.uniform(-180, 180, rows),
            "score": rng.integers(0, 10**12, rows),
        }
    )


@pytest.fixture
def datasets(client: Client) -> Client:
    client.upload("small_ids", _points(np.arange(400) - 200, 0))  # int16 range
    client.upload("wide_ids", _points(np.arange(400) * 2**25, 1))  # beyond int32
    client.upload("named", _points([f"n{i}" for i in range(400)], 2))
    return client


def _both(call: Any, make: Any, **fields: Any) -> tuple[pa.Table, pa.Table, pa.Schema]:
    """The answer without and with narrow_integers, and the schema the narrow one sent."""
    wide = messages_to_table(call(make(**fields)))
    messages = list(call(make(**fields, narrow_integers=True)))
    decoder = BatchDecoder()
    for message in messages:
        decoder.decode(message)
    assert decoder.schema is not None
    return wide, messages_to_table(messages), decoder.schema


@pytest.mark.parametrize("layout", [pb.ROWS, pb.PER_QUERY])
@pytest.mark.parametrize(
    ("left", "right", "left_type", "right_type"),
    [
        ("small_ids", "wide_ids", pa.int16(), pa.int64()),
        ("wide_ids", "small_ids", pa.int64(), pa.int16()),
        ("named", "small_ids", pa.string(), pa.int16()),
        ("small_ids", "small_ids", pa.int16(), pa.int16()),
    ],
)
def test_joins_send_narrow_ids_and_ranks_and_read_back_the_same(
    datasets: Client,
    stub: pb_grpc.GeoNearStub,
    layout: int,
    left: str,
    right: str,
    left_type: pa.DataType,
    right_type: pa.DataType,
) -> None:
    columns = {"left_columns": ["score"], "right_columns": ["score"], "layout": layout}
    for call, make, extra in [
        (stub.KnnJoin, pb.KnnJoinRequest, {"k": 7}),
        (stub.RadiusJoin, pb.RadiusJoinRequest, {"radius_m": 1_500_000.0}),
    ]:
        wide, read, sent = _both(
            call, make, left_dataset=left, right_dataset=right, **columns, **extra
        )
        assert read.equals(wide, check_metadata=True)
        assert read.num_rows == 400 if layout == pb.PER_QUERY else read.num_rows > 400
        assert sent.field("left_id").type == left_type
        right_id = sent.field("right_id").type
        assert (right_id.value_type if layout == pb.PER_QUERY else right_id) == right_type
        assert sent.field("score_left").type == pa.int64()  # attributes keep their type
        if layout == pb.ROWS:
            assert sent.field("rank").type == (pa.int8() if "k" in extra else pa.int16())


def test_counts_send_narrow_keys_and_counts_and_read_back_the_same(
    datasets: Client, stub: pb_grpc.GeoNearStub
) -> None:
    wide, read, sent = _both(
        stub.CountWithin,
        pb.CountWithinRequest,
        dataset="wide_ids",
        left_dataset="small_ids",
        radius_m=2_000_000.0,
    )
    assert read.equals(wide, check_metadata=True)
    assert read.column("count").to_numpy().max() > 0
    assert [f.type for f in sent] == [pa.int16(), pa.int8()]

    everything = 20_000_000.0  # every point of the dataset: 400 a query
    lat, lon = np.zeros(300), np.linspace(-170, 170, 300)
    wide, read, sent = _both(
        stub.CountWithin,
        pb.CountWithinRequest,
        dataset="small_ids",
        queries=pb.Points(lat=lat.tolist(), lon=lon.tolist()),
        radius_m=everything,
    )
    assert read.equals(wide, check_metadata=True)
    assert read.column("count").to_pylist() == [400] * 300
    assert [f.type for f in sent] == [pa.int16(), pa.int16()]


def test_the_client_asks_for_narrow_integers_and_returns_int64(datasets: Client) -> None:
    joined = datasets.knn_join("small_ids", "small_ids", 3, as_arrow=True)
    assert [joined.schema.field(n).type for n in ("left_id", "rank", "right_id")] == [
        pa.int64(),
        pa.int32(),
        pa.int64(),
    ]
    assert joined.column("rank").to_pylist()[:3] == [0, 1, 2]
    counted = datasets.count_within("small_ids", radius_m=1.0, left="small_ids", as_arrow=True)
    assert counted.column("count").type == pa.int64()
    assert counted.column("count").to_pylist() == [1] * 400
    assert counted.column("left_id").to_pylist() == list(range(-200, 200))


def test_the_wire_bytes_are_fewer(datasets: Client, stub: pb_grpc.GeoNearStub) -> None:
    def size(narrow: bool) -> int:
        request = pb.KnnJoinRequest(
            left_dataset="small_ids",
            right_dataset="small_ids",
            k=5,
            layout=pb.PER_QUERY,
            narrow_integers=narrow,
        )
        return sum(len(serialized(m)) for m in stub.KnnJoin(request))

    # 400 left points: 8 + 5 x (8 + 8) bytes each, against 2 + 5 x (2 + 8): 36 fewer,
    # less the two fields' metadata
    assert size(True) <= size(False) - 400 * 34
