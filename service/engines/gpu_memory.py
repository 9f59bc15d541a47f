"""Device memory of the GPU engines: one pool shared by CuPy, cuDF and cuML.

With RMM installed, ``initialise_pool`` calls ``rmm.reinitialize(pool_allocator=True,
initial_pool_size=...)`` and points CuPy's allocator at RMM (``rmm_cupy_allocator``), so
every RAPIDS library and CuPy draw from the same pool; without RMM, CuPy's own memory pool
is used, capped at the same size. A managed-memory pool (``managed_memory=True``) lets a
point set outgrow the card at the cost of page migration; it is off by default and is
never sized above the card's free memory, since asking for more managed memory than is
free can hang the GPU.

An allocation failure anywhere in a GPU call is turned into :class:`DeviceOutOfMemory` (a
``MemoryError``), which the server answers with RESOURCE_EXHAUSTED and survives; a sticky
CUDA error (illegal address, failed launch, lost context) into
:class:`~geonear.service.engines.base.DeviceLost`, on which the server exits to be restarted.

CuPy is imported inside the functions: importing this module imports no GPU library.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from geonear.service.engines.base import DeviceLost

log = logging.getLogger("geonear.gpu")

#: Default pool: this fraction of the device memory free at start.
DEFAULT_POOL_FRACTION = 0.5
#: RMM pools are sized in multiples of 256 bytes.
_RMM_ALIGNMENT = 256

F = TypeVar("F", bound=Callable[..., Any])


class DeviceOutOfMemory(MemoryError):
    """A device allocation failed; the message says how much was in use and what to change."""


@dataclass(frozen=True)
class PoolInfo:
    """What ``initialise_pool`` set up.

    Attributes
    ----------
    allocator : str
        "rmm" or "cupy".
    managed : bool
        Whether the pool is managed (unified) memory.
    size_bytes : int
        Bytes reserved for the pool at start.
    """

    allocator: str
    managed: bool
    size_bytes: int

    def describe(self) -> str:
        kind = "managed" if self.managed else "device"
        return f"{self.allocator} {kind} pool {self.size_bytes / 2**30:.1f} GiB"


_lock = threading.Lock()
_pool: PoolInfo | None = None
# The size the first call asked for (the pool's own is rounded and lowered to the free).
_asked_size: int | None = None
_statistics: Any = None  # rmm StatisticsResourceAdaptor when RMM is used
_cupy_pool: Any = None  # cupy MemoryPool when RMM is not used


def device_memory() -> tuple[int, int]:
    """(free, total) bytes of the current CUDA device."""
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(free), int(total)


def initialise_pool(
    pool_size_bytes: int | None = None,
    *,
    managed_memory: bool = False,
    use_rmm: bool | None = None,
) -> PoolInfo:
    """Set up the shared device memory pool once per process; later calls return it.

    A later call that asks for another size, or for managed memory where the pool is not
    managed, gets the pool in use and a warning that names it: the pool cannot change
    under the arrays already in it.

    Parameters
    ----------
    pool_size_bytes : int, optional
        Bytes to reserve at start, and the pool's limit; by default
        ``DEFAULT_POOL_FRACTION`` of the free memory, growing as needed. A request above
        the free memory is lowered to it, with a warning.
    managed_memory : bool
        Use a managed (unified memory) pool; slower (pages migrate on demand), for sets
        larger than the card.
    use_rmm : bool, optional
        Force RMM (error if missing) or CuPy's pool; default: RMM when installed.
    """
    global _pool, _statistics, _asked_size
    with _lock:
        if _pool is not None:
            if (pool_size_bytes is not None and pool_size_bytes != _asked_size) or (
                managed_memory and not _pool.managed
            ):
                log.warning(
                    "GPU memory: the %s set up first in this process stays in use; "
                    "the pool asked for now (%s%s) is not set up",
                    _pool.describe(),
                    "default size" if pool_size_bytes is None else f"{pool_size_bytes} bytes",
                    ", managed" if managed_memory else "",
                )
            return _pool
        _asked_size = pool_size_bytes
        import cupy

        free, _ = device_memory()
        size = int(free * DEFAULT_POOL_FRACTION) if pool_size_bytes is None else pool_size_bytes
        if size > free:
            log.warning(
                "GPU pool of %.1f GiB asked for, but only %.1f GiB are free: using %.1f GiB",
                size / 2**30,
                free / 2**30,
                free / 2**30,
            )
            size = free
        size = max(0, size - size % _RMM_ALIGNMENT)
        if managed_memory:
            log.warning(
                "managed GPU memory is on: point sets may exceed the card, but pages "
                "migrate on demand and queries on such sets run many times slower"
            )
        rmm = _import_rmm(use_rmm)
        if rmm is not None:
            from rmm.allocators.cupy import rmm_cupy_allocator

            # A size asked for is also the pool's limit, as for CuPy's pool below.
            rmm.reinitialize(
                pool_allocator=True,
                managed_memory=managed_memory,
                initial_pool_size=size,
                maximum_pool_size=size if managed_memory or pool_size_bytes is not None else None,
            )
            # Counting adaptor on top of the pool: bytes in use, for ServerInfo.
            _statistics = rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource())
            rmm.mr.set_current_device_resource(_statistics)
            cupy.cuda.set_allocator(rmm_cupy_allocator)
            _pool = PoolInfo("rmm", managed_memory, size)
        else:
            global _cupy_pool
            if managed_memory:
                _cupy_pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed)
            else:
                _cupy_pool = cupy.get_default_memory_pool()
            cupy.cuda.set_allocator(_cupy_pool.malloc)
            # CuPy reserves lazily, so only a size asked for (or the free memory, for a
            # managed pool) becomes its limit; by default it grows as RMM's pool would.
            if managed_memory or pool_size_bytes is not None:
                _cupy_pool.set_limit(size=size)
            _pool = PoolInfo("cupy", managed_memory, size)
        log.info("GPU memory: %s", _pool.describe())
        return _pool


def _import_rmm(use_rmm: bool | None) -> Any:
    if use_rmm is False:
        return None
    try:
        import rmm
        import rmm.allocators.cupy  # probes the CuPy bridge too
    except ImportError:
        if use_rmm:
            raise ImportError("RMM is not installed (pip install 'geonear[gpu]')") from None
        return None
    return rmm


def pool_info() -> PoolInfo | None:
    """The pool set up by ``initialise_pool``, or None before it ran."""
    return _pool


def pool_bytes() -> tuple[int, int]:
    """(bytes in use, bytes reserved) of the shared pool; (0, 0) before it is set up."""
    if _pool is None:
        return (0, 0)
    if _pool.allocator == "rmm":
        used = _rmm_current_bytes()
        return (used, max(_pool.size_bytes, used))
    pool = _cupy_pool
    return (int(pool.used_bytes()), max(int(pool.total_bytes()), _pool.size_bytes))


def _rmm_current_bytes() -> int:
    stats = _statistics
    if stats is None:
        return 0
    # The statistics API moved between RMM releases: a dict before, an object after.
    counts = stats.allocation_counts
    if isinstance(counts, dict):
        return int(counts.get("current_bytes", 0))
    return int(getattr(counts, "current_bytes", 0))


def _is_out_of_memory(exc: BaseException) -> bool:
    import cupy

    if isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return True
    if isinstance(exc, MemoryError):  # RMM's ("std::bad_alloc: out_of_memory: ...")
        return not isinstance(exc, DeviceOutOfMemory)
    # CuPy's runtime errors, and libcudf's from cuDF calls, name the failure.
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("cudaErrorMemoryAllocation", "out_of_memory", "out of memory")
    )


#: Sticky CUDA errors, by their runtime and driver API names: after one the context is
#: unusable and every later call fails, so only a new process recovers.
STICKY_CUDA_ERRORS = (
    ("cudaErrorIllegalAddress", "CUDA_ERROR_ILLEGAL_ADDRESS"),
    ("cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED"),
    ("cudaErrorLaunchTimeout", "CUDA_ERROR_LAUNCH_TIMEOUT"),
    ("cudaErrorAssert", "CUDA_ERROR_ASSERT"),
    ("cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR"),
    ("cudaErrorIllegalInstruction", "CUDA_ERROR_ILLEGAL_INSTRUCTION"),
    ("cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS"),
    ("cudaErrorInvalidAddressSpace", "CUDA_ERROR_INVALID_ADDRESS_SPACE"),
    ("cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC"),
    ("cudaErrorECCUncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE"),
    ("cudaErrorContextIsDestroyed", "CUDA_ERROR_CONTEXT_IS_DESTROYED"),
)


def is_device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` reports a sticky CUDA error (CuPy, RMM and cuDF all name it)."""
    text = str(exc)
    return any(name in text for pair in STICKY_CUDA_ERRORS for name in pair)


@contextmanager
def translate_out_of_memory(what: str) -> Iterator[None]:
    """Turn a device allocation failure inside the block into :class:`DeviceOutOfMemory`.

    The pool's cached free blocks are released first, so the next request starts from
    a clean pool. A sticky CUDA error becomes :class:`DeviceLost` (nothing is released:
    the context is gone).
    """
    try:
        yield
    except Exception as exc:
        if isinstance(exc, DeviceLost):
            raise
        if is_device_lost(exc):
            raise DeviceLost(f"the GPU failed during {what}: {exc}") from exc
        if not _is_out_of_memory(exc):
            raise
        release_cached_blocks()
        used, total = pool_bytes()
        raise DeviceOutOfMemory(
            f"GPU memory exhausted during {what} ({used / 2**30:.2f} of "
            f"{total / 2**30:.2f} GiB of the pool in use); use fewer points per call, "
            "a larger --gpu-pool-size-bytes, or --managed-memory"
        ) from exc


def out_of_memory_guard(what: str) -> Callable[[F], F]:
    """Decorator form of :func:`translate_out_of_memory`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with translate_out_of_memory(what):
                return fn(*args, **kwargs)

        return guarded  # type: ignore[return-value]

    return wrap


def release_cached_blocks() -> None:
    """Return CuPy's cached free blocks (device and pinned) to the driver."""
    import cupy

    if _cupy_pool is not None:
        _cupy_pool.free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
