"""``geonear bench``: engines side by side in one process, on the same data.

Like the benchmark runner that RAPIDS ships for cuML, every engine named in
``--engines`` builds an index over the same points and answers the same queries; the
runner reports build time, the first (cold) call, the min and median of ``--repeat``
further (warm) calls, throughput, speed-up against scikit-learn and against the cKDTree
``cpu`` engine, and exactness against the float64 reference (the ``numpy-brute``
engine's formula, evaluated on the first ``ref_queries`` queries).

Engines that evaluate every (query, point) pair (``BRUTE_PAIRS``) run on the first
queries only, within a pair budget, and their times are scaled to the whole query set;
the output says so. An engine that cannot run here (:class:`EngineUnavailable`,
``NotImplementedError``) is skipped with its reason. For ``--op kmeans`` the baseline
``sklearn-kmeans`` row is scikit-learn's ``KMeans(n_init=1)`` on the same unit vectors,
started from the centres that geonear's k-means++ draws from the same seed.

Programmatic use (tests inject engines that are not registered)::

    doc = run_benchmark(BenchConfig(op="knn", n=10_000, queries=200),
                        extra_engines={"wrong": my_engine})
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from geonear.bench import report
from geonear.bench.exactness import EXACTNESS
from geonear.geometry import EARTH_RADIUS_M, angle_between, unit_vectors
from geonear.service.engines import (
    Engine,
    EngineUnavailable,
    create_engine,
    engine_names,
    gpu_available,
    seed_kmeans_plus_plus,
)

#: Server-side analytics: each engine through a server of its own (``geonear.bench.analytics``).
ANALYTICS_OPS = ("knn-join", "count-within", "filtered-knn", "dbscan", "within")
OPS = ("knn", "radius", "matrix", "kmeans", "build", *ANALYTICS_OPS)
DATA_KINDS = ("uniform", "clustered", "airports", "cities", "cities1000")
DTYPES = ("float64", "float32")
#: The scikit-learn KMeans baseline of ``--op kmeans`` (not an engine of the service).
SKLEARN_KMEANS = "sklearn-kmeans"
#: Engines the bench knows by name even where this build has not registered them yet.
GPU_ENGINE_NAMES = ("cupy-broadcast", "gpu", "cuml")
DEFAULT_ENGINES = ("cpu", "sklearn", "numpy-brute", *GPU_ENGINE_NAMES)
#: Engines of the served ops (``--served`` and the analytics) when none are named.
SERVED_ENGINES = ("cpu", "gpu")
#: Radius of ``--op radius`` when ``--radius-m`` is not given, metres.
DEFAULT_RADIUS_M = 20_000.0
#: Points a slow peer of an analytics op is timed on by default (then scaled).
PEER_POINTS = 100_000
#: Host memory from which ``--op within`` defaults to 10M points (else 1M), GiB.
WITHIN_10M_MEMORY_GIB = 64.0
#: Brute-force engines: (query, point) pairs per timed call; they run on a query subset.
BRUTE_PAIRS: dict[str, float] = {"numpy-brute": 1e7, "cupy-broadcast": 1e10}
#: (query, point) pairs of the float64 reference when ``ref_queries`` is not given.
REFERENCE_PAIRS = 3e7
#: What one unit of throughput counts, per op.
WORK_UNITS = {
    "knn": "queries/s",
    "radius": "queries/s",
    "matrix": "pairs/s",
    "kmeans": "point-iters/s",
    "build": "points/s",
    "knn-join": "left points/s",
    "count-within": "left points/s",
    "filtered-knn": "queries/s",
    "dbscan": "points/s",
    "within": "points/s",
}
#: Offset of bundled-set queries from the points they are drawn near, degrees (~10 km).
_QUERY_JITTER_DEG = 0.1


@dataclass(frozen=True)
class BenchConfig:
    """One bench run: the operation, its sizes and the engines to compare.

    ``n`` is the number of dataset points (matrix columns; each side of a join or a
    count); ``queries`` the number of query points (matrix rows). ``k`` is neighbours
    for knn, knn-join and filtered-knn, and clusters for kmeans. ``radius_m`` is the
    radius of radius (20 km when None), count-within (None: about 10 neighbours a point
    for uniform points) and the eps of dbscan (None: about 20 neighbours a point);
    ``min_samples`` is dbscan's. ``ref_queries`` bounds the queries checked against the
    float64 reference (default: as many as fit in ``REFERENCE_PAIRS`` pairs, at least
    10); ``brute_pairs`` is the (query, point) pair budget of one timed call of a
    brute-force engine (default: its entry in ``BRUTE_PAIRS``); ``peer_points`` the
    points (left points, or points clustered) a slow peer of an analytics op is timed on
    (default ``PEER_POINTS``).

    :meth:`for_op` gives an op its own defaults (sizes, data, engines) where the
    class's are not the op's.
    """

    op: str = "knn"
    n: int = 100_000
    queries: int = 10_000
    k: int = 10
    radius_m: float | None = None
    max_distance_m: float | None = None
    dtype: str = "float64"
    engines: tuple[str, ...] = DEFAULT_ENGINES
    data: str = "uniform"
    seed: int = 0
    repeat: int = 3
    max_iter: int = 20
    tol: float = 0.0
    min_samples: int = 5
    ref_queries: int | None = None
    brute_pairs: float | None = None
    peer_points: int | None = None

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("op", self.op, OPS),
            ("data", self.data, DATA_KINDS),
            ("dtype", self.dtype, DTYPES),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        for name in ("n", "queries", "k", "repeat", "max_iter", "min_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.radius_m is not None and not self.radius_m > 0:
            raise ValueError(f"radius_m must be positive, got {self.radius_m}")
        if self.op == "radius" and self.radius_m is None:
            object.__setattr__(self, "radius_m", DEFAULT_RADIUS_M)  # frozen: set once, here
        if self.ref_queries is not None and self.ref_queries < 1:
            raise ValueError(f"ref_queries must be at least 1, got {self.ref_queries}")
        if self.brute_pairs is not None and self.brute_pairs < 1:
            raise ValueError(f"brute_pairs must be at least 1, got {self.brute_pairs}")
        if self.peer_points is not None and self.peer_points < 1:
            raise ValueError(f"peer_points must be at least 1, got {self.peer_points}")
        if not self.engines:
            raise ValueError("engines must name at least one engine")

    @classmethod
    def for_op(cls, op: str, **values: Any) -> BenchConfig:
        """A config of ``op`` from ``values``; those missing or None take the op's
        defaults (:func:`op_defaults`), then the class's."""
        given = {name: value for name, value in values.items() if value is not None}
        return cls(op=op, **{**op_defaults(op), **given})

    def command(self) -> str:
        """The ``geonear bench`` command line that reproduces this run."""
        words = ["geonear", "bench", "--op", self.op, "--data", self.data, "--n", str(self.n)]
        if self.op in ("knn", "radius", "matrix", "filtered-knn"):
            words += ["--queries", str(self.queries)]
        if self.op in ("knn", "kmeans", "knn-join", "filtered-knn"):
            words += ["-k", str(self.k)]
        if self.op == "knn" and self.max_distance_m is not None:
            words += ["--max-distance-m", f"{self.max_distance_m:g}"]
        if self.op in ("radius", "count-within", "dbscan") and self.radius_m is not None:
            words += ["--radius-m", f"{self.radius_m:g}"]
        if self.op == "matrix":
            words += ["--dtype", self.dtype]
        if self.op == "kmeans":
            words += ["--max-iter", str(self.max_iter), "--tol", f"{self.tol:g}"]
        if self.op == "dbscan":
            words += ["--min-samples", str(self.min_samples)]
        if self.ref_queries is not None:
            words += ["--ref-queries", str(self.ref_queries)]
        if self.brute_pairs is not None:
            words += ["--brute-pairs", f"{self.brute_pairs:g}"]
        if self.peer_points is not None:
            words += ["--peer-points", str(self.peer_points)]
        words += ["--engines", ",".join(self.engines), "--seed", str(self.seed)]
        words += ["--repeat", str(self.repeat)]
        return shlex.join(words)


def op_defaults(op: str) -> dict[str, Any]:
    """Settings in which ``op`` differs from :class:`BenchConfig`'s defaults.

    The analytics ops run the two backends (``SERVED_ENGINES``); knn-join asks k=5;
    filtered-knn is sized as its target (1M points, 100k queries); dbscan clusters
    clustered points; within scans 10M points on a host of at least
    ``WITHIN_10M_MEMORY_GIB`` GiB, 1M elsewhere.
    """
    if op not in ANALYTICS_OPS:
        return {}
    defaults: dict[str, Any] = {"engines": SERVED_ENGINES}
    if op == "knn-join":
        defaults["k"] = 5
    elif op == "filtered-knn":
        defaults.update(n=1_000_000, queries=100_000)
    elif op == "dbscan":
        defaults["data"] = "clustered"
    elif op == "within":
        memory = report.memory_gib() or 0.0
        defaults["n"] = 10_000_000 if memory >= WITHIN_10M_MEMORY_GIB else 1_000_000
    return defaults


@dataclass(frozen=True)
class BenchData:
    """Dataset points and query points (float64 degrees) of one run."""

    lat: np.ndarray
    lon: np.ndarray
    q_lat: np.ndarray
    q_lon: np.ndarray
    description: str


@dataclass
class EngineResult:
    """One engine's row: times in seconds (scaled to all queries where ``scale`` > 1)."""

    engine: str
    status: str = "ok"  # "ok", "skipped" or "error"
    reason: str = ""
    device: str = ""
    warm_up_s: float | None = None
    build_s: float | None = None
    cold_s: float | None = None
    warm_min_s: float | None = None
    warm_median_s: float | None = None
    repeats: int = 0
    queries_run: int | None = None
    scale: float = 1.0
    throughput: float | None = None
    speedup_vs_sklearn: float | None = None
    speedup_vs_cpu: float | None = None
    exactness: dict[str, Any] = field(default_factory=dict)
    exact: bool | None = None
    notes: list[str] = field(default_factory=list)


def make_data(config: BenchConfig) -> BenchData:
    """The seeded points and queries of ``config.data`` (queries from the same distribution)."""
    from geonear.loaders import clustered_points, uniform_points

    n_q = query_count(config)
    if config.data in ("uniform", "clustered"):
        # One draw split in two, so clustered queries fall in the same clusters.
        draw = uniform_points if config.data == "uniform" else clustered_points
        lat, lon = draw(config.n + n_q, seed=config.seed)
        return BenchData(
            lat[: config.n],
            lon[: config.n],
            lat[config.n :],
            lon[config.n :],
            f"{config.data}, seed {config.seed}",
        )
    from geonear.loaders import load_bundled

    table = load_bundled(config.data)
    all_lat, all_lon = (table.column(c).to_numpy().astype(np.float64) for c in ("lat", "lon"))
    rng = np.random.default_rng(config.seed)
    rows = np.sort(rng.permutation(all_lat.shape[0])[: config.n])
    lat, lon = all_lat[rows], all_lon[rows]
    # Queries near real points, as users ask: a sample of them, moved by about 10 km.
    near = rng.integers(0, lat.shape[0], n_q)
    q_lat = np.clip(lat[near] + rng.normal(0.0, _QUERY_JITTER_DEG, n_q), -90.0, 90.0)
    q_lon = (lon[near] + rng.normal(0.0, _QUERY_JITTER_DEG, n_q) + 180.0) % 360.0 - 180.0
    return BenchData(
        lat, lon, q_lat, q_lon, f"{config.data} ({lat.shape[0]:,} of {all_lat.shape[0]:,} points)"
    )


def query_count(config: BenchConfig) -> int:
    """Query points of a run: ``queries``, or ``n`` for the left side of a join or a count."""
    if config.op in ("knn", "radius", "matrix", "filtered-knn"):
        return config.queries
    if config.op in ("knn-join", "count-within"):
        return config.n
    return 0


def reference_queries(config: BenchConfig, n_points: int, n_queries: int) -> int:
    """How many of the first queries are checked against the float64 reference."""
    wanted = config.ref_queries or max(10, int(REFERENCE_PAIRS // max(1, n_points)))
    return min(n_queries, wanted)


def synchroniser(engine: Any) -> Callable[[], None]:
    """What to call before reading the clock: GPU work is timed to its end, not its launch."""
    if getattr(engine, "device_kind", "cpu") != "gpu":
        return lambda: None
    import cupy  # only for a GPU engine: importing geonear never imports CuPy

    return cupy.cuda.Device().synchronize


def timed(sync: Callable[[], None], call: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``call`` took, ``sync`` called at both ends, and what it returned."""
    sync()
    start = time.perf_counter()
    out = call()
    sync()
    return time.perf_counter() - start, out


class SklearnKMeansBaseline:
    """scikit-learn KMeans on unit vectors from geonear's k-means++ centres (a row, not an engine).

    Euclidean k-means of unit vectors is the usual stand-in for spherical k-means; its
    inertia is re-measured here in great-circle m^2 so that it compares with the engines'.
    """

    name = SKLEARN_KMEANS
    device_kind = "cpu"

    def __init__(self, earth_radius_m: float = EARTH_RADIUS_M) -> None:
        self.earth_radius_m = earth_radius_m

    def build_index(self, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
        return unit_vectors(lat, lon)

    def kmeans(self, xyz: np.ndarray, config: BenchConfig) -> dict[str, Any]:
        from sklearn.cluster import KMeans

        # The same generator and seeding code as spherical_kmeans' first initialisation.
        rng = np.random.default_rng(np.random.SeedSequence(config.seed).spawn(1)[0])
        start = seed_kmeans_plus_plus(xyz, config.k, None, rng, np)
        model = KMeans(
            config.k,
            init=start,
            n_init=1,
            max_iter=config.max_iter,
            tol=config.tol,
            algorithm="lloyd",
        ).fit(xyz)
        centres = model.cluster_centers_ / np.linalg.norm(model.cluster_centers_, axis=1)[:, None]
        angle = angle_between(xyz, centres[model.labels_])
        inertia = float(((self.earth_radius_m * angle) ** 2).sum())
        return {"labels": model.labels_, "inertia_m2": inertia, "n_iter": int(model.n_iter_)}


def _resolve_engine(name: str, config: BenchConfig, extra: Mapping[str, Any]) -> Any:
    """The engine called ``name``, or EngineUnavailable saying why it cannot run."""
    if name in extra:
        return extra[name]
    if name == SKLEARN_KMEANS:
        if config.op != "kmeans":
            raise EngineUnavailable(f"{SKLEARN_KMEANS} is the baseline of --op kmeans only")
        return SklearnKMeansBaseline()
    if name not in engine_names():
        ok, why = gpu_available()
        if name in GPU_ENGINE_NAMES and not ok:
            raise EngineUnavailable(f"needs a GPU: {why}")
        raise EngineUnavailable(f"no engine is registered as {name!r} in this build")
    return create_engine(name)


def _subset_size(name: str, config: BenchConfig, n_points: int, n_queries: int) -> int:
    """Queries (matrix rows) an engine runs: all, or what fits a brute-force pair budget."""
    if name not in BRUTE_PAIRS or config.op not in ("knn", "radius", "matrix"):
        return n_queries
    budget = config.brute_pairs or BRUTE_PAIRS[name]
    return max(1, min(n_queries, int(budget // max(1, n_points))))


def _operation(
    engine: Any, index: Any, config: BenchConfig, data: BenchData, m: int
) -> Callable[[], Any]:
    """The timed call of ``config.op`` over the first ``m`` queries."""
    q_lat, q_lon = data.q_lat[:m], data.q_lon[:m]
    if config.op == "knn":
        return lambda: index.knn(q_lat, q_lon, config.k, config.max_distance_m)
    if config.op == "radius":
        return lambda: index.radius(q_lat, q_lon, config.radius_m)
    if config.op == "matrix":
        return lambda: engine.distance_matrix(q_lat, q_lon, data.lat, data.lon, config.dtype)
    if config.op == "kmeans":
        if isinstance(engine, SklearnKMeansBaseline):
            return lambda: engine.kmeans(index, config)
        return lambda: index.kmeans(
            config.k, seed=config.seed, max_iter=config.max_iter, tol=config.tol
        )
    return lambda: engine.build_index(data.lat, data.lon)


def _work(config: BenchConfig, data: BenchData, m: int, out: Any) -> float:
    """Units of work (see ``WORK_UNITS``) done by one timed call that returned ``out``."""
    if config.op in ("knn", "radius"):
        return float(m)
    if config.op == "matrix":
        return float(m) * data.lat.shape[0]
    if config.op == "kmeans":
        n_iter = out["n_iter"] if isinstance(out, dict) else out.n_iter
        return float(data.lat.shape[0]) * n_iter
    return float(data.lat.shape[0])


def bench_engine(
    name: str, engine: Any, config: BenchConfig, data: BenchData, reference: Any
) -> EngineResult:
    """Build, time and check one engine; ``reference`` is the op's exactness reference."""
    row = EngineResult(engine=name, device=getattr(engine, "device_kind", "cpu"))
    sync = synchroniser(engine)
    n_queries = data.q_lat.shape[0]
    m = _subset_size(name, config, data.lat.shape[0], n_queries)
    if config.op in ("knn", "radius", "matrix"):
        row.queries_run = m
        row.scale = n_queries / m
        if m < n_queries:
            row.notes.append(
                f"timed on {m:,} of {n_queries:,} queries, times scaled x{row.scale:,.0f}"
            )
    warm_up = getattr(engine, "warm_up", None)
    if warm_up is not None:
        row.warm_up_s, _ = timed(sync, warm_up)
    row.build_s, index = timed(sync, lambda: engine.build_index(data.lat, data.lon))
    call = _operation(engine, index, config, data, m)
    # For --op build the first build is the cold call.
    row.cold_s, out = (row.build_s, index) if config.op == "build" else timed(sync, call)
    warm = []
    for _ in range(config.repeat):
        out = None  # let the previous answer go before the next one is made
        seconds, out = timed(sync, call)
        warm.append(seconds)
    row.repeats = len(warm)
    row.throughput = _work(config, data, m, out) / max(statistics.median(warm), 1e-12)
    row.cold_s *= row.scale
    row.warm_min_s = min(warm) * row.scale
    row.warm_median_s = statistics.median(warm) * row.scale
    check = EXACTNESS[config.op]
    row.exactness, row.exact = check(
        out, reference, data=data, config=config, engine=engine, index=index
    )
    return row


def compute_reference(config: BenchConfig, data: BenchData) -> Any:
    """The op's exactness reference (see ``geonear.bench.exactness``); None for build."""
    r = reference_queries(config, data.lat.shape[0], data.q_lat.shape[0])
    if config.op in ("knn", "radius"):
        index = create_engine("numpy-brute").build_index(data.lat, data.lon)
        if config.op == "knn":
            return index.knn(data.q_lat[:r], data.q_lon[:r], config.k, config.max_distance_m)
        return index.radius(data.q_lat[:r], data.q_lon[:r], config.radius_m or DEFAULT_RADIUS_M)
    if config.op == "matrix":
        from geonear.geometry import great_circle_m

        return great_circle_m(
            data.q_lat[:r, None], data.q_lon[:r, None], data.lat[None, :], data.lon[None, :]
        )
    if config.op == "kmeans":
        index = create_engine("cpu").build_index(data.lat, data.lon)
        return index.kmeans(config.k, seed=config.seed, max_iter=config.max_iter, tol=config.tol)
    return None


def _engine_list(config: BenchConfig, extra: Mapping[str, Any]) -> list[str]:
    names = list(dict.fromkeys(config.engines))
    if config.op == "kmeans" and SKLEARN_KMEANS not in names:
        names.append(SKLEARN_KMEANS)  # the baseline of the speed-up against scikit-learn
    names += [name for name in extra if name not in names]
    known = {*engine_names(), *DEFAULT_ENGINES, SKLEARN_KMEANS, *extra}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}"
        )
    return names


def _add_speedups(config: BenchConfig, rows: Sequence[EngineResult]) -> None:
    timed = {r.engine: r.warm_median_s for r in rows if r.status == "ok" and r.warm_median_s}
    sklearn = timed.get(SKLEARN_KMEANS if config.op == "kmeans" else "sklearn")
    cpu = timed.get("cpu")
    for row in rows:
        if row.engine in timed:
            row.speedup_vs_sklearn = sklearn / timed[row.engine] if sklearn else None
            row.speedup_vs_cpu = cpu / timed[row.engine] if cpu else None


def run_benchmark(
    config: BenchConfig,
    extra_engines: Mapping[str, Engine] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``config`` and return the results document (the ``--json`` layout).

    Parameters
    ----------
    config : BenchConfig
        What to run.
    extra_engines : mapping of str to Engine, optional
        Engine instances run under the given names in addition to ``config.engines``
        (a name here overrides a registered engine of the same name).
    progress : callable, optional
        Called with a line of text as each engine starts.

    The analytics ops (``ANALYTICS_OPS``) are run by
    :func:`geonear.bench.analytics.run_analytics`, through servers.
    """
    if config.op in ANALYTICS_OPS:
        if extra_engines:
            raise ValueError(f"--op {config.op} runs registered engines through servers only")
        from geonear.bench.analytics import run_analytics

        return run_analytics(config, progress=progress)
    extra = dict(extra_engines or {})
    names = _engine_list(config, extra)
    data = make_data(config)
    rows: list[EngineResult] = []
    if progress is not None:
        progress(f"{config.op}: the float64 reference")
    reference = compute_reference(config, data)
    for name in names:
        if progress is not None:
            progress(f"{config.op}: {name}")
        try:
            engine = _resolve_engine(name, config, extra)
            row = bench_engine(name, engine, config, data, reference)
        except (EngineUnavailable, NotImplementedError) as exc:
            row = EngineResult(engine=name, status="skipped", reason=str(exc) or type(exc).__name__)
        except Exception as exc:  # one failing engine must not hide the others' results
            row = EngineResult(engine=name, status="error", reason=f"{type(exc).__name__}: {exc}")
        else:
            row.device = describe(engine)
        rows.append(row)
        gc.collect()  # free one engine's index before the next builds its own
    _add_speedups(config, rows)
    return report.results_document(
        config=asdict(config),
        command=config.command(),
        data={
            "description": data.description,
            "n_points": int(data.lat.shape[0]),
            "n_queries": int(data.q_lat.shape[0]),
            "ref_queries": reference_queries(config, data.lat.shape[0], data.q_lat.shape[0]),
        },
        throughput_unit=WORK_UNITS[config.op],
        results=[asdict(r) for r in rows],
    )


def describe(engine: Any) -> str:
    describe_device = getattr(engine, "describe_device", None)
    return describe_device() if describe_device is not None else engine.device_kind


# -- command line -------------------------------------------------------------------------


def _engine_names_arg(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated engine names")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``geonear bench`` on ``parser``.

    Size, data and engine options default to None here, meaning the op's default
    (:func:`op_defaults`), so that an analytics op can differ from the in-process ones.
    """
    d = BenchConfig()
    parser.description = (
        "Run engines side by side in one process on the same data: time, "
        "throughput, speed-up and exactness against the float64 reference. The analytics "
        f"ops ({', '.join(ANALYTICS_OPS)}) run each engine through a server of its own, "
        "beside peers on the same points."
    )
    parser.add_argument("--op", choices=OPS, default=d.op)
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help=f"dataset points, each side of a join or count, matrix columns (default "
        f"{d.n:,}; filtered-knn 1,000,000; within 10,000,000 on a host of "
        f"{WITHIN_10M_MEMORY_GIB:g}+ GiB, else 1,000,000)",
    )
    parser.add_argument(
        "--queries",
        type=int,
        default=None,
        help=f"query points, matrix rows (default {d.queries:,}; filtered-knn 100,000)",
    )
    parser.add_argument(
        "-k",
        type=int,
        default=None,
        help=f"neighbours (knn, filtered-knn, knn-join) or clusters (kmeans) "
        f"(default {d.k}; knn-join 5)",
    )
    parser.add_argument(
        "--radius-m",
        type=float,
        default=None,
        help=f"radius (default {DEFAULT_RADIUS_M:g}), count-within radius (default: about "
        "10 neighbours a point for uniform points), dbscan eps (default: about 20 "
        "neighbours a point)",
    )
    parser.add_argument("--max-distance-m", type=float, default=None, help="knn distance bound")
    parser.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="matrix precision")
    parser.add_argument(
        "--engines",
        type=_engine_names_arg,
        default=None,
        help=f"comma-separated (default {','.join(d.engines)}; {SKLEARN_KMEANS} is added "
        f"for --op kmeans; the analytics ops default to {','.join(SERVED_ENGINES)} and "
        "add their peers)",
    )
    parser.add_argument(
        "--data", choices=DATA_KINDS, default=None, help="default uniform; dbscan clustered"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--repeat", type=int, default=d.repeat, help="warm calls per engine")
    parser.add_argument("--max-iter", type=int, default=d.max_iter, help="k-means iterations")
    parser.add_argument(
        "--tol",
        type=float,
        default=d.tol,
        help="k-means tolerance, radians (0: run every iteration)",
    )
    parser.add_argument(
        "--min-samples",
        type=int,
        default=d.min_samples,
        help="dbscan: points a core point's neighbourhood holds, itself included "
        "(default scikit-learn's, 5)",
    )
    parser.add_argument(
        "--ref-queries",
        type=int,
        default=None,
        help="queries (within: points) checked against the float64 reference (default: auto)",
    )
    parser.add_argument(
        "--brute-pairs",
        type=float,
        default=None,
        help="(query, point) pairs per timed call of a brute-force engine (default: per engine)",
    )
    parser.add_argument(
        "--peer-points",
        type=int,
        default=None,
        help=f"analytics ops: left points (dbscan: points) a slow peer is timed on, "
        f"then scaled (default {PEER_POINTS:,})",
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="knn/radius: each engine in-process and through a server of its own, "
        "with the server's and the client's stages",
    )
    parser.add_argument("--json", metavar="PATH", help="write the results document here")
    parser.add_argument(
        "--markdown",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print a docs/benchmarks.md section, or append it to PATH",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    values = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if hasattr(args, f.name)}
    op = values.pop("op", BenchConfig.op)
    if values.get("engines") is not None:
        values["engines"] = tuple(values["engines"])
    return BenchConfig.for_op(op, **values)


def run(args: argparse.Namespace) -> int:
    """Run ``geonear bench``; 1 if an engine failed with an error, else 0."""
    from rich.console import Console

    config = config_from_args(args)
    if getattr(args, "served", False) and config.op not in ANALYTICS_OPS:
        return _run_served(config)
    markdown_to_stdout = getattr(args, "markdown", None) == "-"
    # The table goes to stderr when stdout carries the markdown, so it can be redirected.
    stream = sys.stderr if markdown_to_stdout else sys.stdout
    # Piped output keeps the whole table instead of cutting it to 80 columns.
    console = Console(stderr=markdown_to_stdout, width=None if stream.isatty() else 200)
    status_console = Console(stderr=True)
    with status_console.status("benchmarking") as status:
        doc = run_benchmark(config, progress=lambda text: status.update(f"benchmarking {text}"))
    doc["argv"] = list(sys.argv)
    report.print_table(doc, console)
    if getattr(args, "json", None):
        report.write_json(doc, args.json)
    if getattr(args, "markdown", None):
        text = report.markdown(doc)
        if markdown_to_stdout:
            sys.stdout.write(text)
        else:
            with open(args.markdown, "a", encoding="utf-8") as out:
                out.write(text)
    return 1 if any(r["status"] == "error" for r in doc["results"]) else 0


def _run_served(config: BenchConfig) -> int:
    from rich.console import Console

    from geonear.bench.served import print_served, run_served

    console = Console(width=None if sys.stdout.isatty() else 120)
    with Console(stderr=True).status("benchmarking") as status:
        doc = run_served(config, progress=lambda text: status.update(f"benchmarking {text} served"))
    print_served(doc, console)
    return 1 if any(r.status == "error" for r in doc["results"]) else 0
