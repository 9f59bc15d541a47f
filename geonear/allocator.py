"""glibc's allocation thresholds, chosen by what the process does: serve or receive.

glibc serves an allocation of 128 KiB or more with a fresh ``mmap`` and unmaps it when
freed; its dynamic threshold rises only above a size freed before, so a stream of
same-sized buffers never leaves that path. Two policies follow:

``"server"``: a fixed 768 KiB mmap threshold and a 64 MiB trim threshold. An upload's
    transient 1 MiB message buffers (the Python client's batches) stay above it: they
    have mappings of their own, returned when freed, instead of landing in thread
    arenas that fragment and never shrink. After a 10M-point upload the server holds
    68 bytes a point, as with a 256 KiB threshold, against 92 with 2 MiB and 192 with
    glibc's dynamic threshold (docs/benchmarks.md, "Foundation" and "Answer batches of
    512 KiB"). The server's answers go out in messages below it
    (``wire.ANSWER_BATCH_BYTES``, 512 KiB), which the trim threshold lets reuse the
    heap's top instead of giving it back and faulting it in again after each message:
    a per-query join of 1M x 5 points through the Python client took 773-806 -> 570-608
    ms on the 2-core host (224 KiB messages under a 256 KiB threshold before).
``"client"``: an 8 MiB threshold and a 64 MiB trim threshold. A large answer arrives as
    message bodies of 512 KiB to 1 MiB that gRPC, protobuf and pyarrow copy into fresh
    buffers one after another; as mappings, each costs a page fault for every 4 KiB page and an
    ``munmap``, while heap memory, once faulted in, is reused. Measured on the 2-core
    host, a 16 MB answer in 16 messages: the protobuf parse 8.9 -> 0.9 ms and the Arrow
    decode 11.9 -> 1.8 ms; up to 64 MiB of freed memory stays with the process.

The server's policy wins: a server sets it whatever came before, and a client sets its
own only in a process that serves nothing (``geonear.connect()`` with no target runs
both in one process, as a server). Nothing changes where the environment already chose
(``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``), where ``GEONEAR_TUNE_MALLOC=0``,
or outside glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from typing import Literal

log = logging.getLogger("geonear.memory")

Policy = Literal["server", "client"]

#: (mmap threshold, trim threshold), bytes.
POLICIES: dict[str, tuple[int, int]] = {
    "server": (768 << 10, 64 << 20),
    "client": (8 << 20, 64 << 20),
}
#: mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_in_force: str | None = None


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


def tune_allocator(policy: Policy) -> str | None:
    """Set ``policy``'s thresholds where this module's rules allow; the policy in force."""
    global _in_force
    with _lock:
        if _in_force == policy or (policy == "client" and _in_force == "server"):
            return _in_force
        if libc is None or _left_alone():
            return None
        mmap_bytes, trim_bytes = POLICIES[policy]
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1
        if not (ok and libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1):
            log.warning("mallopt failed; large messages and uploads may cost more")
            return None
        _in_force = policy
        return policy


def policy_in_force() -> str | None:
    """The policy this process set ("server", "client"), None where it set none."""
    return _in_force


def _left_alone() -> bool:
    if os.environ.get("GEONEAR_TUNE_MALLOC", "1").strip().lower() in ("0", "false", "no", "off"):
        return True
    return "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ
