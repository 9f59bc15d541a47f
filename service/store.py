"""The dataset store: named, versioned, immutable point sets and their persistence.

A change (upload, append, replace, delete) builds a complete new
:class:`DatasetVersion` (table and index) and then swaps it in; queries hold a reference
to the version they started on, so they finish on it, and a failed change leaves the
previous version in place. Changes to the store are serialised by one lock; queries
take no lock.

With a data directory, every version is written (temporary file, fsync, rename, fsync
of the directory) before the change is acknowledged, and a manifest records the current
version of every dataset, updated the same way. The order of the steps keeps the
manifest pointing at complete files only: a new version's file is durable before the
manifest names it, and an old version's file is deleted only after the manifest stops
naming it. A crash between the steps leaves at most an unnamed file behind.

The data directory holds the manifest and one folder per dataset, named as the dataset
(the name rule in :mod:`~geonear.service.validation` keeps every name one plain path
component, apart from the directory's own entries). The store deletes only files of its
own: a dropped dataset's version file that the manifest named, and its folder once
empty.

At start, leftover temporary files are deleted, the manifest's datasets are reloaded
(each file validated in full), a file that cannot be read is reported, renamed
``*.corrupt`` and skipped without taking the others down, and version files the
manifest does not name are deleted. Both cleanups look only at files of the version-file
pattern inside dataset folders; anything else in the data directory is left alone.

The store also holds the memory budget for datasets (``max_dataset_host_bytes``,
``max_dataset_device_bytes``): a change that would take all datasets together beyond
it is refused before it replaces anything.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from geonear.service.engines import Engine, PointIndex
from geonear.service.errors import (
    DatasetExists,
    DatasetNotFound,
    InvalidInput,
    LimitExceeded,
    Precondition,
    ServiceError,
)
from geonear.service.host_memory import release_freed_memory
from geonear.service.settings import Limits
from geonear.service.validation import (
    DATA_DIR_ENTRIES,
    DATASET_NAME,
    check_dataset_name,
    check_unique_ids,
    shown_name,
)
from geonear.wire import narrowest_integer

log = logging.getLogger("geonear.store")

MANIFEST = "manifest.json"
#: Names of the files the store writes inside a dataset's folder.
_VERSION_FILE = re.compile(r"v\d{8}\.arrow")
_TMP_SUFFIX = ".tmp"
#: Names an earlier, looser rule admitted: such datasets can still be reloaded, queried
#: and dropped, but no new dataset takes one.
_EARLIER_DATASET_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
assert {MANIFEST, MANIFEST + _TMP_SUFFIX} <= DATA_DIR_ENTRIES


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

    @functools.cached_property
    def int_ids(self) -> np.ndarray | None:
        """Integer ids as a NumPy view of the id column (None for string ids), kept."""
        if not pa.types.is_integer(self.table.schema.field("id").type):
            return None
        return column_numpy(self.table, "id")

    @functools.cached_property
    def narrow_id_type(self) -> pa.DataType | None:
        """The smallest integer type holding every id (answers' ``narrow_integers``);
        None for string ids or no rows, kept."""
        ids = self.int_ids
        if ids is None or ids.shape[0] == 0:
            return None
        return narrowest_integer(int(ids.min()), int(ids.max()))

    @functools.cached_property
    def narrow_ids(self) -> np.ndarray | None:
        """The integer ids in ``narrow_id_type`` (None as there), kept: answers sent with
        narrow integers gather their ids from it, half the bytes of int64 or less."""
        narrow = self.narrow_id_type
        if narrow is None or self.int_ids is None:
            return None
        return self.int_ids.astype(narrow.to_pandas_dtype(), copy=False)

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

    def __init__(
        self, engine: Engine, data_dir: Path | None = None, limits: Limits | None = None
    ) -> None:
        self.engine = engine
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.limits = limits or Limits()
        self._host_budget = self.limits.dataset_host_bytes()
        self._datasets: dict[str, DatasetVersion] = {}
        self._lock = threading.Lock()
        #: Set when several processes serve one data directory: none may change it.
        self.read_only_reason: str | None = None
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)

    # -- reading -------------------------------------------------------------------------
    def get(self, name: str) -> DatasetVersion:
        try:
            return self._datasets[name]
        except KeyError:
            pass
        check_dataset_name(name)  # a name no dataset can have is a bad argument
        raise DatasetNotFound(f"no dataset named {name!r}; ListDatasets shows the names there are")

    def datasets(self) -> list[DatasetVersion]:
        return sorted(self._datasets.values(), key=lambda d: d.name)

    def host_bytes(self) -> int:
        """Host memory held by all datasets' current versions."""
        return sum(d.host_bytes for d in list(self._datasets.values()))

    def device_bytes(self) -> int:
        """Device memory held by all datasets' current versions."""
        return sum(d.index.device_bytes for d in list(self._datasets.values()))

    def check_host_budget(self, name: str, new_bytes: int) -> None:
        """Refuse when ``new_bytes`` for ``name`` (replacing its current version) won't fit.

        Called as an upload arrives too, so that one far beyond the budget is refused
        before the whole of it has been received.
        """
        others = sum(d.host_bytes for n, d in list(self._datasets.items()) if n != name)
        if others + new_bytes > self._host_budget:
            raise LimitExceeded(
                f"dataset {name!r} needs {new_bytes} bytes of host memory; with the other "
                f"datasets' {others} that exceeds max_dataset_host_bytes={self._host_budget} "
                "(setting GEONEAR_MAX_DATASET_HOST_BYTES); drop datasets or raise the limit"
            )

    def _check_device_budget(self, name: str, new_bytes: int) -> None:
        budget = self.limits.max_dataset_device_bytes
        if not budget:
            return
        others = sum(d.index.device_bytes for n, d in self._datasets.items() if n != name)
        if others + new_bytes > budget:
            raise LimitExceeded(
                f"dataset {name!r} needs {new_bytes} bytes of device memory; with the other "
                f"datasets' {others} that exceeds max_dataset_device_bytes={budget} "
                "(setting GEONEAR_MAX_DATASET_DEVICE_BYTES); drop datasets or raise the limit"
            )

    # -- changing ------------------------------------------------------------------------
    def _refuse_if_read_only(self) -> None:
        if self.read_only_reason is not None:
            raise Precondition(self.read_only_reason)

    def upload(
        self, name: str, mode: str, table: pa.Table, row_numbers: bool = False
    ) -> DatasetVersion:
        """Create, replace or append; ``table`` is already normalised (id, lat, lon, ...).

        With ``row_numbers``, the table's ids are replaced by row numbers: from 0, or for
        an append from one past the dataset's largest id, taken under the lock so that
        concurrent appends number their rows one after another.
        """
        self._refuse_if_read_only()
        check_dataset_name(name)
        with self._lock:
            current = self._datasets.get(name)
            if mode == "create" and current is not None:
                raise DatasetExists(
                    f"dataset {name!r} exists (version {current.version}); "
                    "use mode replace or append"
                )
            if current is None:
                self._refuse_case_twin(name)
            if mode == "append":
                if current is None:
                    raise DatasetNotFound(
                        f"cannot append to {name!r}: no such dataset; use mode create"
                    )
                if row_numbers:
                    table = _number_rows(table, _next_row_number(current.table))
                table = _append(current.table, table)
            elif row_numbers:
                table = _number_rows(table, 0)
            check_unique_ids(table.column("id"))
            version = 1 if current is None else current.version + 1
            return self._commit(name, version, table)

    def _refuse_case_twin(self, name: str) -> None:
        """Refuse a new name that differs from a dataset's only in case.

        On a case-insensitive file system the two would share one folder and overwrite
        each other's files; refused everywhere, so that a name valid on one server is
        valid on all.
        """
        folded = name.casefold()
        twin = next((n for n in self._datasets if n.casefold() == folded), None)
        if twin is not None:
            raise DatasetExists(
                f"dataset {twin!r} exists and differs from {name!r} only in case; "
                "dataset names must differ in more than case"
            )

    def delete_rows(
        self, name: str, ids: Iterable[int] | Iterable[str]
    ) -> tuple[DatasetVersion, int, int]:
        """Delete rows by id; returns (new version, rows deleted, ids not found)."""
        self._refuse_if_read_only()
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
        """Remove a dataset; durable once the manifest no longer names it."""
        self._refuse_if_read_only()
        with self._lock:
            current = self.get(name)
            if self.data_dir is not None:
                remaining = {k: v for k, v in self._datasets.items() if k != name}
                with _storage_errors(name):
                    self._write_manifest(remaining)
                # The manifest no longer names the file: a crash or failure here leaves
                # an orphan that the next start deletes.
                path = self._version_path(name, current.version)
                try:
                    _unlink(path)
                    _remove_if_empty(path.parent)
                except OSError as exc:
                    log.warning("dataset %s dropped; cannot remove %s yet: %s", name, path, exc)
            del self._datasets[name]
            release_freed_memory()
            return current

    def _commit(self, name: str, version: int, table: pa.Table) -> DatasetVersion:
        # Refuse by the table's size before paying for an index, then by the real size.
        self.check_host_budget(name, int(table.nbytes))
        built = self._build(name, version, table)
        self.check_host_budget(name, built.host_bytes)
        self._check_device_budget(name, built.index.device_bytes)
        previous = self._datasets.get(name)
        if self.data_dir is not None:
            path = self._version_path(name, version)
            with _storage_errors(name):
                try:
                    self._persist(built)
                    self._write_manifest({**self._datasets, name: built})
                except OSError:
                    _unlink(path)
                    raise
            if previous is not None:
                _unlink(self._version_path(name, previous.version))
        self._datasets[name] = built
        log.info("dataset %s version %d: %d rows", name, version, table.num_rows)
        release_freed_memory()
        return built

    def _build(self, name: str, version: int, table: pa.Table) -> DatasetVersion:
        table = table.combine_chunks()
        index = self.engine.build_index(column_numpy(table, "lat"), column_numpy(table, "lon"))
        index.keep_columns(table.drop_columns(["lat", "lon"]))
        return DatasetVersion(
            name=name, version=version, table=table, index=index, engine=self.engine.name
        )

    # -- persistence ---------------------------------------------------------------------
    def _version_path(self, name: str, version: int) -> Path:
        return self._folder(name) / f"v{version:08d}.arrow"

    def _folder(self, name: str) -> Path:
        """The dataset's folder: one plain path component below the data directory."""
        if not _is_folder_name(name):
            raise InvalidInput(f"dataset name {shown_name(name)} cannot name a folder")
        return self._root / name

    def _persist(self, dataset: DatasetVersion) -> None:
        path = self._version_path(dataset.name, dataset.version)
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            _fsync_dir(path.parent.parent)
        tmp = path.with_suffix(".arrow" + _TMP_SUFFIX)
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
        tmp = self.data_dir / (MANIFEST + _TMP_SUFFIX)
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.data_dir / MANIFEST)
        _fsync_dir(self.data_dir)

    def load_persisted(self) -> list[str]:
        """Reload the datasets the manifest lists; returns the names of those skipped.

        Leftover temporary files are deleted first; after a readable manifest, so are
        version files it does not name (left by a crash between the steps of a change).
        """
        if self.data_dir is None:
            return []
        owns_files = self.read_only_reason is None  # readers leave the files as they are
        if owns_files:
            self._remove_temporary_files()
        if not (self.data_dir / MANIFEST).exists():
            return []
        try:
            manifest = json.loads((self.data_dir / MANIFEST).read_text())
            entries = dict(manifest["datasets"])
        except (ValueError, KeyError, TypeError, OSError) as exc:
            log.error(
                "manifest %s is unreadable (%s); starting with no datasets",
                self.data_dir / MANIFEST,
                exc,
            )
            return ["<manifest>"]
        skipped = []
        for name, entry in sorted(entries.items()):
            try:
                built = self._reload(name, entry)
            except (
                OSError,
                ValueError,
                KeyError,
                TypeError,
                ServiceError,
                pa.ArrowException,
            ) as exc:
                log.error(
                    "dataset %s: cannot reload %s (%s); skipped",
                    name,
                    entry.get("file") if isinstance(entry, dict) else entry,
                    exc,
                )
                skipped.append(name)
                if owns_files:
                    self._set_aside(name, entry)
                continue
            self._datasets[name] = built
            log.info("reloaded dataset %s version %d: %d rows", name, built.version, built.rows)
        if owns_files:
            self._remove_unnamed_versions()
        if self.host_bytes() > self._host_budget:
            log.warning(
                "reloaded datasets hold %d bytes, more than max_dataset_host_bytes=%d; "
                "new uploads will be refused until some are dropped",
                self.host_bytes(),
                self._host_budget,
            )
        return skipped

    def _reload(self, name: str, entry: dict) -> DatasetVersion:
        version = int(entry["version"])
        path = self._version_path(name, version)
        if entry["file"] != str(path.relative_to(self._root)):
            raise ValueError(f"manifest names {entry['file']!r}, expected {path.name!r}")
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        # A torn or flipped file may still parse: check every buffer before use.
        table.validate(full=True)
        if table.num_rows != entry["rows"]:
            raise ValueError(f"holds {table.num_rows} rows, manifest says {entry['rows']}")
        if table.schema.names[:3] != ["id", "lat", "lon"]:
            raise ValueError(f"columns {table.schema.names[:3]} are not id, lat, lon")
        return self._build(name, version, table)

    @property
    def _root(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir

    def _dataset_dirs(self) -> list[Path]:
        """Folders that are datasets' own: named by today's rule, or a reloaded dataset's."""
        return [
            p
            for p in self._root.iterdir()
            if p.is_dir()
            and not p.is_symlink()
            and (p.name in self._datasets or _is_new_folder_name(p.name))
        ]

    def _remove_temporary_files(self) -> None:
        leftovers = [self._root / (MANIFEST + _TMP_SUFFIX)]
        for folder in self._dataset_dirs():
            leftovers += [
                p
                for p in folder.iterdir()
                if p.name.endswith(_TMP_SUFFIX)
                and _VERSION_FILE.fullmatch(p.name.removesuffix(_TMP_SUFFIX))
            ]
        for path in leftovers:
            if path.is_file():
                log.warning("removing %s, left by an interrupted write", path)
                _unlink(path)

    def _remove_unnamed_versions(self) -> None:
        named = {self._version_path(d.name, d.version) for d in self._datasets.values()}
        for folder in self._dataset_dirs():
            orphans = [
                p
                for p in folder.iterdir()
                if _VERSION_FILE.fullmatch(p.name) and p.is_file() and p not in named
            ]
            for path in orphans:
                log.info("removing %s, a version the manifest does not name", path)
                _unlink(path)
            if orphans:
                _remove_if_empty(folder)

    def _set_aside(self, name: str, entry: object) -> None:
        """Rename an unreadable version file ``*.corrupt``: kept for a look, never loaded."""
        if not isinstance(entry, dict) or not _is_folder_name(name):
            return
        try:
            path = self._version_path(name, int(entry["version"]))
            if path.exists():
                os.replace(path, path.with_name(path.name + ".corrupt"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("dataset %s: cannot set its file aside (%s)", name, exc)


def _is_new_folder_name(name: str) -> bool:
    """A folder a dataset named by today's rule would have."""
    return bool(DATASET_NAME.fullmatch(name)) and name.casefold() not in DATA_DIR_ENTRIES


def _is_folder_name(name: str) -> bool:
    """A name safe as a folder: today's rule's, or an earlier one's that is no path."""
    return (
        bool(_EARLIER_DATASET_NAME.fullmatch(name))
        and name not in (".", "..")
        and name.casefold() not in DATA_DIR_ENTRIES
    )


def _next_row_number(table: pa.Table) -> int:
    """One past the largest integer id; 0 for string ids (the append is then refused)."""
    ids = table.column("id")
    if not pa.types.is_integer(ids.type) or table.num_rows == 0:
        return 0
    return int(pc.max(ids).as_py()) + 1


def _number_rows(table: pa.Table, first: int) -> pa.Table:
    numbers = pa.array(np.arange(first, first + table.num_rows, dtype=np.int64))
    return table.set_column(table.schema.get_field_index("id"), "id", numbers)


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


@contextlib.contextmanager
def _storage_errors(name: str) -> Iterator[None]:
    """A failed write to the data directory as a status: a full disk is a limit."""
    try:
        yield
    except OSError as exc:
        log.error("dataset %s: cannot write to the data directory: %s", name, exc)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LimitExceeded(
                f"the data directory is full ({exc.strerror}); nothing was changed; "
                "free disk space or drop datasets"
            ) from exc
        raise ServiceError(
            f"cannot write dataset {name!r} to the data directory ({exc}); nothing was changed"
        ) from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _remove_if_empty(folder: Path) -> None:
    """Remove a dataset's folder once nothing is left in it; anything left is kept."""
    try:
        folder.rmdir()
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return
    _fsync_dir(folder.parent)
