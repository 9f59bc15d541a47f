"""Keeping the server's resident memory close to what its datasets need.

An upload passes through transient buffers (received messages, then the stored copy)
about twice the dataset's size. Without care they stay resident after the change:
glibc keeps freed heap memory in its per-thread arenas and Arrow's allocator keeps its
pages. Measured on a 10M-point upload (docs/benchmarks.md): 192 bytes per point
resident by default, 67 with both measures, against 64 held by the dataset: the
allocation thresholds of ``geonear.allocator``'s "server" policy (set when the server is
built) and the release below after every change.
"""

from __future__ import annotations

import pyarrow as pa

from geonear.allocator import libc


def release_freed_memory() -> None:
    """Hand memory freed by a change (received batches, copies) back to the OS."""
    pa.default_memory_pool().release_unused()
    if libc is not None:
        libc.malloc_trim(0)
