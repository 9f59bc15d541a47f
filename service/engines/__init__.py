"""Engines: one interface (``base``), several implementations, each declared once.

Every engine has an :class:`EngineSpec` in :data:`ENGINES`: its name, where it runs,
what it can answer (:class:`Capability`), the options its constructor takes and a line
about it. The server, the command line, ServerInfo and ``geonear bench`` all read these
specs; a query an engine cannot answer is refused before the call (UNIMPLEMENTED, with
the reason), never met as NotImplementedError at run time.

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
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from geonear.geometry import EARTH_RADIUS_M
from geonear.service.engines.base import (
    Engine,
    KMeansResult,
    Neighbours,
    PointIndex,
    RadiusNeighbours,
)
from geonear.service.engines.spherical_kmeans import seed_kmeans_plus_plus
from geonear.service.errors import EngineUnavailable, Unsupported

__all__ = [
    "ENGINES",
    "Capability",
    "Engine",
    "EngineSpec",
    "EngineUnavailable",
    "KMeansResult",
    "Neighbours",
    "PointIndex",
    "RadiusNeighbours",
    "create_engine",
    "engine_names",
    "engine_spec",
    "gpu_available",
    "register_engine",
    "require",
    "runnable_engine_names",
    "seed_kmeans_plus_plus",
]


class Capability(StrEnum):
    """What an engine's index or the engine itself answers.

    Query kinds need these: KNN, KnnJoin and filtered KNN need ``KNN``; Radius,
    RadiusJoin, CountWithin and DBSCAN need ``RADIUS``; DistanceMatrix needs ``MATRIX``;
    KMeans needs ``KMEANS``. Filters and areas are answered by building an index of the
    selected points with the same engine, so they need what the query needs.
    """

    KNN = "knn"
    #: Points within a radius and their counts (``PointIndex.radius``/``radius_count``).
    RADIUS = "radius"
    #: Great-circle distance matrices (``Engine.distance_matrix``).
    MATRIX = "matrix"
    #: k-means of the indexed points (``PointIndex.kmeans``).
    KMEANS = "kmeans"
    #: k-means by the spherical definition exactly (cuML's Euclidean KMeans is not).
    SPHERICAL_KMEANS = "spherical-kmeans"


_ALL = frozenset(Capability)


@dataclass(frozen=True)
class EngineSpec:
    """One engine, declared once."""

    name: str
    #: "module:class", imported on first use.
    target: str
    #: Where its work runs: "cpu" or "gpu" (a GPU engine needs a working CUDA device).
    device_kind: Literal["cpu", "gpu"]
    capabilities: frozenset[Capability]
    summary: str
    #: Keyword options of its constructor beyond ``earth_radius_m``.
    options: tuple[str, ...] = ()
    #: Whether its index lives in the server's process (DBSCAN searches it directly;
    #: with a distributed index it builds a local one).
    local_index: bool = True

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "numpy-brute",
            "geonear.service.engines.reference:ReferenceEngine",
            "cpu",
            _ALL,
            "float64 brute force: the reference every engine matches",
        ),
        EngineSpec(
            "sklearn",
            "geonear.service.engines.sklearn_balltree:SklearnEngine",
            "cpu",
            _ALL,
            "scikit-learn BallTree(haversine) with an exact float64 re-rank",
        ),
        EngineSpec(
            "cpu",
            "geonear.service.engines.cpu:CPUEngine",
            "cpu",
            _ALL,
            "SciPy cKDTree on unit vectors, all cores, exact float64 re-rank",
        ),
        EngineSpec(
            "gpu",
            "geonear.service.engines.gpu:GPUEngine",
            "gpu",
            _ALL,
            "GPU spatial index and fused CuPy kernels, float64 refine",
            options=("pool_size_bytes", "managed_memory", "leaf_size"),
        ),
        EngineSpec(
            "cuml",
            "geonear.service.engines.cuml_engines:CumlEngine",
            "gpu",
            frozenset({Capability.KNN, Capability.KMEANS}),
            "cuML NearestNeighbors(haversine) re-ranked, cuML's Euclidean KMeans "
            "(for comparison: no radius, no matrix)",
        ),
        EngineSpec(
            "cupy-broadcast",
            "geonear.service.engines.cuml_engines:CupyBroadcastEngine",
            "gpu",
            _ALL,
            "naive CuPy broadcasting brute force (the baseline a GPU index must beat)",
        ),
        EngineSpec(
            "dask",
            "geonear.service.engines.dask_cluster:DaskEngine",
            "cpu",
            _ALL,
            "partitions on Dask workers, answers merged exactly",
            options=("scheduler", "local_workers", "partition_dir", "worker_engine"),
            local_index=False,
        ),
        EngineSpec(
            "dask-gpu",
            "geonear.service.engines.dask_cluster:DaskGPUEngine",
            "gpu",
            _ALL,
            "the same on dask-cuda workers, each indexing with the gpu engine",
            options=("scheduler", "local_workers", "partition_dir"),
            local_index=False,
        ),
    )
}


def engine_spec(name: str) -> EngineSpec:
    """The spec of the engine called ``name``; EngineUnavailable for an unknown name."""
    try:
        return ENGINES[name]
    except KeyError:
        raise EngineUnavailable(
            f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}"
        ) from None


def register_engine(spec: EngineSpec) -> None:
    """Declare one more engine (e.g. an engine of another package, or a test's): its
    class is imported from ``spec.target`` when first created."""
    ENGINES[spec.name] = spec


def require(engine_name: str, capability: Capability, what: str) -> None:
    """Refuse ``what`` (a query, named for the message) before the call when the engine
    called ``engine_name`` cannot answer it: Unsupported (UNIMPLEMENTED) with the reason."""
    spec = engine_spec(engine_name)
    if not spec.can(capability):
        able = [s.name for s in ENGINES.values() if s.can(capability)]
        raise Unsupported(
            f"{what} needs {capability.value!r}, which engine {spec.name!r} does not have "
            f"({spec.summary}); engines with it: {', '.join(able)}",
            engine=spec.name,
            capability=capability.value,
        )


def engine_names() -> list[str]:
    """Every engine geonear knows, runnable here or not."""
    return list(ENGINES)


def runnable_engine_names() -> list[str]:
    """The engines this host can run (GPU engines only with a working GPU)."""
    has_gpu = gpu_available()[0]
    return [n for n, spec in ENGINES.items() if has_gpu or spec.device_kind != "gpu"]


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
    spec = engine_spec(name)
    if spec.device_kind == "gpu":
        ok, why = gpu_available()
        if not ok:
            raise EngineUnavailable(f"engine {name!r} needs a GPU: {why}")
    module_name, class_name = spec.target.split(":")
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
