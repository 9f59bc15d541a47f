"""The dataset store: named, versioned, immutable point sets and their persistence.

A change (upload, append, replace, delete) builds a complete new
:class:`DatasetVersion` (table and index) and then swaps it in; queries hold a reference
to the version they started on, so they finish on it, and a failed change leaves the
previous version in place. Changes to the store are serialised by one lock; queries
take no lock.

With a data directory, every version is written (temporary file, fsync, rename, fsync
of the directory) before the change is acknowledged, and a manifest records the current
version of every dataset, updated the same way. At start the manifest's datasets are
reloaded; a file that cannot be read is reported and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from geonear.service.engines import Engine, PointIndex
from geonear.service.errors import DatasetExists, DatasetNotFound, InvalidInput, Precondition
from geonear.service.host_memory import release_freed_memory
from geonear.service.validation import check_dataset_name, check_unique_ids

log = logging.getLogger("geonear.store")

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DatasetVersion:
    """One immutable version of a dataset: its table and the engine's index over it."""

    name: str
    version: int
    table: pa.Table  # id, lat, lon, attributes; one chunk per column
    index: PointIndex
    engine: str
    created_unix_s: float = field(default_factory=time.time)

    @property
    def rows(self) -> int:
        return self.table.num_rows

    @property
    def lat(self) -> np.ndarray:
        return column_numpy(self.table, "lat")

    @property
    def lon(self) -> np.ndarray:
        return column_numpy(self.table, "lon")

    @property
    def host_bytes(self) -> int:
        """Table buffers plus the index's own host memory (buffers are shared, not copied)."""
        return int(self.table.nbytes + self.index.host_bytes)

    @property
    def id_type(self) -> str:
        return str(self.table.schema.field("id").type)

    def bounding_box(self) -> tuple[float, float, float, float]:
        """(min_lat, min_lon, max_lat, max_lon) in degrees; zeros when empty."""
        if self.rows == 0:
            return (0.0, 0.0, 0.0, 0.0)
        lat, lon = self.lat, self.lon
        return (float(lat.min()), float(lon.min()), float(lat.max()), float(lon.max()))


def column_numpy(table: pa.Table, name: str) -> np.ndarray:
    """A numeric column as a NumPy view of the Arrow buffer (no copy for one chunk)."""
    col = table.column(name)
    if col.num_chunks == 1:
        return col.chunk(0).to_numpy(zero_copy_only=col.null_count == 0)
    return col.to_numpy()


class DatasetStore:
    """Datasets by name, built by one engine, optionally persisted in ``data_dir``."""

    def __init__(self, engine: Engine, data_dir: Path | None = None) -> None:
        self.engine = engine
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._datasets: dict[str, DatasetVersion] = {}
        self._lock = threading.Lock()
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)

    # -- reading -------------------------------------------------------------------------
    def get(self, name: str) -> DatasetVersion:
        try:
            return self._datasets[name]
        except KeyError:
            raise DatasetNotFound(
                f"no dataset named {name!r}; ListDatasets shows the names there are"
            ) from None

    def datasets(self) -> list[DatasetVersion]:
        return sorted(self._datasets.values(), key=lambda d: d.name)

    # -- changing ------------------------------------------------------------------------
    def upload(self, name: str, mode: str, table: pa.Table) -> DatasetVersion:
        """Create, replace or append; ``table`` is already normalised (id, lat, lon, ...)."""
        check_dataset_name(name)
        with self._lock:
            current = self._datasets.get(name)
            if mode == "create" and current is not None:
                raise DatasetExists(
                    f"dataset {name!r} exists (version {current.version}); "
                    "use mode replace or append"
                )
            if mode == "append":
                if current is None:
                    raise DatasetNotFound(
                        f"cannot append to {name!r}: no such dataset; use mode create"
                    )
                table = _append(current.table, table)
            check_unique_ids(table.column("id"))
            version = 1 if current is None else current.version + 1
            return self._commit(name, version, table)

    def delete_rows(
        self, name: str, ids: Iterable[int] | Iterable[str]
    ) -> tuple[DatasetVersion, int, int]:
        """Delete rows by id; returns (new version, rows deleted, ids not found)."""
        with self._lock:
            current = self.get(name)
            id_col = current.table.column("id")
            wanted = pa.array(list(ids), type=id_col.type)
            if len(wanted) == 0:
                return current, 0, 0
            unique_wanted = pc.unique(wanted)
            drop = pc.is_in(id_col, value_set=unique_wanted)
            n_deleted = int(pc.sum(drop).as_py() or 0)
            not_found = len(unique_wanted) - n_deleted
            if n_deleted == 0:
                return current, 0, not_found
            if n_deleted == current.rows:
                raise Precondition(
                    f"deleting these ids would leave {name!r} empty; drop the dataset instead"
                )
            table = current.table.filter(pc.invert(drop)).combine_chunks()
            return self._commit(name, current.version + 1, table), n_deleted, not_found

    def drop(self, name: str) -> DatasetVersion:
        with self._lock:
            current = self.get(name)
            if self.data_dir is not None:
                self._write_manifest({k: v for k, v in self._datasets.items() if k != name})
                _remove_tree(self.data_dir / name)
            del self._datasets[name]
            release_freed_memory()
            return current

    def _commit(self, name: str, version: int, table: pa.Table) -> DatasetVersion:
        built = self._build(name, version, table)
        if self.data_dir is not None:
            self._persist(built)
        previous = self._datasets.get(name)
        self._datasets[name] = built
        if self.data_dir is not None:
            self._write_manifest(self._datasets)
            if previous is not None:
                _unlink(self._version_path(name, previous.version))
        log.info("dataset %s version %d: %d rows", name, version, table.num_rows)
        release_freed_memory()
        return built

    def _build(self, name: str, version: int, table: pa.Table) -> DatasetVersion:
        table = table.combine_chunks()
        index = self.engine.build_index(column_numpy(table, "lat"), column_numpy(table, "lon"))
        return DatasetVersion(
            name=name, version=version, table=table, index=index, engine=self.engine.name
        )

    # -- persistence ---------------------------------------------------------------------
    def _version_path(self, name: str, version: int) -> Path:
        assert self.data_dir is not None
        return self.data_dir / name / f"v{version:08d}.arrow"

    def _persist(self, dataset: DatasetVersion) -> None:
        path = self._version_path(dataset.name, dataset.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".arrow.tmp")
        with open(tmp, "wb") as f:
            with pa.ipc.new_file(f, dataset.table.schema) as writer:
                writer.write_table(dataset.table, max_chunksize=1 << 20)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def _write_manifest(self, datasets: dict[str, DatasetVersion]) -> None:
        assert self.data_dir is not None
        body = {
            "format": 1,
            "datasets": {
                d.name: {
                    "version": d.version,
                    "file": str(self._version_path(d.name, d.version).relative_to(self.data_dir)),
                    "rows": d.rows,
                    "created_unix_s": d.created_unix_s,
                }
                for d in datasets.values()
            },
        }
        tmp = self.data_dir / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.data_dir / MANIFEST)
        _fsync_dir(self.data_dir)

    def load_persisted(self) -> list[str]:
        """Reload the datasets the manifest lists; returns the names of those skipped."""
        if self.data_dir is None or not (self.data_dir / MANIFEST).exists():
            return []
        try:
            manifest = json.loads((self.data_dir / MANIFEST).read_text())
            entries = dict(manifest["datasets"])
        except (ValueError, KeyError, TypeError) as exc:
            log.error(
                "manifest %s is unreadable (%s); starting with no datasets",
                self.data_dir / MANIFEST,
                exc,
            )
            return ["<manifest>"]
        skipped = []
        for name, entry in sorted(entries.items()):
            try:
                with pa.memory_map(str(self.data_dir / entry["file"])) as source:
                    table = pa.ipc.open_file(source).read_all()
                if table.num_rows != entry["rows"]:
                    raise ValueError(f"holds {table.num_rows} rows, manifest says {entry['rows']}")
                built = self._build(name, int(entry["version"]), table)
            except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
                log.error(
                    "dataset %s: cannot reload %s (%s); skipped", name, entry.get("file"), exc
                )
                skipped.append(name)
                continue
            self._datasets[name] = built
            log.info("reloaded dataset %s version %d: %d rows", name, built.version, built.rows)
        return skipped


def _append(old: pa.Table, new: pa.Table) -> pa.Table:
    if old.schema.remove_metadata() != new.schema.remove_metadata():
        raise Precondition(
            "appended rows must have the dataset's columns and types: dataset has "
            f"{_schema_text(old.schema)}, upload has {_schema_text(new.schema)}"
        )
    if new.column("id").type != old.column("id").type:
        raise InvalidInput("appended ids must have the dataset's id type")
    return pa.concat_tables([old, new.cast(old.schema)])


def _schema_text(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _remove_tree(path: Path) -> None:
    if path.exists():
        for child in path.iterdir():
            child.unlink()
        path.rmdir()
        _fsync_dir(path.parent)
