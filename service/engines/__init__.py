"""Engines: one interface (``base``), several implementations, chosen by name.

| name           | KNN / radius                         | matrix, k-means       | needs        |
|----------------|--------------------------------------|-----------------------|--------------|
| numpy-brute    | float64 brute force (the reference)  | NumPy                 | -            |
| sklearn        | BallTree(haversine), exact re-rank   | NumPy                 | -            |
| cpu            | cKDTree on unit vectors, all cores   | NumPy                 | -            |
| gpu            | GPU spatial index, float64 refine    | fused CuPy kernels    | CuPy + GPU   |
| cuml           | cuML NearestNeighbors (comparison)   | cuML KMeans           | RAPIDS + GPU |
| cupy-broadcast | naive CuPy broadcasting (baseline)   | CuPy                  | CuPy + GPU   |
| dask           | partitions on Dask workers, merged   | tiled / partial sums  | distributed  |
| dask-gpu       | the same on dask-cuda workers (gpu)  | tiled / partial sums  | dask-cuda    |

GPU engines are imported only when asked for, so importing geonear never imports CuPy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from geonear.service.engines.base import (
    Engine,
    KMeansResult,
    Neighbours,
    PointIndex,
    RadiusNeighbours,
)
from geonear.service.geometry import EARTH_RADIUS_M

__all__ = [
    "Engine",
    "EngineUnavailable",
    "KMeansResult",
    "Neighbours",
    "PointIndex",
    "RadiusNeighbours",
    "create_engine",
    "engine_names",
    "gpu_available",
    "runnable_engine_names",
]

#: Engine name -> "module:class", imported on first use.
_ENGINES: dict[str, str] = {
    "numpy-brute": "geonear.service.engines.reference:ReferenceEngine",
    "sklearn": "geonear.service.engines.sklearn_balltree:SklearnEngine",
    "cpu": "geonear.service.engines.cpu:CPUEngine",
    "gpu": "geonear.service.engines.gpu:GPUEngine",
    "cuml": "geonear.service.engines.cuml_engines:CumlEngine",
    "cupy-broadcast": "geonear.service.engines.cuml_engines:CupyBroadcastEngine",
    "dask": "geonear.service.engines.dask_cluster:DaskEngine",
    "dask-gpu": "geonear.service.engines.dask_cluster:DaskGPUEngine",
}

#: Engines that need a working CUDA device.
GPU_ENGINES = frozenset({"gpu", "cuml", "cupy-broadcast", "dask-gpu"})


class EngineUnavailable(RuntimeError):
    """The engine cannot run here; the message says why and what to install."""


def engine_names() -> list[str]:
    """Every engine geonear knows, runnable here or not."""
    return list(_ENGINES)


def runnable_engine_names() -> list[str]:
    """The engines this host can run (GPU engines only with a working GPU)."""
    has_gpu = gpu_available()[0]
    return [n for n in _ENGINES if has_gpu or n not in GPU_ENGINES]


_gpu_probe: tuple[bool, str] | None = None


def gpu_available() -> tuple[bool, str]:
    """Whether CuPy sees a working CUDA device, and why not. Probed once per process."""
    global _gpu_probe
    if _gpu_probe is None:
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            if count < 1:
                _gpu_probe = (False, "CuPy sees no CUDA device")
            else:
                cupy.zeros(1).sum().item()  # a real launch, not just a driver query
                _gpu_probe = (True, f"{count} CUDA device(s)")
        except ImportError:
            _gpu_probe = (False, "CuPy is not installed (pip install 'geonear[gpu]')")
        except Exception as exc:  # CUDA driver/runtime errors come in many types
            _gpu_probe = (False, f"CUDA is not usable: {exc}")
    return _gpu_probe


def _engine_class(name: str) -> Callable[..., Engine]:
    try:
        target = _ENGINES[name]
    except KeyError:
        raise EngineUnavailable(
            f"unknown engine {name!r}; choose one of {', '.join(_ENGINES)}"
        ) from None
    if name in GPU_ENGINES:
        ok, why = gpu_available()
        if not ok:
            raise EngineUnavailable(f"engine {name!r} needs a GPU: {why}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineUnavailable(
            f"engine {name!r} is not available: {exc} (pip install 'geonear[gpu]')"
        ) from exc
    cls: Callable[..., Engine] = getattr(module, class_name)
    return cls


def create_engine(name: str, earth_radius_m: float = EARTH_RADIUS_M, **options: Any) -> Engine:
    """Instantiate the engine called ``name``; raises EngineUnavailable with the reason.

    ``options`` go to the engine's constructor (e.g. ``pool_size_bytes`` for ``gpu``).
    """
    return _engine_class(name)(earth_radius_m=earth_radius_m, **options)
