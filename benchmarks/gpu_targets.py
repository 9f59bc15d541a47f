"""Issue-4 target timings of the GPU engine on a CUDA host, in one process.

Measures what ``geonear bench`` does not isolate: the device-only search beside the
end-to-end call, raw ``cKDTree.query(workers=-1)`` without the exact re-rank, index
build against one ``cupy.sort`` of the same number of 64-bit keys, distance matrices
kept on the device, and 100M-point runs. Run on the GPU host:

    python3 benchmarks/gpu_targets.py sweep build knn knnparts matrix kmeans big

``knnonce`` runs one search for a profiler (the command is in docs/benchmarks.md).

Every line printed is one JSON measurement (also appended to $OUT/bench.jsonl).
"""

import json
import os
import sys
import time

import cupy as cp
import numpy as np

from geonear.loaders.synthetic import clustered_points, uniform_points
from geonear.service.engines import create_engine
from geonear.service.engines.gpu import _Queries

OUT = os.environ.get("OUT", "/tmp")
sections = set(sys.argv[1:]) or {"build", "knn", "matrix", "kmeans", "big"}
results = []


def log(**kw):
    results.append(kw)
    print(json.dumps(kw), flush=True)
    with open(os.path.join(OUT, "bench.jsonl"), "a") as f:
        f.write(json.dumps(kw) + "\n")


def sync():
    cp.cuda.Device().synchronize()


def timed(fn, repeat=3):
    ts = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return ts, r


gpu = create_engine("gpu")
t0 = time.perf_counter()
gpu.warm_up()
log(what="warm_up_s", s=time.perf_counter() - t0)
print(gpu.describe_device(), flush=True)
cpu = create_engine("cpu")


def data(kind, n, seed):
    return uniform_points(n, seed) if kind == "uniform" else clustered_points(n, seed=seed)


def knn_case(kind, n, nq):
    """Points and queries of the KNN targets; clustered queries lie near the data, not on it."""
    lat, lon = data(kind, n, 2)
    qlat, qlon = data(kind, nq, 3 if kind == "uniform" else 2)
    if kind == "clustered":
        qlat = np.clip(qlat + 0.001, -90, 90)
    return lat, lon, qlat, qlon


if "sweep" in sections:
    from geonear.service.engines.gpu import GPUEngine

    best = {}
    for kind in ("uniform", "clustered"):
        lat, lon, qlat, qlon = knn_case(kind, 10_000_000, 1_000_000)
        for leaf in (8, 12, 16, 24, 32):
            eng = GPUEngine(leaf_size=leaf)
            index = eng.build_index(lat, lon)
            q = _Queries(qlat, qlon, index)
            tk, _ = timed(lambda: index.knn_device(q, 10, None), 3)
            log(what="sweep_knn_10M_1M_kernel", kind=kind, leaf=leaf, s=min(tk), qps=1e6 / min(tk))
            best[leaf] = best.get(leaf, 0) + min(tk)
            del index
    leaf = min(best, key=best.get)
    log(what="sweep_best_leaf", leaf=leaf)
    gpu = GPUEngine(leaf_size=leaf)

if "build" in sections:
    keys = (cp.random.random(10_000_000) * 2.0**62).astype(cp.uint64)
    ts, _ = timed(lambda: cp.sort(keys), 5)
    log(what="cupy_sort_10M_uint64_s", best=min(ts), all=ts)
    ts, _ = timed(lambda: cp.argsort(keys), 5)
    log(what="cupy_argsort_10M_uint64_s", best=min(ts))
    del keys
    for kind in ("uniform", "clustered"):
        lat, lon = data(kind, 10_000_000, 1)
        ts, idx = timed(lambda: gpu.build_index(lat, lon), 3)
        log(
            what="build_10M_from_host_s",
            kind=kind,
            best=min(ts),
            all=ts,
            device_bytes_per_point=idx.device_bytes / 1e7,
        )
        dl, dn = cp.asarray(lat), cp.asarray(lon)
        ts, idx = timed(lambda: gpu.build_index(dl, dn), 3)
        log(what="build_10M_from_device_s", kind=kind, best=min(ts), all=ts)
        del idx, dl, dn


def compare(g, c):
    same = np.all(g.indices == c.indices, axis=1)
    dd = np.abs(
        np.where(np.isfinite(g.distances_m), g.distances_m, 0)
        - np.where(np.isfinite(c.distances_m), c.distances_m, 0)
    )
    # rows that differ must differ only among ties (< 1 mm)
    bad = 0
    for q in np.flatnonzero(~same):
        if not (
            dd[q].max() < 1e-3
            and set(g.indices[q][:-1]) <= set(c.indices[q]) | set(g.indices[q][:-1])
        ):
            bad += 1
    return float(same.mean()), int(bad), float(dd.max())


if "knn" in sections:
    for n, nq in ((1_000_000, 100_000), (10_000_000, 1_000_000)):
        for kind in ("uniform", "clustered"):
            lat, lon, qlat, qlon = knn_case(kind, n, nq)
            index = gpu.build_index(lat, lon)
            t0 = time.perf_counter()
            first = index.knn(qlat, qlon, 10)
            sync()
            cold = time.perf_counter() - t0
            ts, g = timed(lambda: index.knn(qlat, qlon, 10), 7)
            q = _Queries(qlat, qlon, index)
            tk, _ = timed(lambda: index.knn_device(q, 10, None), 7)
            tq, _ = timed(lambda: _Queries(qlat, qlon, index), 3)
            t0 = time.perf_counter()
            tree = cpu.build_index(lat, lon)
            cpu_build = time.perf_counter() - t0
            t0 = time.perf_counter()
            c = tree.knn(qlat, qlon, 10)
            cpu_s = time.perf_counter() - t0
            # cKDTree alone (no exact re-rank), same workers=-1
            from geonear.geometry import unit_vectors

            qx = unit_vectors(qlat, qlon)
            ckd_all = []
            for _ in range(3):  # best of 3, as the GPU times
                t0 = time.perf_counter()
                tree.tree.query(qx, k=10, workers=-1)
                ckd_all.append(time.perf_counter() - t0)
            ckd_s = min(ckd_all)
            same, bad, dmax = compare(g, c)
            log(
                what="knn_k10",
                kind=kind,
                n=n,
                nq=nq,
                gpu_end_to_end_s=min(ts),
                gpu_end_to_end_all_s=ts,
                gpu_cold_s=cold,
                gpu_kernel_s=min(tk),
                gpu_query_prep_s=min(tq),
                gpu_qps=nq / min(ts),
                gpu_kernel_qps=nq / min(tk),
                cpu_engine_s=cpu_s,
                ckdtree_query_s=ckd_s,
                ckdtree_query_all_s=ckd_all,
                cpu_qps=nq / cpu_s,
                ckdtree_qps=nq / ckd_s,
                speedup_vs_cpu_engine=cpu_s / min(ts),
                speedup_vs_ckdtree_raw=ckd_s / min(ts),
                kernel_speedup_vs_ckdtree_raw=ckd_s / min(tk),
                rows_identical=same,
                rows_bad=bad,
                max_dist_diff_m=dmax,
                cpu_build_s=cpu_build,
            )
            # radius at the median 10th-neighbour distance (about 10 points per query)
            r = float(np.median(g.distances_m[:, -1]))
            ts, gr = timed(lambda: index.radius(qlat, qlon, r), 3)
            tk, _ = timed(lambda: index.radius_device(q, r), 3)
            from geonear.service.engines.cpu import _chord_bound

            t0 = time.perf_counter()
            balls = tree.tree.query_ball_point(
                qx, _chord_bound(r, gpu.earth_radius_m), workers=-1, return_sorted=False
            )
            ckd_r = time.perf_counter() - t0
            ball_counts = np.fromiter((len(b) for b in balls), dtype=np.int64, count=nq)
            del balls
            found = np.diff(gr.offsets)
            if n == 1_000_000:
                t0 = time.perf_counter()
                cr = tree.radius(qlat, qlon, r)
                cpu_r = time.perf_counter() - t0
            else:  # the exact CPU engine on the first 20,000 queries only
                cr, cpu_r = tree.radius(qlat[:20_000], qlon[:20_000], r), float("nan")
                gr = index.radius(qlat[:20_000], qlon[:20_000], r)
            log(
                what="radius",
                kind=kind,
                n=n,
                nq=nq,
                radius_m=r,
                mean_found=float(found.mean()),
                gpu_end_to_end_s=min(ts),
                gpu_kernel_s=min(tk),
                cpu_engine_s=cpu_r,
                ckdtree_ball_s=ckd_r,
                speedup_vs_cpu_engine=cpu_r / min(ts),
                speedup_vs_ckdtree_raw=ckd_r / min(ts),
                kernel_speedup_vs_ckdtree_raw=ckd_r / min(tk),
                counts_equal=bool(np.array_equal(gr.offsets, cr.offsets)),
                counts_equal_raw_ckdtree=bool(np.array_equal(found, ball_counts)),
                ids_equal=bool(np.array_equal(gr.indices, cr.indices)),
                max_dist_diff_m=float(np.abs(gr.distances_m - cr.distances_m).max())
                if gr.indices.size == cr.indices.size
                else -1,
            )
            del tree, index
            if n == 1_000_000 and kind == "uniform":
                bc = create_engine("cupy-broadcast").build_index(lat, lon)
                ts, _ = timed(lambda: bc.knn(qlat[:2000], qlon[:2000], 10), 2)
                log(what="cupy_broadcast_knn", n=n, nq=2000, s=min(ts), qps=2000 / min(ts))

if "knnonce" in sections:  # one 1M / 100k uniform search inside an NVTX range, for ncu
    lat, lon, qlat, qlon = knn_case("uniform", 1_000_000, 100_000)
    index = gpu.build_index(lat, lon)
    q = _Queries(qlat, qlon, index)
    sync()
    cp.cuda.nvtx.RangePush("knn_once")
    index.knn_device(q, 10, None)
    sync()
    cp.cuda.nvtx.RangePop()
    del index

if "knnparts" in sections:  # where the 1M / 100k end-to-end KNN time goes
    import cupyx

    for kind in ("uniform", "clustered"):
        lat, lon, qlat, qlon = knn_case(kind, 1_000_000, 100_000)
        index = gpu.build_index(lat, lon)
        q = _Queries(qlat, qlon, index)
        host = (cupyx.empty_pinned((100_000, 10)), cupyx.empty_pinned((100_000, 10), np.int64))
        on_device = index.knn_device(q, 10, None)
        parts = {
            "end_to_end": lambda: index.knn(qlat, qlon, 10),
            "upload": lambda: (cp.asarray(qlat), cp.asarray(qlon)),
            "upload_and_sort": lambda: _Queries(qlat, qlon, index),
            "search_into_device_arrays": lambda: index.knn_device(q, 10, None),
            "search_into_host_arrays": lambda: index.knn_device(q, 10, None, host),
            "copy_16MB_to_host": lambda: [on_device[i].get(out=host[i]) for i in (0, 1)],
        }
        log(
            what="knn_1M_100k_parts_ms",
            kind=kind,
            **{name: round(min(timed(fn, 15)[0]) * 1e3, 4) for name, fn in parts.items()},
        )
        del index

if "matrix" in sections:
    a = uniform_points(10_000, 5)
    b = uniform_points(100_000, 6)
    for dt in ("float32", "float64"):
        ts, m = timed(lambda: gpu.distance_matrix_device(*a, *b, dtype=dt), 5)
        log(
            what="matrix_10k_x_100k_device",
            dtype=dt,
            best=min(ts),
            gpairs_per_s=1e9 / min(ts) / 1e9,
        )
        del m
    from geonear.geometry import great_circle_m, unit_vectors
    from geonear.service.engines.gpu import _matrix_device

    ref = great_circle_m(a[0][:300, None], a[1][:300, None], b[0][None, :20000], b[1][None, :20000])
    for dt in ("float32", "float64"):
        got = gpu.distance_matrix(a[0][:300], a[1][:300], b[0][:20000], b[1][:20000], dtype=dt)
        log(
            what="matrix_error_m",
            dtype=dt,
            max=float(np.abs(got - ref).max()),
            p99=float(np.percentile(np.abs(got - ref), 99)),
        )
    ua = cp.asarray(unit_vectors(*a))
    ub = cp.asarray(unit_vectors(*b))
    for dt in (cp.float32, cp.float64):
        x, y = ua.astype(dt), ub.astype(dt)
        out = cp.empty((10_000, 100_000), dtype=dt)
        ts, _ = timed(lambda: _matrix_device(x, y, gpu.earth_radius_m, out=out), 5)
        log(what="matrix_kernel_only", dtype=str(dt), best=min(ts), gpairs_per_s=1.0 / min(ts))
        del out

if "kmeans" in sections:
    from sklearn.cluster import KMeans

    from geonear.service.engines.spherical_kmeans import seed_kmeans_plus_plus

    lat, lon = clustered_points(1_000_000, seed=7)
    index = gpu.build_index(lat, lon)
    start = index.seed_kmeans_plus_plus(64, None, np.random.default_rng(0))
    ref_start = seed_kmeans_plus_plus(index.xyz_by_row(), 64, None, np.random.default_rng(0), cp)
    log(what="fused_seeding_equals_shared", same=bool(cp.array_equal(start, ref_start)))
    ts, (cent, it) = timed(lambda: index.lloyd(start, max_iter=20, tol=-1.0), 3)
    log(what="gpu_lloyd_1M_k64_20it", best=min(ts), n_iter=it)
    ts, res = timed(lambda: index.kmeans(64, seed=0, max_iter=20, tol=-1.0), 3)
    log(what="gpu_kmeans_pp_1M_k64_20it_end_to_end", best=min(ts), all=ts, inertia=res.inertia_m2)
    ts, _ = timed(lambda: index.seed_kmeans_plus_plus(64, None, np.random.default_rng(0)), 2)
    log(what="gpu_kmeans_pp_seeding_only", best=min(ts))
    host = create_engine("numpy-brute").build_index(lat, lon)
    t0 = time.perf_counter()
    cres = host.kmeans(64, seed=0, max_iter=20, tol=-1.0)
    cpu_s = time.perf_counter() - t0
    log(
        what="cpu_engine_kmeans_1M_k64_20it",
        s=cpu_s,
        inertia=cres.inertia_m2,
        rel_inertia_diff=abs(cres.inertia_m2 - res.inertia_m2) / cres.inertia_m2,
        sizes_equal=bool(np.array_equal(cres.sizes, res.sizes)),
    )
    xyz = host.xyz
    start_np = cp.asnumpy(start)
    km = KMeans(64, init=start_np, n_init=1, max_iter=20, tol=0.0, algorithm="lloyd")
    t0 = time.perf_counter()
    km.fit(xyz)
    sk_given = time.perf_counter() - t0
    km = KMeans(
        64, init="k-means++", n_init=1, max_iter=20, tol=0.0, algorithm="lloyd", random_state=0
    )
    t0 = time.perf_counter()
    km.fit(xyz)
    sk_pp = time.perf_counter() - t0
    log(
        what="sklearn_kmeans_1M_k64_20it",
        given_centroids_s=sk_given,
        kmeanspp_s=sk_pp,
        speedup_given=sk_given
        / min(timed(lambda: index.lloyd(start, max_iter=20, tol=-1.0), 3)[0]),
        speedup_end_to_end=sk_pp
        / min(timed(lambda: index.kmeans(64, seed=0, max_iter=20, tol=-1.0), 2)[0]),
    )

if "big" in sections:
    rng = np.random.default_rng(0)
    n = 100_000_000
    lat = cp.degrees(cp.arcsin(cp.random.uniform(-1, 1, n)))
    lon = cp.random.uniform(-180, 180, n)
    ts, index = timed(lambda: gpu.build_index(lat, lon), 1)
    log(what="build_100M_from_device_s", s=ts[0], device_bytes_per_point=index.device_bytes / n)
    del lat, lon
    start = index.xyz[cp.asarray(rng.choice(n, 1024, replace=False))]
    ts, (c, it) = timed(lambda: index.lloyd(start, max_iter=3, tol=-1.0), 2)
    log(what="gpu_lloyd_100M_k1024", per_iter_s=min(ts) / 3)
    q = _Queries(
        *[
            cp.asnumpy(a)
            for a in (
                cp.degrees(cp.arcsin(cp.random.uniform(-1, 1, 1_000_000))),
                cp.random.uniform(-180, 180, 1_000_000),
            )
        ],
        index,
    )
    tk, _ = timed(lambda: index.knn_device(q, 10, None), 3)
    log(what="knn_100M_1M_kernel", s=min(tk), qps=1e6 / min(tk))
