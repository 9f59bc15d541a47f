"""glibc's allocation thresholds, the same in every geonear process: server or client.

glibc serves an allocation of 128 KiB or more with a fresh ``mmap`` and unmaps it when
freed; its dynamic threshold rises only above a size freed before, so a stream of
same-sized buffers never leaves that path. As a mapping, each such buffer costs a page
fault for every 4 KiB page and an ``munmap``; heap memory, once faulted in, is reused.
geonear sets an 8 MiB mmap threshold and a 64 MiB trim threshold:

- A big answer travels as messages of 2 MiB (``wire.ANSWER_BATCH_BYTES``), which the
  server's encoder and gRPC, and on the other side gRPC and pyarrow, copy into fresh
  buffers one after another; below the threshold they reuse the heap, and the trim
  threshold keeps up to 64 MiB of it from going back after each message. Measured on
  the 2-core host: a 16 MB answer in 16 messages, the client's protobuf parse 8.9 -> 0.9
  ms and its Arrow decode 11.9 -> 1.8 ms; a per-query join of 1M x 5 points through the
  Python client 586 -> 416 ms (median) against 512 KiB messages under a server threshold
  of 768 KiB (docs/benchmarks.md, "Answer messages of 2 MiB").
- An upload's 1 MiB messages land on the heap too, in the arenas of gRPC's threads. The
  server hands their memory back (``geonear.service.host_memory``) once the change is
  stored and the messages are freed: after a 10M-point upload it holds 68 bytes a point,
  as it did with the messages mapped above a 768 KiB threshold.

Nothing changes where the environment already chose (``MALLOC_MMAP_THRESHOLD_``/
``MALLOC_TRIM_THRESHOLD_``), where ``GEONEAR_TUNE_MALLOC=0``, or outside glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger("geonear.memory")

#: glibc's mmap threshold and trim threshold, bytes.
MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 64 << 20
#: mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_in_force = False


def _load_libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc


libc = _load_libc()


def tune_allocator() -> bool:
    """Set the thresholds, once a process, where this module's rules allow; whether set."""
    global _in_force
    with _lock:
        if _in_force:
            return True
        if libc is None or _left_alone():
            return False
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        if not (ok and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1):
            log.warning("mallopt failed; large messages and uploads may cost more")
            return False
        _in_force = True
        return True


def _left_alone() -> bool:
    if os.environ.get("GEONEAR_TUNE_MALLOC", "1").strip().lower() in ("0", "false", "no", "off"):
        return True
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ
