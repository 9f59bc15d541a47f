"""Keeping the server's resident memory close to what its datasets need.

An upload passes through transient buffers (received messages, then the stored copy)
about twice the dataset's size. Without care they stay resident after the change:
glibc keeps freed heap memory in its per-thread arenas and Arrow's allocator keeps its
pages. So the store releases freed memory after every change, and an upload once more
when its received messages are freed (``servicer._Upload.commit``): below glibc's mmap
threshold (``geonear.allocator``) they lie on the heap. Measured on a 10M-point upload
(docs/benchmarks.md): 192 bytes per point resident with glibc's defaults and no
release, 68 with both, against 64 held by the dataset; 93 when the release came only
before the messages were freed.
"""

from __future__ import annotations

import pyarrow as pa

from geonear.allocator import libc


def release_freed_memory() -> None:
    """Hand memory freed by a change (received batches, copies) back to the OS."""
    pa.default_memory_pool().release_unused()
    if libc is not None:
        libc.malloc_trim(0)
