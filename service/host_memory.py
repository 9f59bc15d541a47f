"""Keeping the server's resident memory close to what its datasets need.

An upload passes through transient buffers (received messages, then the stored copy)
about twice the dataset's size. Without care they stay resident after the change:
glibc keeps freed heap memory in its per-thread arenas and Arrow's allocator keeps its
pages. Measured on a 10M-point upload (docs/benchmarks.md): 192 bytes per point
resident by default, 67 with both measures below, against 64 held by the dataset.
"""

from __future__ import annotations

import ctypes
import logging

import pyarrow as pa

log = logging.getLogger("geonear.memory")

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
#: Allocations at least this large get their own mapping, returned to the OS on free.
MMAP_THRESHOLD_BYTES = 256 * 1024


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only; absent on musl and macOS
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load_libc()


def tune_allocator() -> None:
    """Serve large allocations from their own mappings (glibc only; a no-op elsewhere).

    glibc raises its mmap threshold dynamically up to 32 MiB, after which the 1 MiB
    message buffers of an upload land in thread arenas that fragment and never shrink;
    a fixed threshold keeps them out.
    """
    if _libc is not None and _libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD) failed; memory use after uploads may be higher")


def release_freed_memory() -> None:
    """Hand memory freed by a change (received batches, copies) back to the OS."""
    pa.default_memory_pool().release_unused()
    if _libc is not None:
        _libc.malloc_trim(0)
