"""Durability: the store's files after crashes, torn writes and leftovers.

The crash test runs ``geonear serve`` as a separate process, changes datasets from
concurrent clients, kills the server with SIGKILL at random moments, restarts it on the
same data directory and checks that every acknowledged change is there (version, row
count, checksum of the ids) and that nothing half-written is visible. A change in
flight when the server died may or may not have happened, but nothing in between.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from server_process import start_server

from geonear.clients.client import Client
from geonear.clients.errors import GeoNearError
from geonear.service.engines import create_engine
from geonear.service.errors import ServiceError
from geonear.service.store import MANIFEST, DatasetStore
from geonear.service.validation import normalise_upload

KILLS = 22
CLIENTS = 3
DATASETS_PER_CLIENT = 2
#: Rows above which a client shrinks a dataset instead of growing it (KNN with k = rows
#: reads every id back, and k is capped at max_k = 10 000).
MAX_ROWS = 6000


# -- the server process ------------------------------------------------------------------
class ServerProcess:
    """``python -m geonear serve`` on a free port; the log goes to a file, not a pipe."""

    def __init__(self, data_dir: Path, workdir: Path) -> None:
        self.data_dir = data_dir
        self.workdir = workdir
        self.starts = 0
        self.proc: subprocess.Popen | None = None
        self.target = ""

    def start(self) -> None:
        self.starts += 1
        args = ["-m", "geonear", "serve", "--port", "0", "--data-dir", str(self.data_dir)]
        log_path = self.workdir / f"server-{self.starts}.log"
        self.proc, self.target = start_server([*args, "--backend", "cpu"], log_path, self.workdir)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


# -- what the clients know ------------------------------------------------------------------
@dataclass(frozen=True)
class State:
    """A dataset as a client expects to find it: version and the ids it holds."""

    version: int
    ids: tuple[int, ...]

    @property
    def checksum(self) -> str:
        return hashlib.sha256(np.sort(np.array(self.ids, dtype=np.int64)).tobytes()).hexdigest()

    def key(self) -> tuple[int, int, str]:
        return (self.version, len(self.ids), self.checksum)


def _table(ids: np.ndarray, rng: np.random.Generator) -> pa.Table:
    n = ids.shape[0]
    return pa.table(
        {
            "id": ids.astype(np.int64),
            "lat": rng.uniform(-89.0, 89.0, n),
            "lon": rng.uniform(-179.0, 179.0, n),
            "weight": rng.uniform(0.0, 1.0, n),
        }
    )


class Worker:
    """One client: changes only its own datasets, one call at a time."""

    def __init__(self, number: int, seed: int) -> None:
        self.names = [f"c{number}_{j}" for j in range(DATASETS_PER_CLIENT)]
        self.acked: dict[str, State | None] = dict.fromkeys(self.names)
        #: The change in flight when the server died: (dataset, state it would leave).
        self.pending: tuple[str, State | None] | None = None
        self.rng = np.random.default_rng(seed)
        self.next_id = number * 10**9
        self.acknowledged = 0
        self.errors: list[str] = []

    def fresh_ids(self, n: int) -> np.ndarray:
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        return ids

    def step(self, client: Client) -> None:
        name = self.names[int(self.rng.integers(len(self.names)))]
        state = self.acked[name]
        n = int(self.rng.integers(200, 3000))
        if state is None:
            ids = self.fresh_ids(n)
            after: State | None = State(1, tuple(ids.tolist()))
            self.pending = (name, after)
            client.upload(name, _table(ids, self.rng), mode="create")
        else:
            choice = self.rng.choice(
                ["append", "delete", "replace", "drop"], p=[0.4, 0.3, 0.2, 0.1]
            )
            if choice == "append" and len(state.ids) + n > MAX_ROWS:
                choice = "delete"
            if choice == "append":
                ids = self.fresh_ids(n)
                after = State(state.version + 1, state.ids + tuple(ids.tolist()))
                self.pending = (name, after)
                client.upload(name, _table(ids, self.rng), mode="append")
            elif choice == "replace":
                ids = self.fresh_ids(n)
                after = State(state.version + 1, tuple(ids.tolist()))
                self.pending = (name, after)
                client.upload(name, _table(ids, self.rng), mode="replace")
            elif choice == "delete" and len(state.ids) > 1:
                current = np.array(state.ids)
                gone = self.rng.choice(current, size=max(1, len(current) // 5), replace=False)
                kept = tuple(int(i) for i in current[~np.isin(current, gone)])
                after = State(state.version + 1, kept)
                self.pending = (name, after)
                client.delete(name, gone.tolist())
            else:
                after = None
                self.pending = (name, None)
                client.drop(name)
        self.acked[name] = after
        self.pending = None
        self.acknowledged += 1

    def run(self, target: str, dying: threading.Event) -> None:
        with Client(target, timeout_s=20) as client:
            while True:
                try:
                    self.step(client)
                except GeoNearError as exc:
                    if not dying.is_set():
                        self.errors.append(f"{self.names}: {exc}")
                    return


def observe(client: Client, name: str) -> State | None:
    """The dataset as the server shows it, ids read back through a KNN of every row."""
    found = {d.name: d for d in client.datasets()}
    if name not in found:
        return None
    info = found[name]
    table = client.knn(name, 0.0, 0.0, k=max(1, info.rows), as_arrow=True)
    ids = tuple(table.column("id").to_pylist())
    assert len(ids) == info.rows == client.info(name).rows
    return State(int(info.version), ids)


def check_data_dir(data_dir: Path) -> None:
    """No temporary file left, the manifest names existing files only, one per dataset."""
    assert not [p for p in data_dir.rglob("*.tmp")]
    manifest = (
        json.loads((data_dir / MANIFEST).read_text())
        if (data_dir / MANIFEST).exists()
        else {"datasets": {}}
    )
    for name, entry in manifest["datasets"].items():
        assert (data_dir / entry["file"]).is_file(), name
        assert [p.name for p in (data_dir / name).glob("v*.arrow")] == [Path(entry["file"]).name]


@pytest.mark.slow
def test_acknowledged_changes_survive_sigkill(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = ServerProcess(data_dir, tmp_path)
    random.seed(20240601)
    workers = [Worker(i, seed=100 + i) for i in range(CLIENTS)]
    owned = {name for w in workers for name in w.names}
    kills = 0
    in_flight = {"applied": 0, "not applied": 0}
    try:
        server.start()
        for _ in range(KILLS):
            dying = threading.Event()
            threads = [
                threading.Thread(target=w.run, args=(server.target, dying), daemon=True)
                for w in workers
            ]
            for t in threads:
                t.start()
            time.sleep(random.uniform(0.2, 1.5))
            dying.set()
            server.kill()
            kills += 1
            for t in threads:
                t.join(30)
                assert not t.is_alive()
            server.start()
            check_data_dir(data_dir)
            with Client(server.target, timeout_s=30) as client:
                assert {d.name for d in client.datasets()} <= owned, "a dataset nobody made"
                for w in workers:
                    assert not w.errors, w.errors
                    for name in w.names:
                        seen = observe(client, name)
                        allowed = [w.acked[name]]
                        if w.pending is not None and w.pending[0] == name:
                            allowed.append(w.pending[1])
                        keys = [None if s is None else s.key() for s in allowed]
                        assert (None if seen is None else seen.key()) in keys, (
                            f"{name} after kill {kills}: found "
                            f"{None if seen is None else seen.key()[:2]}, expected one of "
                            f"{[k if k is None else k[:2] for k in keys]}"
                        )
                        if w.pending is not None and w.pending[0] == name:
                            same = (None if seen is None else seen.key()) == keys[-1]
                            in_flight["applied" if same else "not applied"] += 1
                        w.acked[name] = seen
                    w.pending = None
    finally:
        server.stop()
    acknowledged = sum(w.acknowledged for w in workers)
    print(
        f"crash test: {kills} kills, {acknowledged} acknowledged changes, "
        f"changes in flight {in_flight}"
    )
    assert kills >= 20
    # The clients really worked between the kills, and kills landed inside changes.
    assert acknowledged >= 3 * kills
    assert sum(in_flight.values()) >= kills


# -- the store's files, one case at a time ----------------------------------------------------
def _store(data_dir: Path) -> DatasetStore:
    store = DatasetStore(create_engine("cpu", 6_371_008.8), data_dir)
    store.load_persisted()
    return store


def _upload(store: DatasetStore, name: str, n: int, mode: str = "create") -> None:
    rng = np.random.default_rng(n)
    table = pa.table({"lat": rng.uniform(-80, 80, n), "lon": rng.uniform(-170, 170, n)})
    first_id = store.get(name).rows * 1000 if mode == "append" else 0
    store.upload(name, mode, normalise_upload(table, first_row_id=first_id))


def test_a_torn_file_is_reported_set_aside_and_the_others_load(tmp_path, caplog) -> None:
    store = _store(tmp_path)
    _upload(store, "good", 100)
    _upload(store, "torn", 5000)
    path = tmp_path / "torn" / "v00000001.arrow"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    reloaded = DatasetStore(create_engine("cpu", 6_371_008.8), tmp_path)
    assert reloaded.load_persisted() == ["torn"]
    assert [d.name for d in reloaded.datasets()] == ["good"]
    assert "torn" in caplog.text and "skipped" in caplog.text
    assert (tmp_path / "torn" / "v00000001.arrow.corrupt").exists()
    # The next change writes a manifest without the torn dataset.
    _upload(reloaded, "good", 50, mode="append")
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert sorted(manifest["datasets"]) == ["good"]


def test_a_file_with_flipped_bytes_is_skipped(tmp_path) -> None:
    store = _store(tmp_path)
    _upload(store, "flipped", 3000)
    path = tmp_path / "flipped" / "v00000001.arrow"
    data = bytearray(path.read_bytes())
    for i in range(64, len(data) - 64, 97):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    reloaded = DatasetStore(create_engine("cpu", 6_371_008.8), tmp_path)
    skipped = reloaded.load_persisted()
    # Either the file fails to read, or what it holds fails validation: never loaded
    # with different contents than were written.
    if skipped:
        assert skipped == ["flipped"]
    else:
        assert reloaded.get("flipped").rows == 3000


def test_leftover_temporary_files_and_unnamed_versions_are_removed_at_start(tmp_path) -> None:
    store = _store(tmp_path)
    _upload(store, "pts", 100)
    (tmp_path / "pts" / "v00000002.arrow.tmp").write_bytes(b"half a file")
    (tmp_path / (MANIFEST + ".tmp")).write_text("{")
    # A version written but never named by the manifest: a crash before the rename.
    (tmp_path / "pts" / "v00000003.arrow").write_bytes(
        (tmp_path / "pts" / "v00000001.arrow").read_bytes()
    )
    (tmp_path / "ghost").mkdir()
    (tmp_path / "ghost" / "v00000001.arrow").write_bytes(b"dropped, crash before delete")
    reloaded = _store(tmp_path)
    assert reloaded.get("pts").version == 1
    assert sorted(p.name for p in (tmp_path / "pts").iterdir()) == ["v00000001.arrow"]
    assert not (tmp_path / (MANIFEST + ".tmp")).exists()
    assert not (tmp_path / "ghost").exists()


def test_an_unreadable_manifest_deletes_nothing(tmp_path) -> None:
    store = _store(tmp_path)
    _upload(store, "pts", 100)
    (tmp_path / MANIFEST).write_text("{not json")
    reloaded = DatasetStore(create_engine("cpu", 6_371_008.8), tmp_path)
    assert reloaded.load_persisted() == ["<manifest>"]
    assert (tmp_path / "pts" / "v00000001.arrow").exists()


def test_a_manifest_naming_a_file_outside_the_dataset_is_refused(tmp_path) -> None:
    store = _store(tmp_path)
    _upload(store, "pts", 100)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["datasets"]["pts"]["file"] = "../elsewhere.arrow"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    reloaded = DatasetStore(create_engine("cpu", 6_371_008.8), tmp_path)
    assert reloaded.load_persisted() == ["pts"]


def test_drop_and_delete_are_durable(tmp_path) -> None:
    store = _store(tmp_path)
    _upload(store, "kept", 100)
    _upload(store, "dropped", 100)
    store.delete_rows("kept", list(range(10)))
    store.drop("dropped")
    reloaded = _store(tmp_path)
    assert [d.name for d in reloaded.datasets()] == ["kept"]
    kept = reloaded.get("kept")
    assert (kept.version, kept.rows) == (2, 90)
    assert min(kept.table.column("id").to_pylist()) == 10
    assert not (tmp_path / "dropped").exists()
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["v00000002.arrow"]


def test_a_failed_write_changes_nothing(tmp_path) -> None:
    store = _store(tmp_path)
    _upload(store, "pts", 100)
    # A folder where the next version's file would go makes the rename fail for real.
    (tmp_path / "pts" / "v00000002.arrow").mkdir()
    with pytest.raises(ServiceError, match="nothing was changed"):
        _upload(store, "pts", 50, mode="append")
    assert store.get("pts").version == 1
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["datasets"]["pts"]["version"] == 1
    os.rmdir(tmp_path / "pts" / "v00000002.arrow")
    assert _store(tmp_path).get("pts").rows == 100
