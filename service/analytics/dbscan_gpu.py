"""DBSCAN on a GPU index: every step on the device, the answer copied to the host once.

The steps are those of ``dbscan`` on the host (see its module docstring): neighbour
counts from the index's counting search (``GPUIndex.radius_count``, the same decisions
as its radius search, which match the float64 reference), the pair bound checked, then
the neighbour lists of slices of points (``GPUIndex.radius_device``, kept on the
device) reduced to links between core points and each border point's smallest core
neighbour, components by ``min_label_components`` (min-label hooking and pointer
jumping in whole-array CuPy steps), and the numbering of ``number_clusters``. Labels
are those of the host path, bit for bit.

This module imports CuPy: ``dbscan`` imports it only for a GPU index.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from geonear.service.analytics.dbscan import (
    DbscanResult,
    ShouldStop,
    check_stop,
    core_links,
    count_neighbours,
    min_label_components,
    number_clusters,
    pair_slices,
)
from geonear.service.engines import gpu_memory
from geonear.service.engines.gpu import GPUIndex, _Queries

#: (point, neighbour) pairs gathered at once on the device (about 32 bytes each with
#: the temporaries).
DEVICE_SLICE_PAIRS = 1 << 24


@gpu_memory.out_of_memory_guard("DBSCAN")
def dbscan_on_device(
    lat: np.ndarray,
    lon: np.ndarray,
    eps_m: float,
    min_samples: int,
    index: GPUIndex,
    limit: int,
    should_stop: ShouldStop,
) -> DbscanResult:
    """``dbscan`` of checked points over their GPU index (``limit``: the pair bound)."""
    n = int(lat.shape[0])
    counts = count_neighbours(index, lat, lon, eps_m, limit, should_stop)
    core = cp.asarray(counts >= min_samples)
    border_core = cp.full(n, n, dtype=cp.int32)
    sources, targets = [], []
    for start, stop in pair_slices(counts, DEVICE_SLICE_PAIRS):
        check_stop(should_stop)
        queries = _Queries(lat[start:stop], lon[start:stop], index)
        offsets, rows, _ = index.radius_device(queries, eps_m)
        n_pairs = int(rows.shape[0])
        # Each pair's point: the number of slice offsets at or below the pair's position.
        query = cp.searchsorted(offsets[1:], cp.arange(n_pairs, dtype=cp.int64), side="right")
        source, target = core_links(query + start, rows, core, border_core, cp)
        sources.append(source)
        targets.append(target)
        del offsets, rows, query
    source, target = cp.concatenate(sources), cp.concatenate(targets)
    del sources, targets
    parent = min_label_components(source, target, n, cp, should_stop)
    labels, n_clusters, sizes = number_clusters(core, parent, border_core, cp)
    return DbscanResult(
        labels=cp.asnumpy(labels),
        core=counts >= min_samples,
        n_clusters=n_clusters,
        sizes=cp.asnumpy(sizes),
        neighbour_pairs=int(counts.sum()),
    )
