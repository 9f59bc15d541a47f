"""The GPU engine: an exact spatial index, fused distance kernels and k-means in CuPy.

Index (built once per dataset version, ``GPUIndex``):

- the float64 unit vectors of the points sorted by a Hilbert key (the cube face a point
  projects onto, then a 2-D Hilbert curve over the face) (``xyz``, (n, 3)),
  the same in float32 with each point's row (``points``, (n, 4)) and the rows
  (``rows``), int32 (each row's position, ``rank``, is computed when first needed);
- an implicit tree over the sorted points: leaves of ``leaf_size`` consecutive points and
  nodes of ``FANOUT`` children, each with the float32 bounding box of its points, and
  each leaf's first key (``leaf_keys``).

Building is one sort of 64-bit words (key above row) plus a few passes over the points
(10M points in 1.7x the time of one ``cupy.sort`` of 10M 64-bit keys on an H200).
Leaves hold a fixed number of points, not a fixed volume, so the tree adapts to density:
a city of a million points and an empty ocean cost the same number of levels (clustered
data is where a uniform grid fails). About 50 bytes of device memory per point, index
included (54 once ``rank`` is computed); with cuDF the ids and attributes are held there
too (``gpu_table``: 8 more for int64 ids).

Queries are put in the order of the leaves their keys fall in (sorted where there are
more than 2**18), so that neighbouring queries walk one region:

- KNN, one CUDA thread a query: depth-first search, nearest child first, the k best kept
  sorted in registers, for k up to ``MAX_TREE_K``; above it, brute force over sorted
  float64 distances. For k up to ``WINDOW_MAX_K``, each warp first copies the leaves
  between its first and last query's keys (352 points at most) into shared memory; there
  each query finds its k nearest, and the tree search starts from their bound and skips
  those leaves (at 1M points / 100k queries on an H200: 9 nodes and under one leaf a
  query left to the tree, against 17 nodes and 11 leaves; the kernel 1.9x faster). A
  fast pass ranks equal distances by when they were found and lists the queries where
  that could matter; an exact pass searches those again, ranking ties by row. The kernel
  writes the answers straight into page-locked host memory, a warp's queries at a time
  (no copy after the search); large query sets go in slices on streams of their own, so
  that one slice is uploaded and sorted while another is searched.
- Radius, one group of 8 lanes a query (testing a node's 8 children or a leaf's 8 points
  at once): the same search with a fixed bound, counting first, then writing each
  query's neighbours into its slot and sorting them.

Boxes and a first test of each point use float32 with a margin far above its rounding;
decisions are float64, ranked by (squared chord, row), so answers equal the float64
reference (docs/design.md). Returned distances are float64 great-circle metres (atan2 form).

Distance matrices are one fused kernel (float32 or float64). k-means is the shared
driver of ``spherical_kmeans`` (its seeding, stop checks and best-of) over fused kernels
(:class:`GPUKMeans`): assignment and accumulation in one kernel per iteration with
deterministic fixed-point sums, and the k-means++ draws of every engine, so CPU and GPU
start alike.

This module imports CuPy: the engine registry imports it only when the GPU engine is
asked for.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import cupy as cp
import cupyx
import numpy as np
import pyarrow as pa

from geonear.geometry import (
    EARTH_RADIUS_M,
    chord_for_distance,
)
from geonear.service.analytics.areas import Area, Bbox, SphericalPolygon, area_mask
from geonear.service.engines import gpu_memory
from geonear.service.engines.base import (
    Engine,
    KMeansResult,
    MatrixDtype,
    Neighbours,
    PointIndex,
    RadiusNeighbours,
)
from geonear.service.engines.gpu_kernels import SOURCE
from geonear.service.engines.gpu_table import DEVICE_TAKE_FROM, DeviceTable
from geonear.service.engines.spherical_kmeans import (
    KMeansBackend,
    kmeans_plus_plus,
    lloyd,
    spherical_kmeans,
)

#: Areas the warm-up tests, each holding some of its points (a diagonal from (-89, -179)
#: to (89, 179)), so that every CuPy routine of the area tests compiles: a box across the
#: antimeridian and a triangle about (0, 0).
_WARM_UP_AREAS = (
    Bbox(80.0, 170.0, 90.0, -170.0),
    SphericalPolygon([[(np.array([-10.0, 10.0, 0.0]), np.array([-20.0, -10.0, 20.0]))]]),
)

#: Points per leaf of the index: 8 measured fastest on an H200 among 8-32 (10M points,
#: 1M queries, k=10, uniform and clustered).
LEAF_SIZE = 8
#: Children per node; fixed at compile time in the kernels.
FANOUT = 8
#: k values with a compiled register top-k; a query's k runs in the smallest that fits
#: (10, the usual k, has its own: fewer registers, more queries in flight).
REGISTER_K = (1, 2, 4, 8, 10, 16, 24, 32, 64, 128)
MAX_TREE_K = REGISTER_K[-1]
#: Fewer queries than this are searched in the order given (sorting would cost more).
SORT_QUERIES_FROM = 2048
#: Query sets of at most this many (the sizes measured) are put in the order of the
#: leaves they fall in (``_sorted_words``), larger ones sorted; in at most
#: 2**BUCKET_BITS buckets, 256 tiles of 1024 (MAX_BUCKET_TILES and BUCKET_TILE in the
#: source).
BUCKET_SORT_MAX = 1 << 18
BUCKET_BITS = 18
_BUCKET_TILE = 1024
#: Large KNN query sets are searched in up to KNN_CHUNKS slices of at least KNN_CHUNK
#: queries, each on its own stream, so that one slice is uploaded and sorted while
#: another is searched (10M points, 1M queries on an H200: 9.31 -> 7.69 ms end to end
#: with 4; no gain at 100k queries, where one search is a single wave).
KNN_CHUNK = 250_000
KNN_CHUNKS = 4
#: Radius answers of at most this many neighbours per query are sorted by the search
#: kernel itself (one lane, insertion); longer ones a block each (32 measured best on an
#: H200 among 16-128: at 128, 10M clustered points took 2.2x the time of 32).
RADIUS_SORT_LIMIT = 32
#: Longer answers of at most this many are sorted a block each in shared memory
#: (SEGMENT_SORT_MAX in the source), longer still by one lexsort.
SEGMENT_SORT_MAX = 4096
#: Depth limit of the kernels' traversal stack (STACK = 72 entries: 7 per level, 8 on
#: the last), enough for 2**31 points in leaves of 8.
_MAX_LEVELS = 11
#: Relative slack on chord bounds in metres: far above float64 rounding, far below 1 mm.
_CHORD_SLACK = 1e-9
#: Bound on one brute-force block (queries x points) and one matrix tile, elements.
_BLOCK_ELEMENTS = 1 << 26
_MATRIX_TILE_BYTES = 1 << 30
_THREADS = 128
#: Levels of at most this many nodes get their boxes in one block, in one launch.
_ONE_BLOCK_NODES = 16_384
#: Leaves of this size get their boxes from the packing kernel (8 lanes a leaf).
_FUSED_LEAF_SIZE = 8
_QUERIES_PER_BLOCK = 16  # radius: GROUPS in the source, 8 lanes a query
_MATRIX_ROWS = 64  # rows per block of the matrix kernel (MATRIX_ROWS in the source)

#: The fast KNN pass starts from a warp's window of leaves (WINDOW in the source) for k up
#: to this, wherever the queries are in key order. A window holds 352 points and 3
#: leaves either side of the warp's queries (on an H200, against 256-512 points and 2-8
#: leaves: 1M points / 100k queries 0.35 ms uniform, 0.65 clustered; 10M / 1M 2.65 and
#: 3.25 ms; at 512 and 4: 0.41, 0.87, 2.90, 3.71). Queries sparser than a window spans
#: gain from it too, from 12 to 4,882 points a query on 1M and 10M points, except 1M
#: clustered points at 122-488 points a query, 6-8% slower (docs/benchmarks.md, twelfth
#: run).
WINDOW_MAX_K = 16


def _knn_name(k: int, exact: bool, window: bool) -> str:
    return f"knn<{k}, {str(exact).lower()}, {str(window).lower()}>"


_NAMES = [
    _knn_name(k, exact, window)
    for k in REGISTER_K
    for exact, window in ((False, False), (True, False), (False, True))
    if not window or k <= WINDOW_MAX_K
] + [
    "distance_matrix<float>",
    "distance_matrix<double>",
]
_module: Any = None
_module_lock = threading.Lock()


def _kernels() -> Any:
    """The compiled kernel module (compiled once per process, cached on disk by CuPy)."""
    global _module
    with _module_lock:
        if _module is None:
            module = cp.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=_NAMES)
            module.compile()
            _module = module
        return _module


_functions: dict[str, Any] = {}


def _fn(name: str) -> Any:
    """A compiled kernel by name (looked up once: a launch costs microseconds)."""
    function = _functions.get(name)
    if function is None:
        function = _functions[name] = _kernels().get_function(name)
    return function


def _blocks(n: int, threads: int = _THREADS) -> int:
    return max(1, (n + threads - 1) // threads)


_NULL = np.uint64(0)  # a null pointer argument
_streams = threading.local()
T = TypeVar("T")


def _side_streams(count: int) -> list[cp.cuda.Stream]:
    """``count`` streams of this thread on the current device, beside its current stream,
    for work that overlaps (joined by events or synchronised by the caller)."""
    by_device: dict[int, list[cp.cuda.Stream]] | None = getattr(_streams, "by_device", None)
    if by_device is None:
        by_device = _streams.by_device = {}
    streams = by_device.setdefault(cp.cuda.runtime.getDevice(), [])
    while len(streams) < count:
        streams.append(cp.cuda.Stream(non_blocking=True))
    return streams[:count]


def _kept(made: T) -> T:
    """``made`` (device arrays kept with an index), once the current stream has made
    it: another thread may read it at once, on streams of its own."""
    cp.cuda.get_current_stream().synchronize()
    return made


def _query_chunks(n: int) -> list[tuple[int, int]]:
    """Slices of ``n`` queries searched on streams of their own, so that one slice is
    prepared while another is searched (``KNN_CHUNK`` queries at least, ``KNN_CHUNKS`` at
    most; one slice below two chunks)."""
    count = max(1, min(KNN_CHUNKS, n // KNN_CHUNK))
    bounds = [n * c // count for c in range(count + 1)]
    return list(itertools.pairwise(bounds))


def _to_host(a: cp.ndarray) -> np.ndarray:
    """Copy a device array to page-locked host memory (about twice the pageable rate)."""
    out = cupyx.empty_pinned(a.shape, dtype=a.dtype)
    a.get(out=out)
    return out


def _degrees_device(lat: np.ndarray, lon: np.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """Latitudes and longitudes as contiguous float64 device arrays (host or device in)."""
    return (
        cp.ascontiguousarray(cp.asarray(lat, dtype=cp.float64)),
        cp.ascontiguousarray(cp.asarray(lon, dtype=cp.float64)),
    )


def unit_vectors_device(lat: np.ndarray | cp.ndarray, lon: np.ndarray | cp.ndarray) -> cp.ndarray:
    """Float64 unit vectors (n, 3) on the device of points in degrees (host or device)."""
    lat_d, lon_d = _degrees_device(lat, lon)
    n = int(lat_d.shape[0])
    xyz = cp.empty((n, 3), dtype=cp.float64)
    if n:
        _fn("unit_vectors")((_blocks(n),), (_THREADS,), (lat_d, lon_d, np.int64(n), xyz))
    return xyz


def _sorted_words(
    lat_d: cp.ndarray,
    lon_d: cp.ndarray,
    side_by_side: cp.ndarray | None = None,
    level: int | None = None,
    leaf_keys: cp.ndarray | None = None,
) -> tuple[cp.ndarray, np.uint64, int]:
    """Points in key order as sorted uint64 words (the ``sort_words`` kernel), the mask
    of the words' low bits that hold each point's row, and the key's Hilbert level.

    The key gets every bit the rows leave (3 + 2 x 26 at most): 18 Hilbert levels a face
    at 10M points, cells of about 40 m, 15 at 2**31 points, about 300 m. Points within a
    cell are ordered by row; the order only shapes the leaves, never the answers.
    ``side_by_side`` (n, 2) float64, if given, receives the degrees interleaved. With
    ``level`` (an index's), the key is at that level, or at the finest one that fits
    below it by a multiple of 2 (whose keys are those of ``level`` with the low bits
    dropped). With the index's ``leaf_keys`` too, up to ``BUCKET_SORT_MAX`` words are
    put in the order of the leaves their keys fall in, not sorted within a leaf
    (``leaf_buckets`` in the source): enough for queries.
    """
    n = int(lat_d.shape[0])
    shift = max(1, (n - 1).bit_length())
    fits = min(26, (61 - shift) // 2)
    if level is None:
        used = fits
    elif level > fits:
        used = level - 2 * -(-(level - fits) // 2)
    else:
        used = level
    mask = np.uint64((1 << shift) - 1)
    words = cp.empty(n, dtype=cp.uint64)
    if n == 0:
        return words, mask, used
    ll = _NULL if side_by_side is None else side_by_side
    _fn("sort_words")(
        (_blocks(n),),
        (_THREADS,),
        (lat_d, lon_d, np.int64(n), np.int32(used), np.int32(shift), words, ll),
    )
    if leaf_keys is None or level is None or n > BUCKET_SORT_MAX:
        words.sort()
        return words, mask, used
    n_leaves = int(leaf_keys.shape[0])
    group = max(0, (n_leaves - 1).bit_length() - BUCKET_BITS)
    tiles = -(-(((n_leaves - 1) >> group) + 1) // _BUCKET_TILE)
    counts = cp.zeros(tiles * _BUCKET_TILE, dtype=cp.uint32)
    bucket = cp.empty(n, dtype=cp.uint32)
    _fn("leaf_buckets")(
        (_blocks(n),),
        (_THREADS,),
        (
            words,
            np.int64(n),
            np.int32(shift),
            leaf_keys,
            np.int64(n_leaves),
            np.int32(2 * (level - used)),
            np.int32(group),
            bucket,
            counts,
        ),
    )
    totals = cp.empty(tiles, dtype=cp.uint32)
    _fn("bucket_offsets")((tiles,), (_BUCKET_TILE,), (counts, totals))
    placed = cp.empty_like(words)
    _fn("bucket_place")(
        (_blocks(n),),
        (_THREADS,),
        (words, bucket, np.int64(n), counts, totals, np.int32(tiles), placed),
    )
    return placed, mask, used


class _Queries:
    """Queries in degrees on the device and the order to search them in: by an index's
    key when there are many (``words``, in the order of its leaves: see
    ``_sorted_words``), else as given.

    ``kernel_args()`` are the search kernels' query arguments; the kernels compute each
    query's unit vector themselves. ``key_drop`` is the number of low bits of the index's
    keys that the queries' keys leave out (where the query count leaves fewer bits), so
    that KNN's windows can find a warp's leaves; None where the queries are in the order
    given.
    """

    def __init__(self, lat: np.ndarray, lon: np.ndarray, index: GPUIndex) -> None:
        self.lat, self.lon = _degrees_device(lat, lon)
        self.n = n = int(self.lat.shape[0])
        self.key_drop: int | None = None
        if n < SORT_QUERIES_FROM:
            self.words, self.mask = None, np.uint64(0)
        else:
            leaf_keys = index.leaf_keys if index.n_points else None
            self.words, self.mask, level = _sorted_words(
                self.lat, self.lon, level=index.key_level, leaf_keys=leaf_keys
            )
            self.key_drop = 2 * (index.key_level - level)

    def kernel_args(self) -> tuple[Any, ...]:
        words = _NULL if self.words is None else self.words
        return (self.lat, self.lon, words, self.mask, np.int64(self.n))

    def xyz_as_given(self) -> cp.ndarray:
        return unit_vectors_device(self.lat, self.lon)


def _chord_sq_bound(distance_m: float, earth_radius_m: float) -> float:
    chord = chord_for_distance(distance_m, earth_radius_m)
    return (chord * (1 + _CHORD_SLACK) + _CHORD_SLACK) ** 2


class GPUIndex(PointIndex):
    """A dataset version's points and spatial index on the device (see the module doc)."""

    def __init__(
        self, lat: np.ndarray, lon: np.ndarray, earth_radius_m: float, leaf_size: int = LEAF_SIZE
    ) -> None:
        self.earth_radius_m = float(earth_radius_m)
        self.leaf_size = int(leaf_size)
        n = int(np.shape(lat)[0])
        if n >= 2**31:
            raise ValueError(f"the GPU index holds at most 2**31 - 1 points, got {n}")
        self.n_points = n
        self.table: DeviceTable | None = None  # ids and attributes, once kept
        counts = [max(1, -(-n // self.leaf_size))]
        while counts[-1] > 1:
            counts.append(-(-counts[-1] // FANOUT))
        if len(counts) > _MAX_LEVELS:
            raise ValueError(f"leaf_size {leaf_size} gives a tree too deep for {n} points")
        lat_d, lon_d = _degrees_device(lat, lon)
        side_by_side = cp.empty((n, 2), dtype=cp.float64)
        # The sort first: the host prepares the rest while the device sorts.
        words, row_mask, self.key_level = _sorted_words(lat_d, lon_d, side_by_side)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.top_level = len(counts) - 1
        levels = cp.asarray(np.stack([starts, np.asarray(counts, dtype=np.int64)]))
        self.level_start, self.level_count = levels[0], levels[1]
        self.xyz = cp.empty((n, 3), dtype=cp.float64)
        self.points = cp.empty((n, 4), dtype=cp.float32)
        self.rows = cp.empty(n, dtype=cp.int32)
        self._rank: cp.ndarray | None = None
        self._lazy_lock = threading.Lock()  # for what is made once asked: rank, degrees, ids
        self._degrees: tuple[cp.ndarray, cp.ndarray] | None = None  # once asked (areas, joins)
        self._ids: tuple[np.ndarray, cp.ndarray] | None = None  # once asked (``_kept_ids``)
        self.box_lo = cp.empty((int(sum(counts)), 4), dtype=cp.float32)
        self.box_hi = cp.empty_like(self.box_lo)
        self.leaf_keys = cp.empty(counts[0], dtype=cp.uint64)  # each leaf's first key
        if n:
            self._build_tree(side_by_side, words, row_mask, counts, starts)

    def _build_tree(
        self,
        side_by_side: cp.ndarray,
        words: cp.ndarray,
        row_mask: np.uint64,
        counts: list[int],
        starts: np.ndarray,
    ) -> None:
        """Points in key order, each row's position, and the boxes of every level."""
        n = self.n_points
        fused_leaves = self.leaf_size == _FUSED_LEAF_SIZE
        _fn("pack_points")(
            (_blocks(n),),
            (_THREADS,),
            (
                side_by_side,
                words,
                row_mask,
                np.int64(n),
                self.xyz,
                self.points,
                self.rows,
                self.box_lo if fused_leaves else _NULL,
                self.box_hi if fused_leaves else _NULL,
                self.leaf_keys if fused_leaves else _NULL,
            ),
        )
        if not fused_leaves:
            _fn("leaf_boxes")(
                (_blocks(counts[0]),),
                (_THREADS,),
                (
                    self.xyz,
                    words,
                    np.int32(int(row_mask).bit_length()),
                    np.int64(n),
                    np.int32(self.leaf_size),
                    np.int64(counts[0]),
                    self.box_lo,
                    self.box_hi,
                    self.leaf_keys,
                ),
            )
        level = 1
        while level < len(counts) and counts[level] > _ONE_BLOCK_NODES:
            below, here = int(starts[level - 1]), int(starts[level])
            _fn("node_boxes")(
                (_blocks(counts[level]),),
                (_THREADS,),
                (
                    self.box_lo[below:],
                    self.box_hi[below:],
                    np.int64(counts[level - 1]),
                    np.int64(counts[level]),
                    self.box_lo[here:],
                    self.box_hi[here:],
                ),
            )
            level += 1
        if level < len(counts):
            args = (self.level_start, self.level_count, np.int32(level), np.int32(self.top_level))
            _fn("top_boxes")((1,), (1024,), (self.box_lo, self.box_hi, *args))

    @property
    def host_bytes(self) -> int:
        return 0

    @property
    def device_bytes(self) -> int:
        arrays = [self.xyz, self.points, self.rows, self.box_lo, self.box_hi, self.leaf_keys]
        arrays += [] if self._rank is None else [self._rank]
        arrays += [] if self._degrees is None else list(self._degrees)
        arrays += [] if self._ids is None else [self._ids[1]]
        table = 0 if self.table is None else self.table.nbytes
        return int(sum(a.nbytes for a in arrays) + 16 * (self.top_level + 1) + table)

    @property
    def rank(self) -> cp.ndarray:
        """Each row's position in the index, int32, computed when first asked for: only
        k-means, brute-force KNN (k > MAX_TREE_K) and ``xyz_by_row`` need it (the search
        kernels read rows from the points), so the build leaves it out (0.21 ms of a 10M
        build on an H200)."""
        with self._lazy_lock:
            if self._rank is None:
                n = self.n_points
                rank = cp.empty(n, dtype=cp.int32)
                if n:
                    _fn("rank_of")((_blocks(n),), (_THREADS,), (self.rows, np.int64(n), rank))
                self._rank = rank
            return self._rank

    @gpu_memory.out_of_memory_guard("keeping a dataset's points on the device")
    def query_degrees(self, lat: np.ndarray, lon: np.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        """The points' degrees on the device (``_kept_degrees``): a join or a count
        around this dataset's points searches with them, not with 16 bytes a point
        copied from the host every call."""
        return self._kept_degrees(lat, lon)

    def _kept_degrees(self, lat: np.ndarray, lon: np.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
        """A device copy of the points' degrees, in row order, made on the first call
        (16 bytes a point, kept with the index; ``_kept``)."""
        with self._lazy_lock:
            if self._degrees is None:
                self._degrees = _kept(_degrees_device(lat, lon))
            return self._degrees

    @gpu_memory.out_of_memory_guard("testing points against an area")
    def area_rows(
        self, lat: np.ndarray, lon: np.ndarray, area: Area, rows: np.ndarray | None = None
    ) -> np.ndarray:
        """The area's test on the device, over a device copy of the points' degrees made
        on the first call (16 bytes a point, kept with the index): a box is a few
        comparisons a point, a polygon's edges are tested against the points in its box
        only. With the test on the host, ``within`` of 10M points and 64 edges took
        0.30 s served by this engine against 0.35 s by the cpu engine (an H100 host,
        docs/benchmarks.md): the host's NumPy test was most of both."""
        lat_d, lon_d = self._kept_degrees(lat, lon)
        if rows is None:
            return _to_host(cp.flatnonzero(area_mask(lat_d, lon_d, area, cp))).astype(np.int64)
        rows_d = cp.asarray(rows)
        return rows[_to_host(area_mask(lat_d[rows_d], lon_d[rows_d], area, cp))]

    @gpu_memory.out_of_memory_guard("evaluating a filter")
    def filter_rows(self, where: Sequence[Sequence[Any]]) -> np.ndarray | None:
        """The filter evaluated on the device table (``DeviceTable.filter_mask``) where it
        holds every column the filter names, in a type it compares exactly."""
        mask = None if self.table is None else self.table.filter_mask(where)
        if mask is None:
            return None
        return _to_host(cp.flatnonzero(mask)).astype(np.int64, copy=False)

    @gpu_memory.out_of_memory_guard("copying a dataset's columns to the GPU")
    def keep_columns(self, table: pa.Table) -> None:
        """Copy the id and attribute columns to the device as a cuDF table (with cuDF)."""
        self.table = DeviceTable.from_arrow(table)

    @gpu_memory.out_of_memory_guard("gathering result columns")
    def take_columns(self, names: Sequence[str], rows: np.ndarray) -> dict[str, pa.ChunkedArray]:
        # Where the device is faster (``gpu_table``): many rows, attributes asked for.
        if self.table is None or rows.shape[0] < DEVICE_TAKE_FROM or list(names) == ["id"]:
            return {}
        return self.table.take(names, rows)

    def _by_position(self, weights: cp.ndarray | None) -> Any:
        """Per-row weights in index order, as a kernel argument (null for none)."""
        return _NULL if weights is None else cp.ascontiguousarray(weights[self.rows])

    def xyz_by_row(self) -> cp.ndarray:
        """The float64 unit vectors (n, 3) in row order (a new array)."""
        return self.xyz[self.rank]

    def _tree_args(self) -> tuple[Any, ...]:
        """The kernels' arguments that describe the tree, after the point arrays."""
        return (
            self.box_lo,
            self.box_hi,
            self.level_start,
            self.level_count,
            np.int32(self.top_level),
            np.int32(self.leaf_size),
            np.int64(self.n_points),
        )

    # -- KNN -------------------------------------------------------------------------
    @gpu_memory.out_of_memory_guard("a KNN query")
    def knn(
        self, lat: np.ndarray, lon: np.ndarray, k: int, max_distance_m: float | None = None
    ) -> Neighbours:
        return self._knn(lat, lon, k, max_distance_m, None)

    @gpu_memory.out_of_memory_guard("a KNN query")
    def knn_with_ids(
        self,
        lat: np.ndarray,
        lon: np.ndarray,
        k: int,
        max_distance_m: float | None,
        ids: np.ndarray,
    ) -> Neighbours:
        """``knn``, each neighbour's id gathered on the device from a copy of ``ids``
        kept with the index (``_kept_ids``) and sent to the host with the rows."""
        return self._knn(lat, lon, k, max_distance_m, self._kept_ids(ids))

    def _kept_ids(self, ids: np.ndarray) -> cp.ndarray:
        """A device copy of ``ids`` (one a row), made on the first call with that array
        and kept with the index while its callers pass the same one (a dataset version's
        ids are one array for its life)."""
        if ids.shape[0] != self.n_points:
            raise ValueError(f"{ids.shape[0]} ids for an index of {self.n_points} points")
        with self._lazy_lock:
            if self._ids is None or self._ids[0] is not ids:
                self._ids = (ids, _kept(cp.asarray(ids)))
            return self._ids[1]

    def _knn(
        self,
        lat: np.ndarray,
        lon: np.ndarray,
        k: int,
        max_distance_m: float | None,
        device_ids: cp.ndarray | None,
    ) -> Neighbours:
        n_q, kk = int(np.shape(lat)[0]), min(int(k), self.n_points)
        if kk <= 0 or n_q == 0 or (max_distance_m is not None and max_distance_m < 0):
            return Neighbours(np.full((n_q, max(kk, 0)), np.inf), np.full((n_q, max(kk, 0)), -1))
        # The answers go straight into page-locked host memory: the search kernel writes
        # them there itself, or, with ids to gather, they are copied there after it.
        out_dist = cupyx.empty_pinned((n_q, kk), dtype=np.float64)
        out_idx = cupyx.empty_pinned((n_q, kk), dtype=np.int64)
        # With ids to gather: the device's ids, and the host array their answer goes to.
        gather = (
            None
            if device_ids is None
            else (device_ids, cupyx.empty_pinned((n_q, kk), device_ids.dtype))
        )
        chunks = _query_chunks(n_q)
        streams = _side_streams(len(chunks))
        ready = cp.cuda.get_current_stream().record()  # the index, built on this stream
        try:
            for (start, stop), stream in zip(chunks, streams, strict=True):
                stream.wait_event(ready)
                with stream:
                    queries = _Queries(lat[start:stop], lon[start:stop], self)
                    host_out = (out_dist[start:stop], out_idx[start:stop])
                    if gather is None:
                        self.knn_device(queries, kk, max_distance_m, host_out)
                        continue
                    ids, out_ids = gather
                    dist, idx = self.knn_device(queries, kk, max_distance_m)
                    dist.get(out=host_out[0], blocking=False)
                    idx.get(out=host_out[1], blocking=False)
                    found = ids.take(cp.maximum(idx, 0))  # any id where idx is -1
                    found.get(out=out_ids[start:stop], blocking=False)
        finally:  # also on an error: no kernel or copy may go on writing into freed memory
            for stream in streams:
                stream.synchronize()
        return Neighbours(out_dist, out_idx, None if gather is None else gather[1])

    def knn_device(
        self,
        queries: _Queries,
        k: int,
        max_distance_m: float | None,
        host_out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[Any, Any]:
        """(distances_m, rows), each (n_queries, k), 1 <= k <= n_points: device arrays, or
        ``host_out`` (page-locked host arrays, C-contiguous) filled once the current
        stream gets there."""
        bounded = max_distance_m is not None and max_distance_m < math.pi * self.earth_radius_m
        if k > MAX_TREE_K:
            dist, idx = self._knn_brute(queries, k, max_distance_m if bounded else None)
            if host_out is None:
                return dist, idx
            dist.get(out=host_out[0], blocking=False)
            idx.get(out=host_out[1], blocking=False)
            return host_out
        register_k = next(r for r in REGISTER_K if r >= k)
        bound_sq = (
            _chord_sq_bound(max_distance_m, self.earth_radius_m)
            if max_distance_m is not None and bounded
            else math.inf
        )
        if host_out is None:
            out: tuple[Any, Any] = (
                cp.empty((queries.n, k), dtype=cp.float64),
                cp.empty((queries.n, k), dtype=cp.int64),
            )
            out_dist, out_idx = out
        else:
            out = host_out  # the kernel reads a page-locked array's address as its own
            out_dist, out_idx = (np.uint64(a.ctypes.data) for a in host_out)
        ties = cp.empty(queries.n, dtype=cp.int64)  # queries the exact pass searches again
        n_ties = cp.zeros(1, dtype=cp.uint64)
        window = queries.key_drop is not None and register_k <= WINDOW_MAX_K
        args = (
            self.points,
            self.xyz,
            *self._tree_args(),
            *queries.kernel_args(),
            self.leaf_keys,
            np.int32(queries.key_drop or 0),
            np.int32(k),
            np.float64(bound_sq),
            np.float64(max_distance_m if bounded else -1.0),
            np.float64(self.earth_radius_m),
            out_idx,
            out_dist,
            ties,
            n_ties,
        )
        # Both passes are launched over every query; the exact one stops at once past
        # the count of tied queries, so no count travels to the host.
        for exact in (False, True):
            name = _knn_name(register_k, exact, window and not exact)
            _fn(name)((_blocks(queries.n),), (_THREADS,), args)
        return out

    def _knn_brute(
        self, queries: _Queries, k: int, max_distance_m: float | None
    ) -> tuple[cp.ndarray, cp.ndarray]:
        # Large k: float64 distances in blocks, in row order, sorted per query (CuPy's
        # sort is stable, so equal distances keep row order).
        out_idx = cp.empty((queries.n, k), dtype=cp.int64)
        out_dist = cp.empty((queries.n, k), dtype=cp.float64)
        step = max(1, _BLOCK_ELEMENTS // self.n_points)
        xyz = queries.xyz_as_given()
        for start in range(0, queries.n, step):
            stop = min(queries.n, start + step)
            d = _matrix_device(xyz[start:stop], self.xyz, self.earth_radius_m)
            d = d[:, self.rank]
            order = cp.argsort(d, axis=1)[:, :k]
            dist = cp.take_along_axis(d, order, axis=1)
            if max_distance_m is not None:
                far = dist > max_distance_m
                dist[far] = cp.inf
                order[far] = -1
            out_dist[start:stop], out_idx[start:stop] = dist, order
        return out_dist, out_idx

    # -- radius ----------------------------------------------------------------------
    @gpu_memory.out_of_memory_guard("a radius query")
    def radius(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> RadiusNeighbours:
        n_q = int(np.shape(lat)[0])
        if n_q == 0 or self.n_points == 0 or radius_m < 0:
            return RadiusNeighbours(
                offsets=np.zeros(n_q + 1, dtype=np.int64),
                indices=np.empty(0, dtype=np.int64),
                distances_m=np.empty(0),
            )
        offsets, idx, dist = self.radius_device(_Queries(lat, lon, self), float(radius_m))
        return RadiusNeighbours(
            offsets=_to_host(offsets), indices=_to_host(idx), distances_m=_to_host(dist)
        )

    @gpu_memory.out_of_memory_guard("a radius count")
    def radius_count(self, lat: np.ndarray, lon: np.ndarray, radius_m: float) -> np.ndarray:
        """The radius search's first pass alone: it counts each query's neighbours with
        the same decisions as the pass that writes them."""
        n_q = int(np.shape(lat)[0])
        if n_q == 0 or self.n_points == 0 or radius_m < 0:
            return np.zeros(n_q, dtype=np.int64)
        queries = _Queries(lat, lon, self)
        head = self._radius_head(queries, float(radius_m))
        self._radius_pass(queries, head)
        return _to_host(head[-1])

    def _radius_head(self, queries: _Queries, radius_m: float) -> tuple[Any, ...]:
        """The radius kernel's arguments up to the counts (the last, one a query)."""
        if radius_m >= math.pi * self.earth_radius_m:
            thr, inner_sq, outer_sq = np.float32(np.inf), 5.0, 5.0  # every chord^2 is <= 4
        else:
            chord = chord_for_distance(radius_m, self.earth_radius_m)
            margin = chord * (1 + 1e-5) + 2e-6  # the kernels' float32 margin
            thr = np.float32(margin * margin)
            inner_sq = chord * chord * (1 - _CHORD_SLACK)
            outer_sq = chord * chord * (1 + _CHORD_SLACK) + 1e-30
        return (
            self.xyz,
            self.rows,
            *self._tree_args(),
            *queries.kernel_args(),
            thr,
            np.float64(inner_sq),
            np.float64(outer_sq),
            np.float64(radius_m),
            np.float64(self.earth_radius_m),
            cp.empty(queries.n, dtype=cp.int64),
        )

    def _radius_pass(
        self,
        queries: _Queries,
        head: tuple[Any, ...],
        out: tuple[Any, Any, Any] = (_NULL, _NULL, _NULL),
    ) -> None:
        """The radius kernel: counts only without ``out``, else (offsets, rows, metres)."""
        grid, block = (_blocks(queries.n, _QUERIES_PER_BLOCK),), (_THREADS,)
        _fn("radius_search")(grid, block, (*head, *out, np.int32(RADIUS_SORT_LIMIT)))

    def radius_device(
        self, queries: _Queries, radius_m: float
    ) -> tuple[cp.ndarray, cp.ndarray, cp.ndarray]:
        """(offsets (n_queries + 1,), rows, distances_m) on the device, nearest first."""
        head = self._radius_head(queries, radius_m)
        counts = head[-1]
        self._radius_pass(queries, head)
        offsets = cp.zeros(queries.n + 1, dtype=cp.int64)
        cp.cumsum(counts, out=offsets[1:])
        total = int(offsets[-1])
        idx = cp.empty(total, dtype=cp.int64)
        dist = cp.empty(total, dtype=cp.float64)
        self._radius_pass(queries, head, (offsets, idx, dist))
        long_queries = cp.flatnonzero(counts > RADIUS_SORT_LIMIT)
        if long_queries.size:
            _sort_segments(offsets, counts, long_queries, idx, dist)
        return offsets, idx, dist

    # -- k-means ---------------------------------------------------------------------
    @gpu_memory.out_of_memory_guard("k-means")
    def kmeans(
        self,
        k: int,
        *,
        weights: np.ndarray | None = None,
        seed: int = 0,
        n_init: int = 1,
        max_iter: int = 100,
        tol: float = 1e-6,
    ) -> KMeansResult:
        """Spherical k-means by the shared driver (``spherical_kmeans``) over this index's
        fused kernels (:class:`GPUKMeans`)."""
        backend = GPUKMeans(self, weights)
        return spherical_kmeans(backend, k, seed=seed, n_init=n_init, max_iter=max_iter, tol=tol)

    def seed_kmeans_plus_plus(
        self, k: int, weights: np.ndarray | None, rng: np.random.Generator
    ) -> cp.ndarray:
        """k initial centroids (k, 3): the driver's k-means++ draws over the fused kernel."""
        return kmeans_plus_plus(GPUKMeans(self, weights), k, rng)

    def lloyd(
        self,
        centroids: cp.ndarray,
        *,
        weights: np.ndarray | None = None,
        max_iter: int = 100,
        tol: float = 1e-6,
    ) -> tuple[cp.ndarray, int]:
        """The driver's Lloyd iterations from centroids (k, 3) over the fused kernels;
        returns (centroids, n_iter)."""
        return lloyd(GPUKMeans(self, weights), centroids, max_iter=max_iter, tol=tol)


class GPUKMeans(KMeansBackend):
    """k-means hooks over a :class:`GPUIndex`: fused kernels on its sorted unit vectors.

    - ``seeding_mass``: ``kmeanspp_nearest``, one kernel per centre, updating every
      point's squared angle to its nearest centre and its weighted mass (by row);
    - ``cluster_sums``: ``kmeans_assign_accumulate``, assignment and the weighted sums of
      each cluster in one kernel, in 64-bit fixed point (integer addition is
      associative, so the run is the same from run to run whatever the order threads
      add in);
    - ``update``: ``kmeans_update``, one thread a cluster, the normalised mean and the
      angle it moved (atan2 form);
    - ``labels_and_inertia``: ``kmeans_labels``, labels and weighted squared metres, by
      row.
    """

    xp = cp

    def __init__(self, index: GPUIndex, weights: np.ndarray | None) -> None:
        super().__init__(index.n_points, weights, index.earth_radius_m)
        self.index = index
        #: Weights in index order, as a kernel argument (null for none).
        self._weights_by_position = index._by_position(self.weights)
        self._nearest_sq: cp.ndarray | None = None
        self._mass: cp.ndarray | None = None
        self._plan: _LloydPlan | None = None

    def seeding_mass(self, centre_row: int, first: bool) -> cp.ndarray:
        index, n = self.index, self.n_points
        if first or self._nearest_sq is None or self._mass is None:
            self._nearest_sq = cp.empty(n, dtype=cp.float64)
            self._mass = cp.empty(n, dtype=cp.float64)  # by row, as the draws are
        centre = np.int64(int(index.rank[centre_row]))
        args = (index.xyz, self._weights_by_position, np.int64(n), centre, np.int32(first))
        _fn("kmeanspp_nearest")(
            (_blocks(n, 256),), (256,), (*args, index.rows, self._nearest_sq, self._mass)
        )
        return self._mass

    def centres_at(self, rows: np.ndarray) -> cp.ndarray:
        index = self.index
        return index.xyz[index.rank[cp.asarray(rows)]]

    def _lloyd_plan(self, k: int) -> _LloydPlan:
        if self._plan is None or self._plan.k != k:
            n = self.n_points
            w = self.weights
            total_weight = float(n) if w is None else float(cp.abs(w).sum())
            # Fixed point: the sum of all |w x| times scale stays below 2**62.
            scale = 2.0 ** (61 - max(0, math.ceil(math.log2(max(total_weight, 1.0)))))
            use_shared = 3 * k * 8 <= 48 * 1024
            sms = cp.cuda.Device().attributes["MultiProcessorCount"]
            self._plan = _LloydPlan(
                k=k,
                scale=scale,
                use_shared=use_shared,
                shared_bytes=3 * k * 8 if use_shared else 0,
                grid=min(_blocks(n, 256), sms * 8),
                sums=cp.empty((k, 3), dtype=cp.uint64),
                shift=cp.empty(k, dtype=cp.float64),
            )
        return self._plan

    def cluster_sums(self, centroids: cp.ndarray) -> cp.ndarray:
        """Fixed-point sums (k, 3) uint64, for ``update`` (a buffer reused each step)."""
        k = int(centroids.shape[0])
        plan = self._lloyd_plan(k)
        centroids = cp.ascontiguousarray(centroids, dtype=cp.float64)
        plan.sums.fill(0)
        _fn("kmeans_assign_accumulate")(
            (plan.grid,),
            (256,),
            (
                self.index.xyz,
                self._weights_by_position,
                np.int64(self.n_points),
                centroids,
                np.int32(k),
                np.float64(plan.scale),
                np.int32(plan.use_shared),
                plan.sums,
            ),
            shared_mem=plan.shared_bytes,
        )
        return plan.sums

    def update(self, centroids: cp.ndarray, sums: cp.ndarray) -> tuple[cp.ndarray, float]:
        k = int(centroids.shape[0])
        plan = self._lloyd_plan(k)
        new = cp.array(centroids, dtype=cp.float64, order="C")  # the kernel updates in place
        _fn("kmeans_update")(
            (_blocks(k),), (_THREADS,), (sums, np.float64(plan.scale), np.int32(k), new, plan.shift)
        )
        return new, float(plan.shift.max())

    def labels_and_inertia(self, centroids: cp.ndarray) -> tuple[cp.ndarray, float]:
        index, n, k = self.index, self.n_points, int(centroids.shape[0])
        labels = cp.empty(n, dtype=cp.int32)
        sq = cp.empty(n, dtype=cp.float64)
        _fn("kmeans_labels")(
            (_blocks(n, 256),),
            (256,),
            (
                index.xyz,
                self._weights_by_position,
                np.int64(n),
                cp.ascontiguousarray(centroids, dtype=cp.float64),
                np.int32(k),
                np.float64(self.earth_radius_m),
                index.rows,
                labels,
                sq,
            ),
        )
        return labels, float(sq.sum())

    def to_host(self, a: cp.ndarray) -> np.ndarray:
        return _to_host(a)


@dataclass
class _LloydPlan:
    """Launch settings and buffers of the Lloyd kernels for one k."""

    k: int
    scale: float
    use_shared: bool
    shared_bytes: int
    grid: int
    sums: cp.ndarray
    shift: cp.ndarray


def _sort_segments(
    offsets: cp.ndarray, counts: cp.ndarray, long: cp.ndarray, idx: cp.ndarray, dist: cp.ndarray
) -> None:
    """Sort the radius segments of queries ``long`` in place by (distance, row): a block
    a segment in shared memory (``sort_segments``) up to SEGMENT_SORT_MAX entries, one
    lexsort of all the longer ones together."""
    sizes = counts[long]
    fits = sizes <= SEGMENT_SORT_MAX
    short = long[fits]
    if short.size:
        _fn("sort_segments")((int(short.size),), (_THREADS,), (offsets, short, idx, dist))
    long, sizes = long[~fits], sizes[~fits]
    if not long.size:
        return
    first = cp.zeros(long.size, dtype=cp.int64)
    cp.cumsum(sizes[:-1], out=first[1:])
    n = int(sizes.sum())
    segment = cp.zeros(n, dtype=cp.int64)
    segment[first[1:]] = 1
    segment = cp.cumsum(segment)
    pos = offsets[long][segment] + cp.arange(n, dtype=cp.int64) - first[segment]
    d, r = dist[pos], idx[pos]
    order = cp.lexsort(cp.stack([r.astype(cp.float64), d, segment.astype(cp.float64)]))
    dist[pos] = d[order]
    idx[pos] = r[order]


def _matrix_device(
    a: cp.ndarray, b: cp.ndarray, earth_radius_m: float, out: cp.ndarray | None = None
) -> cp.ndarray:
    """Great-circle metres (m, n) between unit vectors a (m, 3) and b (n, 3) (same dtype)."""
    m, n = int(a.shape[0]), int(b.shape[0])
    dtype = a.dtype
    if out is None:
        out = cp.empty((m, n), dtype=dtype)
    if m == 0 or n == 0:
        return out
    fn = _fn("distance_matrix<float>" if dtype == cp.float32 else "distance_matrix<double>")
    radius = dtype.type(earth_radius_m)
    rows_per_launch = 65535 * _MATRIX_ROWS
    for row0 in range(0, m, rows_per_launch):
        rows = min(rows_per_launch, m - row0)
        view = out[row0 : row0 + rows]
        fn(
            (_blocks(n, 256), -(-rows // _MATRIX_ROWS)),
            (256,),
            (a, b, np.int64(m), np.int64(n), np.int64(row0), radius, view),
        )
    return out


class GPUEngine(Engine):
    """The GPU spatial index for KNN and radius, fused kernels for matrices and k-means.

    Parameters
    ----------
    earth_radius_m : float
        Sphere radius, metres.
    pool_size_bytes : int, optional
        Device memory pool reserved at first use (``gpu_memory.initialise_pool``); the
        pool is per process, so only the first engine's setting counts (a later one that
        asks for another is told so in the log).
    managed_memory : bool
        Managed (unified) memory pool for sets larger than the card; off by default.
    leaf_size : int
        Points per leaf of the index.
    """

    name = "gpu"

    def __init__(
        self,
        earth_radius_m: float = EARTH_RADIUS_M,
        *,
        pool_size_bytes: int | None = None,
        managed_memory: bool = False,
        leaf_size: int = LEAF_SIZE,
    ) -> None:
        super().__init__(earth_radius_m)
        if leaf_size < 1:
            raise ValueError(f"leaf_size must be at least 1, got {leaf_size}")
        self.leaf_size = leaf_size
        self.pool = gpu_memory.initialise_pool(pool_size_bytes, managed_memory=managed_memory)

    @gpu_memory.out_of_memory_guard("building a dataset's GPU index")
    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> GPUIndex:
        _kernels()  # compiled here at the latest, never by a query
        return GPUIndex(lat, lon, self.earth_radius_m, self.leaf_size)

    @gpu_memory.out_of_memory_guard("a distance matrix")
    def distance_matrix(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> np.ndarray:
        np_dtype = np.dtype(dtype)
        m, n = int(np.shape(lat1)[0]), int(np.shape(lat2)[0])
        out = np.empty((m, n), dtype=np_dtype)
        if m == 0 or n == 0:
            return out
        a = unit_vectors_device(lat1, lon1).astype(np_dtype, copy=False)
        b = unit_vectors_device(lat2, lon2).astype(np_dtype, copy=False)
        step = max(1, _MATRIX_TILE_BYTES // (n * np_dtype.itemsize))
        tile = cp.empty((min(step, m), n), dtype=np_dtype)
        for start in range(0, m, step):
            stop = min(m, start + step)
            part = _matrix_device(a[start:stop], b, self.earth_radius_m, out=tile[: stop - start])
            part.get(out=out[start:stop])
        return out

    def distance_matrix_device(
        self,
        lat1: np.ndarray,
        lon1: np.ndarray,
        lat2: np.ndarray,
        lon2: np.ndarray,
        dtype: MatrixDtype = "float64",
    ) -> cp.ndarray:
        """The whole matrix (m, n) kept on the device, for callers that reduce it there.

        float32 carries up to about 4 m of error at long range (its own precision);
        float64 is exact to the reference's 1 mm.
        """
        np_dtype = np.dtype(dtype)
        a = unit_vectors_device(lat1, lon1).astype(np_dtype, copy=False)
        b = unit_vectors_device(lat2, lon2).astype(np_dtype, copy=False)
        return _matrix_device(a, b, self.earth_radius_m)

    def warm_up(self) -> None:
        """Compile every kernel and run each once, with the CuPy routines they use."""
        lat = np.linspace(-89.0, 89.0, 4 * SORT_QUERIES_FROM)
        lon = np.linspace(-179.0, 179.0, lat.shape[0])
        index = self.build_index(lat, lon)
        # cuDF's first table costs seconds (its own kernels): pay it here, not at an upload.
        n = lat.shape[0]
        index.keep_columns(
            pa.table({"id": np.arange(n), "name": pa.array(["x"] * n), "value": lat})
        )
        index.take_columns(["id", "name", "value"], np.zeros(DEVICE_TAKE_FROM, dtype=np.int64))
        for k in REGISTER_K:
            index.knn(lat[: SORT_QUERIES_FROM + 1], lon[: SORT_QUERIES_FROM + 1], k)
        index.knn(lat[:3], lon[:3], 10, max_distance_m=1000.0)
        index.knn(lat[:3], lon[:3], MAX_TREE_K + 1)
        index.radius(lat[: SORT_QUERIES_FROM + 1], lon[: SORT_QUERIES_FROM + 1], 50_000.0)
        index.radius(lat[:2], lon[:2], 1e9)  # long segments: the device sort
        index.kmeans(4, max_iter=2)
        index.kmeans(4, weights=np.ones(lat.shape[0]), max_iter=2)
        for area in _WARM_UP_AREAS:
            index.area_rows(lat, lon, area)
        for dtype in ("float32", "float64"):
            self.distance_matrix(lat[:5], lon[:5], lat[:7], lon[:7], dtype=dtype)  # type: ignore[arg-type]
        cp.cuda.Device().synchronize()

    def memory_pool_bytes(self) -> tuple[int, int]:
        return gpu_memory.pool_bytes()

    def describe_device(self) -> str:
        device = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(device.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        _, total = gpu_memory.device_memory()
        major, minor = device.compute_capability[0], device.compute_capability[1:]
        return (
            f"gpu: {name}, {total / 2**30:.0f} GiB, compute {major}.{minor}, "
            f"{props['multiProcessorCount']} SMs; {self.pool.describe()}"
        )
