"""Dataset names against the data directory, and row-number ids under concurrent appends.

A dataset's name is its folder in the data directory: every name the rule admits must
stay one plain folder inside it, no name may be the directory's own entries, the store
deletes only files it wrote, and a refused name is answered INVALID_ARGUMENT with a
message short enough for a status header. Each test runs a real server on port 0 over a
real data directory.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pytest

from geonear.clients.client import Client
from geonear.service.store import MANIFEST
from geonear.v1 import geonear_pb2 as pb
from geonear.v1 import geonear_pb2_grpc as pb_grpc
from geonear.wire import table_to_messages

Code = grpc.StatusCode

#: Names the rule admits, each a plain folder inside the data directory.
ALLOWED = [
    "a",
    "0",
    "Z" * 128,
    "a.b",
    "a..b",
    "x.",
    "x-",
    "x_y",
    "manifest",
    "Manifest.json.bak",
    "partitions",
    "v00000001.arrow",
]
#: Names that are paths, hidden files, the data directory's own entries, or not the rule's.
REFUSED = [
    "",
    ".",
    "..",
    "...",
    ".hidden",
    "_partitions",
    "_x",
    "-x",
    "manifest.json",
    "MANIFEST.JSON",
    "manifest.json.tmp",
    "Z" * 129,
    "café",
    "点",
    "a/b",
    "a\\b",
    "../outside",
    "a b",
    "a\n",
    "a\x00",
]


def points(n: int, seed: int = 0, ids: bool = True) -> pa.Table:
    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {
        "lat": rng.uniform(-80.0, 80.0, n),
        "lon": rng.uniform(-170.0, 170.0, n),
    }
    if ids:
        columns = {"id": np.arange(n, dtype=np.int64), **columns}
    return pa.table(columns)


def upload_requests(
    name: str, table: pa.Table, mode: int = pb.CREATE, batch_rows: int = 1 << 20
) -> Iterator[pb.UploadRequest]:
    yield pb.UploadRequest(header=pb.UploadHeader(dataset=name, mode=mode))
    for message in table_to_messages(table.combine_chunks(), batch_bytes=batch_rows * 24):
        yield pb.UploadRequest(data=message)


def expect_error(code: grpc.StatusCode, call: Callable[[], Any], *words: str) -> str:
    """Run ``call`` (consuming a stream), assert it fails with ``code``; return the message."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__next__"):
            list(result)
    error = info.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    message = error.details()
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
    return message


def snapshot(folder: Path, leave_out: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` but ``leave_out``: file contents, None for folders."""
    found: dict[str, bytes | None] = {}
    for path in sorted(folder.rglob("*")):
        if path == leave_out or leave_out in path.parents:
            continue
        found[str(path.relative_to(folder))] = path.read_bytes() if path.is_file() else None
    return found


@pytest.fixture
def stub_for() -> Iterator[Callable[[Any], pb_grpc.GeoNearStub]]:
    channels: list[grpc.Channel] = []

    def make(running: Any) -> pb_grpc.GeoNearStub:
        channels.append(grpc.insecure_channel(running.target))
        return pb_grpc.GeoNearStub(channels[-1])

    yield make
    for channel in channels:
        channel.close()


def test_every_name_stays_inside_the_data_directory(server_factory, stub_for, tmp_path) -> None:
    parent = tmp_path / "parent"
    data_dir = parent / "data"
    # What a name escaping the data directory would overwrite or delete.
    (parent / "neighbour").mkdir(parents=True)
    (parent / "neighbour" / "v00000001.arrow").write_bytes(b"not the store's")
    (parent / "v00000001.arrow").write_bytes(b"not the store's either")
    (parent / MANIFEST).write_text('{"someone": "else"}')
    (parent / "notes.txt").write_text("keep me")
    before = snapshot(parent, data_dir)

    first = server_factory(data_dir=data_dir)
    stub = stub_for(first)
    stub.Upload(upload_requests("keeper", points(7)), timeout=30)
    for name in REFUSED:
        message = expect_error(
            Code.INVALID_ARGUMENT,
            lambda name=name: stub.Upload(upload_requests(name, points(3)), timeout=30),
            "dataset name",
        )
        assert len(message) < 400, message
        expect_error(
            Code.INVALID_ARGUMENT,
            lambda name=name: stub.DropDataset(pb.DropDatasetRequest(dataset=name)),
            "dataset name",
        )
    for name in ALLOWED:
        info = stub.Upload(upload_requests(name, points(3)), timeout=30).dataset
        assert (info.name, info.rows) == (name, 3)
        assert (data_dir / name / "v00000001.arrow").is_file()
        stub.DropDataset(pb.DropDatasetRequest(dataset=name))
        assert not (data_dir / name).exists()
    for name in ALLOWED:  # kept this time, to survive the restart
        stub.Upload(upload_requests(name, points(4)), timeout=30)
    first.stop()

    second = server_factory(data_dir=data_dir)
    listed = stub_for(second).ListDatasets(pb.ListDatasetsRequest()).datasets
    assert {d.name: d.rows for d in listed} == {"keeper": 7, **dict.fromkeys(ALLOWED, 4)}
    assert snapshot(parent, data_dir) == before
    manifest = json.loads((data_dir / MANIFEST).read_text())
    assert sorted(manifest["datasets"]) == sorted(["keeper", *ALLOWED])


def test_a_name_differing_from_a_dataset_only_in_case_is_refused(server_factory, stub_for) -> None:
    stub = stub_for(server_factory())
    stub.Upload(upload_requests("Places", points(5)), timeout=30)
    for twin in ("places", "PLACES"):
        expect_error(
            Code.ALREADY_EXISTS,
            lambda twin=twin: stub.Upload(upload_requests(twin, points(3)), timeout=30),
            "only in case",
        )
        expect_error(
            Code.ALREADY_EXISTS,
            lambda twin=twin: stub.Upload(upload_requests(twin, points(3), pb.REPLACE)),
            "only in case",
        )
    assert stub.GetDataset(pb.GetDatasetRequest(dataset="Places")).rows == 5


@pytest.mark.parametrize("name", ["x" * 10_000, "é" * 10_000])
def test_a_long_dataset_name_is_an_invalid_argument(server_factory, stub_for, name) -> None:
    stub = stub_for(server_factory())
    calls: dict[str, Callable[[], Any]] = {
        # several messages: the server answers after the header, with more on the way
        "Upload": lambda: stub.Upload(upload_requests(name, points(5000), batch_rows=500)),
        "GetDataset": lambda: stub.GetDataset(pb.GetDatasetRequest(dataset=name)),
        "Knn": lambda: stub.Knn(
            pb.KnnRequest(dataset=name, queries=pb.Points(lat=[0.0], lon=[0.0]), k=1)
        ),
        "KnnCompact": lambda: stub.KnnCompact(
            pb.KnnRequest(dataset=name, queries=pb.Points(lat=[0.0], lon=[0.0]), k=1)
        ),
        "DropDataset": lambda: stub.DropDataset(pb.DropDatasetRequest(dataset=name)),
    }
    for rpc, call in calls.items():
        message = expect_error(Code.INVALID_ARGUMENT, call, "invalid dataset name", "10000")
        assert len(message.encode()) < 400, (rpc, message)


def test_an_unknown_valid_name_is_still_not_found(server_factory, stub_for) -> None:
    stub = stub_for(server_factory())
    expect_error(
        Code.NOT_FOUND, lambda: stub.GetDataset(pb.GetDatasetRequest(dataset="nowhere")), "nowhere"
    )


def test_drop_removes_only_the_files_the_store_wrote(server_factory, stub_for) -> None:
    running = server_factory()
    stub = stub_for(running)
    data_dir = Path(running.settings.data_dir)
    stub.Upload(upload_requests("pts", points(5)), timeout=30)
    (data_dir / "pts" / "notes.txt").write_text("someone else's")
    (data_dir / "pts" / "extra").mkdir()
    stub.DropDataset(pb.DropDatasetRequest(dataset="pts"))
    assert sorted(p.name for p in (data_dir / "pts").iterdir()) == ["extra", "notes.txt"]
    assert (data_dir / "pts" / "notes.txt").read_text() == "someone else's"
    # the name is free again, and a later drop still leaves the stranger's files
    stub.Upload(upload_requests("pts", points(2)), timeout=30)
    stub.DropDataset(pb.DropDatasetRequest(dataset="pts"))
    assert sorted(p.name for p in (data_dir / "pts").iterdir()) == ["extra", "notes.txt"]


def test_a_start_leaves_entries_the_store_did_not_write(server_factory, stub_for) -> None:
    first = server_factory()
    data_dir = Path(first.settings.data_dir)
    stub_for(first).Upload(upload_requests("pts", points(5)), timeout=30)
    first.stop()
    foreign = {
        "_partitions": None,  # the Dask engine's folder, empty between runs
        ".git/HEAD": b"ref: refs/heads/main\n",
        "README.txt": b"datasets live here\n",
        "pts/notes.txt": b"someone else's\n",
        "pts/draft.arrow.tmp": b"not the store's pattern\n",
        "_old/v00000001.arrow": b"a folder no dataset name of today can have\n",
    }
    for relative, body in foreign.items():
        path = data_dir / relative
        if body is None:
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)

    second = server_factory()
    assert stub_for(second).GetDataset(pb.GetDatasetRequest(dataset="pts")).rows == 5
    for relative, body in foreign.items():
        path = data_dir / relative
        assert path.is_dir() if body is None else path.read_bytes() == body, relative


def test_a_data_directory_from_the_earlier_name_rule_reloads_what_is_safe(
    server_factory, stub_for, tmp_path
) -> None:
    parent = tmp_path / "parent"
    data_dir = parent / "data"
    first = server_factory(data_dir=data_dir)
    stub_for(first).Upload(upload_requests("pts", points(6)), timeout=30)
    first.stop()
    # The earlier rule admitted "_old" (a plain folder) and ".." (the parent).
    shutil.copytree(data_dir / "pts", data_dir / "_old")
    shutil.copy(data_dir / "pts" / "v00000001.arrow", parent / "v00000001.arrow")
    manifest = json.loads((data_dir / MANIFEST).read_text())
    entry = manifest["datasets"]["pts"]
    manifest["datasets"]["_old"] = {**entry, "file": "_old/v00000001.arrow"}
    manifest["datasets"][".."] = {**entry, "file": "../v00000001.arrow"}
    (data_dir / MANIFEST).write_text(json.dumps(manifest))
    outside = (parent / "v00000001.arrow").read_bytes()

    second = server_factory(data_dir=data_dir)
    stub = stub_for(second)
    listed = {d.name: d.rows for d in stub.ListDatasets(pb.ListDatasetsRequest()).datasets}
    assert listed == {"_old": 6, "pts": 6}
    assert (parent / "v00000001.arrow").read_bytes() == outside
    # an earlier name can be read and dropped, not changed
    expect_error(
        Code.INVALID_ARGUMENT,
        lambda: stub.Upload(upload_requests("_old", points(2), pb.APPEND), timeout=30),
        "dataset name",
    )
    stub.DropDataset(pb.DropDatasetRequest(dataset="_old"))
    assert not (data_dir / "_old").exists()
    assert (parent / "v00000001.arrow").read_bytes() == outside


def test_concurrent_appends_without_ids_number_every_row(server_factory) -> None:
    running = server_factory()
    threads, appends, rows = 8, 15, 3
    with Client(running.target, timeout_s=60) as client:
        client.upload("pts", points(5, ids=False))
    failures: list[BaseException] = []
    start = threading.Barrier(threads)

    def append_many(seed: int) -> None:
        with Client(running.target, timeout_s=60) as client:
            start.wait()
            for i in range(appends):
                try:
                    client.upload("pts", points(rows, seed * 100 + i, ids=False), mode="append")
                except Exception as exc:  # counted, so that one failure does not stop the rest
                    failures.append(exc)

    workers = [threading.Thread(target=append_many, args=(s,)) for s in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []
    total = 5 + threads * appends * rows
    dataset = running.store.get("pts")
    assert dataset.rows == total
    assert dataset.version == 1 + threads * appends
    assert sorted(dataset.table.column("id").to_pylist()) == list(range(total))
