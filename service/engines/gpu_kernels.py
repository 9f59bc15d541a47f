"""CUDA source of the GPU engine's kernels, compiled by CuPy (see ``gpu.py``).

Kept apart from the Python so each reads on its own; nothing here imports CuPy.
"""

#: f(t) = 2 asin(sqrt(u) / 2) / sqrt(u) with t = u - 1, for a squared chord u in [0, 2],
#: as powers of t, constant term first: the degree-17 Chebyshev interpolant of f at 68
#: Chebyshev nodes (``numpy.polynomial.chebyshev.chebfit``, then ``cheb2poly``). The
#: angle sqrt(u) f(u - 1) is off by at most 7e-16 rad (4e-9 m) from 2 asin(sqrt(u) / 2)
#: (tests/test_geometry.py); f is smooth there (its nearest singularity is at u = 4), so
#: the powers fall by about 4x a term and Horner's rule is stable.
CHORD_ANGLE_POLYNOMIAL = (
    1.0471975511965979,
    0.05375149359132836,
    0.0077989022389601875,
    0.0015196685395411564,
    0.00034086372375828194,
    8.302317868006869e-05,
    2.1345548972102965e-05,
    5.701778329846175e-06,
    1.5669820850685056e-06,
    4.402160935063219e-07,
    1.257877489390787e-07,
    3.645067775895186e-08,
    1.08022268976715e-08,
    3.2283935609455026e-09,
    8.565057947103093e-10,
    2.426683975007263e-10,
    1.3294039679826282e-10,
    4.408306431581533e-11,
)


def _chord_angle_source(coefficients: tuple[float, ...]) -> str:
    """The CUDA function evaluating CHORD_ANGLE_POLYNOMIAL by Horner's rule."""
    steps = "".join(f"    p = fma(p, t, {c!r});\n" for c in reversed(coefficients[:-1]))
    return (
        "// f(t) of CHORD_ANGLE_POLYNOMIAL (gpu_kernels.py), by Horner's rule.\n"
        "__device__ __forceinline__ double chord_angle_factor(double t) {\n"
        f"    double p = {coefficients[-1]!r};\n{steps}    return p;\n}}\n"
    )


SOURCE = (
    _chord_angle_source(CHORD_ANGLE_POLYNOMIAL)
    + r"""
// CUDA kernels of the GPU engine (compiled by CuPy's RawModule; see gpu.py).
//
// The spatial index: 3-D unit vectors sorted by a Hilbert key (float64, with
// each point's row), cut into leaves of `leaf_size` consecutive points, with an implicit
// tree of FANOUT-ary nodes above the leaves; every node stores the float32 bounding box
// of its points, rounded outwards. Because leaves hold a fixed number of points, not a
// fixed volume, the tree is as deep where points are dense as where they are sparse: the
// density adaptivity that clustered data needs.
//
// Boxes are compared in float32 with a margin far above its rounding, so no true answer
// is pruned; points are decided in float64 and ranked by (squared chord, row), so answers
// equal the float64 reference.

#define FANOUT 8
#define GROUP 8                 // lanes per query; equal to FANOUT
#define GROUPS (128 / GROUP)    // queries per block of 128 threads
#define STACK 72                // 7 entries per level below the top, 8 on the last
#define WRITE_SLOTS 10          // KNN answers staged a round per query (k = 10: one)
#define WINDOW_POINTS 352       // KNN: points of a warp's window (5.5 KB of shared memory)
#define WINDOW_MARGIN 3         // KNN: leaves added to a warp's window at either end
#define WINDOW_CAND 16          // KNN: a query's window points listed for float64
#define INF_F __int_as_float(0x7f800000)
#define INF_D __longlong_as_double(0x7ff0000000000000LL)

// Relative and absolute (chord units) margins of the float32 stage: float32 unit
// vectors are off by <= 1e-7 per component, float32 arithmetic by a few ulps.
#define MARGIN_REL 1e-5
#define MARGIN_ABS 2e-6

__device__ __forceinline__ float box_dist2(float qx, float qy, float qz, float4 lo, float4 hi) {
    float dx = fmaxf(fmaxf(lo.x - qx, qx - hi.x), 0.f);
    float dy = fmaxf(fmaxf(lo.y - qy, qy - hi.y), 0.f);
    float dz = fmaxf(fmaxf(lo.z - qz, qz - hi.z), 0.f);
    return dx * dx + dy * dy + dz * dz;
}

// float32 squared chord between a query and a point (float32 x, y, z).
__device__ __forceinline__ float chord_sq(float qx, float qy, float qz, float4 p) {
    const float dx = qx - p.x, dy = qy - p.y, dz = qz - p.z;
    return dx * dx + dy * dy + dz * dz;
}

// float32 squared-chord threshold that admits every point whose float64 squared chord
// is at most `w`.
__device__ __forceinline__ float prune_threshold(double w) {
    if (!(w < 4.0)) return INF_F;
    double c = sqrt(w) * (1.0 + MARGIN_REL) + MARGIN_ABS;
    return (float)(c * c);
}

// Great-circle metres between unit vectors (the atan2 form, exact at every separation).
// The cross product is rounded product by product (no fused multiply-add), so that a
// point and itself are exactly 0 m apart, as in the float64 reference.
__device__ __forceinline__ double metres(double ax, double ay, double az, double bx,
                                         double by, double bz, double radius) {
    double cx = __dsub_rn(__dmul_rn(ay, bz), __dmul_rn(az, by));
    double cy = __dsub_rn(__dmul_rn(az, bx), __dmul_rn(ax, bz));
    double cz = __dsub_rn(__dmul_rn(ax, by), __dmul_rn(ay, bx));
    double dot = ax * bx + ay * by + az * bz;
    return radius * atan2(sqrt(cx * cx + cy * cy + cz * cz), dot);
}

// The row of the point at position p of the index (kept in the float32 point's w).
__device__ __forceinline__ int row_at(const float4* __restrict__ pts, long long p) {
    return __float_as_int(pts[p].w);
}

// The query searched t-th: the low bits of the t-th sorted word (sort_words), or t
// itself when the queries are searched in the order given (words null).
__device__ __forceinline__ long long query_of(const unsigned long long* __restrict__ words,
                                              unsigned long long mask, long long t) {
    return words != nullptr ? (long long)(words[t] & mask) : t;
}

// ---------------------------------------------------------------------------------
// Index build
// ---------------------------------------------------------------------------------

// The unit vector of a point in degrees: the one formula of every kernel here.
__device__ __forceinline__ void unit_vector(double lat_deg, double lon_deg, double* x,
                                            double* y, double* z) {
    const double to_rad = 3.141592653589793 / 180.0;
    double la = lat_deg * to_rad, lo = lon_deg * to_rad;
    double cl = cos(la);
    *x = cl * cos(lo);
    *y = cl * sin(lo);
    *z = sin(la);
}

// Unit vectors (n, 3) float64 from degrees.
extern "C" __global__ void unit_vectors(const double* __restrict__ lat,
                                        const double* __restrict__ lon, long long n,
                                        double* __restrict__ xyz) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double x, y, z;
    unit_vector(lat[i], lon[i], &x, &y, &z);
    xyz[3 * i] = x;
    xyz[3 * i + 1] = y;
    xyz[3 * i + 2] = z;
}

// Two levels of the 2-D Hilbert curve a step: entry (state << 4 | x bits << 2 | y bits)
// holds the step's 4 index bits above the next state, a state being how the coordinates
// below are transformed: swapped (bit 0) and complemented (bit 1). Built from the
// one-level rule: quadrant (3 a) ^ b of the transformed bits (a, b); where b is 0 the
// curve below is swapped, and also complemented where a is 1.
__device__ unsigned hilbert_entry(int e) {
    int sw = (e >> 4) & 1, fl = e >> 5;
    unsigned q = 0;
    for (int bit = 1; bit >= 0; --bit) {
        const int xb = (e >> (2 + bit)) & 1, yb = (e >> bit) & 1;
        const int a = (sw ? yb : xb) ^ fl, b = (sw ? xb : yb) ^ fl;
        q = (q << 2) | (unsigned)((3 * a) ^ b);
        if (b == 0) {
            sw ^= 1;
            fl ^= a;
        }
    }
    return (q << 2) | (unsigned)(fl << 1) | (unsigned)sw;
}

// The Hilbert key of a unit vector: the cube face it projects onto (0..5) above the
// 2 * level bits of the 2-D Hilbert index of its position on that face, warped by atan
// so that cells are of nearly equal area (with an odd level, the curve is the same one
// transposed). Consecutive keys are neighbours on the sphere, so leaves of consecutive
// points are compact: on 1M uniform points the mean leaf box is 0.63x that of a 3-D
// Morton order and a query's k nearest meet 0.56x as many leaf boxes, which made KNN
// 1.9-2.8x faster on an H200 (docs/benchmarks.md).
// Computed in float32: the key only shapes the leaves, never the answers. float32
// resolves a face to about 2**-23 of its width, finer than the cells wherever they
// matter (18 levels at 10M points); with fewer points the finest levels are coarser
// than their nominal size, which no leaf of 8 notices.
__device__ __forceinline__ unsigned long long hilbert_key(float x, float y, float z,
                                                          int level,
                                                          const unsigned char* table) {
    const float ax = fabsf(x), ay = fabsf(y), az = fabsf(z);
    int face;
    float u, v, m;
    if (ax >= ay && ax >= az) {
        face = x < 0.f;
        m = ax; u = y; v = z;
    } else if (ay >= az) {
        face = 2 + (y < 0.f);
        m = ay; u = z; v = x;
    } else {
        face = 4 + (z < 0.f);
        m = az; u = x; v = y;
    }
    const float warp = 4.f / 3.14159265f;
    u = atanf(u / m) * warp;
    v = atanf(v / m) * warp;
    const float side = (float)(1u << level), top = side - 1.f;
    const unsigned qu = (unsigned)fminf(fmaxf((u + 1.f) * 0.5f * side, 0.f), top);
    const unsigned qv = (unsigned)fminf(fmaxf((v + 1.f) * 0.5f * side, 0.f), top);
    unsigned long long d = 0;
    unsigned state = 0;
    for (int b = level + (level & 1) - 2; b >= 0; b -= 2) {
        const unsigned e = table[(state << 4) | (((qu >> b) & 3u) << 2) | ((qv >> b) & 3u)];
        d = (d << 4) | (e >> 2);
        state = e & 3u;
    }
    return ((unsigned long long)face << (2 * level)) | d;
}

// Sort words of points in degrees: the Hilbert key (3 + 2 * level bits) above the
// point's position i (the low `shift` bits), so that one plain sort of the words orders
// the points and names them (an argsort moves an index beside each key: 1.4x the time).
// Points with the same key keep their row order. With `ll` non-null, the degrees are
// also written side by side, so that the gather in key order reads one 16-byte pair.
extern "C" __global__ void sort_words(const double* __restrict__ lat,
                                      const double* __restrict__ lon, long long n, int level,
                                      int shift, unsigned long long* __restrict__ words,
                                      double2* __restrict__ ll) {
    __shared__ unsigned char table[64];  // blocks have at least 64 threads
    if (threadIdx.x < 64) table[threadIdx.x] = (unsigned char)hilbert_entry(threadIdx.x);
    __syncthreads();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const double la = lat[i], lo = lon[i];
    float sa, ca, so, co;
    sincospif((float)la * (1.f / 180.f), &sa, &ca);
    sincospif((float)lo * (1.f / 180.f), &so, &co);
    const unsigned long long key = hilbert_key(ca * co, ca * so, sa, level, table);
    words[i] = (key << shift) | (unsigned long long)i;
    if (ll != nullptr) ll[i] = make_double2(la, lo);
}

// Queries need only be near key order (the order shapes a search's speed, never its
// answers): their words go to buckets, the index leaf (or group of 2**group leaves)
// their key falls in, in four short launches (a memset and the three kernels below):
// 0.06-0.08 ms from the degrees on an H200 at 25k-250k queries, against 0.11-0.13 ms
// with CuPy's sort, whose cost hardly depends on the size there. Leaves hold equal
// numbers of points, so buckets are as fine where the points are dense as where they
// are sparse (buckets of the keys' top bits made clustered queries search 1.5x as long).
// Within a bucket the order is the atomics'.
#define BUCKET_TILE 1024  // buckets a block of bucket_offsets, one a thread
#define MAX_BUCKET_TILES 256

// Each word's bucket: the last leaf whose first key (with `key_drop` low bits dropped,
// the words' level) is at or below the word's key, shifted right by `group`; counted.
extern "C" __global__ void leaf_buckets(const unsigned long long* __restrict__ words,
                                        long long n, int shift,
                                        const unsigned long long* __restrict__ leaf_keys,
                                        long long n_leaves, int key_drop, int group,
                                        unsigned* __restrict__ bucket,
                                        unsigned* __restrict__ counts) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long key = words[i] >> shift;
    long long first = 0, len = n_leaves;  // the count of leaves at or below lies here
    while (len > 0) {
        const long long half = len >> 1;
        if ((leaf_keys[first + half] >> key_drop) <= key) {
            first += half + 1;
            len -= half + 1;
        } else {
            len = half;
        }
    }
    const unsigned b = (unsigned)(max(first - 1, 0LL) >> group);
    bucket[i] = b;
    atomicAdd(&counts[b], 1u);
}

// The sum of v over the warp's lanes up to this one, this one included (all 32 lanes).
__device__ __forceinline__ unsigned warp_sum_to_lane(unsigned v, int lane) {
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned u = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v += u;
    }
    return v;
}

// Each block: its tile of counts into offsets from the tile's first bucket, in place,
// and the tile's total.
extern "C" __global__ void bucket_offsets(unsigned* __restrict__ counts,
                                          unsigned* __restrict__ tile_totals) {
    __shared__ unsigned warp_sums[32];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const long long b = (long long)blockIdx.x * BUCKET_TILE + tid;
    const unsigned c = counts[b];
    const unsigned s = warp_sum_to_lane(c, lane);
    if (lane == 31) warp_sums[w] = s;
    __syncthreads();
    if (w == 0) warp_sums[lane] = warp_sum_to_lane(warp_sums[lane], lane);
    __syncthreads();
    counts[b] = s - c + (w > 0 ? warp_sums[w - 1] : 0u);
    if (tid == BUCKET_TILE - 1) tile_totals[blockIdx.x] = warp_sums[31];
}

// Each word to its place: its tile's first place (the totals of the tiles before, summed
// by each block) plus its bucket's next free offset (`next`, from bucket_offsets).
extern "C" __global__ void bucket_place(const unsigned long long* __restrict__ words,
                                        const unsigned* __restrict__ bucket, long long n,
                                        unsigned* __restrict__ next,
                                        const unsigned* __restrict__ tile_totals,
                                        int n_tiles, unsigned long long* __restrict__ out) {
    __shared__ unsigned tile_start[MAX_BUCKET_TILES];
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        unsigned carry = 0;
        for (int a = 0; a < n_tiles; a += 32) {
            const int j = a + lane;
            const unsigned c = j < n_tiles ? tile_totals[j] : 0u;
            const unsigned s = warp_sum_to_lane(c, lane);
            if (j < n_tiles) tile_start[j] = carry + s - c;
            carry += __shfl_sync(0xffffffffu, s, 31);
        }
    }
    __syncthreads();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned b = bucket[i];
    out[tile_start[b / BUCKET_TILE] + atomicAdd(&next[b], 1u)] = words[i];
}

// Points in key order (the sorted words of sort_words): float64 unit vectors, the same
// in float32 with the row as int bits (x, y, z, row), and their rows, from the degrees
// side by side (`ll`: one 16-byte load a point, 0.37 ms at 10M points on an H200, against
// 0.59 from separate lat and lon arrays). With leaves of 8 (lo non-null), each aligned
// group of 8 lanes holds one leaf and also writes its box and first key (see
// leaf_boxes). Each row's position is written apart, when first needed (rank_of):
// scattered stores in this kernel doubled its time.
extern "C" __global__ void pack_points(const double2* __restrict__ ll,
                                       const unsigned long long* __restrict__ words,
                                       unsigned long long row_mask, long long n,
                                       double* __restrict__ sxyz, float4* __restrict__ pts,
                                       int* __restrict__ rows, float4* __restrict__ lo,
                                       float4* __restrict__ hi,
                                       unsigned long long* __restrict__ leaf_keys) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = i < n;
    double x = 0.0, y = 0.0, z = 0.0;
    if (live) {
        const long long r = (long long)(words[i] & row_mask);
        const double2 d = ll[r];
        unit_vector(d.x, d.y, &x, &y, &z);
        sxyz[3 * i] = x;
        sxyz[3 * i + 1] = y;
        sxyz[3 * i + 2] = z;
        pts[i] = make_float4((float)x, (float)y, (float)z, __int_as_float((int)r));
        rows[i] = (int)r;
    }
    if (lo == nullptr) return;
    // Whole warps run this (blocks are multiples of 32 threads); lanes past n are empty.
    float4 a = live ? make_float4(__double2float_rd(x), __double2float_rd(y),
                                  __double2float_rd(z), 0.f)
                    : make_float4(INF_F, INF_F, INF_F, 0.f);
    float4 b = live ? make_float4(__double2float_ru(x), __double2float_ru(y),
                                  __double2float_ru(z), 0.f)
                    : make_float4(-INF_F, -INF_F, -INF_F, 0.f);
    for (int s = 1; s < 8; s <<= 1) {
        a.x = fminf(a.x, __shfl_xor_sync(0xffffffffu, a.x, s));
        a.y = fminf(a.y, __shfl_xor_sync(0xffffffffu, a.y, s));
        a.z = fminf(a.z, __shfl_xor_sync(0xffffffffu, a.z, s));
        b.x = fmaxf(b.x, __shfl_xor_sync(0xffffffffu, b.x, s));
        b.y = fmaxf(b.y, __shfl_xor_sync(0xffffffffu, b.y, s));
        b.z = fmaxf(b.z, __shfl_xor_sync(0xffffffffu, b.z, s));
    }
    if (live && (i & 7) == 0) {
        lo[i >> 3] = a;
        hi[i >> 3] = b;
        leaf_keys[i >> 3] = words[i] >> __popcll(row_mask);
    }
}

// Each row's position in key order: the inverse of rows (computed when first needed).
extern "C" __global__ void rank_of(const int* __restrict__ rows, long long n,
                                   int* __restrict__ rank) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) rank[rows[i]] = (int)i;
}

// Boxes of the leaves: leaf j holds points [j * leaf_size, min(n, (j + 1) * leaf_size)).
// The float32 box is rounded outwards, so it contains its float64 points. Also each
// leaf's first key: the key bits of its first sorted word (above the row's `shift` bits).
extern "C" __global__ void leaf_boxes(const double* __restrict__ sxyz,
                                      const unsigned long long* __restrict__ words, int shift,
                                      long long n, int leaf_size, long long n_leaves,
                                      float4* __restrict__ lo, float4* __restrict__ hi,
                                      unsigned long long* __restrict__ leaf_keys) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n_leaves) return;
    long long s = j * leaf_size, e = min(n, s + leaf_size);
    leaf_keys[j] = words[s] >> shift;
    float4 a = make_float4(INF_F, INF_F, INF_F, 0.f), b = make_float4(-INF_F, -INF_F, -INF_F, 0.f);
    for (long long i = s; i < e; ++i) {
        double x = sxyz[3 * i], y = sxyz[3 * i + 1], z = sxyz[3 * i + 2];
        a.x = fminf(a.x, __double2float_rd(x));
        a.y = fminf(a.y, __double2float_rd(y));
        a.z = fminf(a.z, __double2float_rd(z));
        b.x = fmaxf(b.x, __double2float_ru(x));
        b.y = fmaxf(b.y, __double2float_ru(y));
        b.z = fmaxf(b.z, __double2float_ru(z));
    }
    lo[j] = a;
    hi[j] = b;
}

// Boxes of one node from its children [j * FANOUT, min(n_children, (j + 1) * FANOUT)).
__device__ __forceinline__ void node_box(const float4* child_lo, const float4* child_hi,
                                         long long n_children, long long j, float4* lo,
                                         float4* hi) {
    long long s = j * FANOUT, e = min(n_children, s + FANOUT);
    float4 a = child_lo[s], b = child_hi[s];
    for (long long c = s + 1; c < e; ++c) {
        float4 l = child_lo[c], h = child_hi[c];
        a.x = fminf(a.x, l.x); a.y = fminf(a.y, l.y); a.z = fminf(a.z, l.z);
        b.x = fmaxf(b.x, h.x); b.y = fmaxf(b.y, h.y); b.z = fmaxf(b.z, h.z);
    }
    lo[j] = a;
    hi[j] = b;
}

// Boxes of one level from the level below.
extern "C" __global__ void node_boxes(const float4* __restrict__ child_lo,
                                      const float4* __restrict__ child_hi, long long n_children,
                                      long long n_nodes, float4* __restrict__ lo,
                                      float4* __restrict__ hi) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n_nodes) node_box(child_lo, child_hi, n_children, j, lo, hi);
}

// Boxes of levels first..top (each small), one after another in a single block: one
// launch instead of one a level, whose cost on the host exceeded the work. Plain loads
// (not the read-only path), since each level reads what the block wrote just before.
extern "C" __global__ void top_boxes(float4* lo, float4* hi,
                                     const long long* __restrict__ level_start,
                                     const long long* __restrict__ level_count, int first,
                                     int top) {
    for (int level = first; level <= top; ++level) {
        const long long below = level_start[level - 1], here = level_start[level];
        const long long n_children = level_count[level - 1], n_nodes = level_count[level];
        for (long long j = threadIdx.x; j < n_nodes; j += blockDim.x) {
            node_box(lo + below, hi + below, n_children, j, lo + here, hi + here);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------
// Radius search runs one query per GROUP of 8 lanes of a warp: the lanes test the 8
// children of a node, or the 8 points of a leaf, at once (coalesced loads), so a query
// takes one step per node instead of eight, and a warp's divergence spans 4 queries, not
// 32 (on clustered data 1.3x faster than a thread per query, measured on an H200). Every
// lane of a group holds the same traversal state, so every branch is uniform within the
// group; the lanes differ only in the child or point each one tests. The stack lives in
// shared memory, written by the lanes that push and read by all of them.
// ---------------------------------------------------------------------------------
struct GroupStack {
    int node[GROUPS][STACK];
    float dist[GROUPS][STACK];
    unsigned char level[GROUPS][STACK];
};

__device__ __forceinline__ unsigned group_mask() { return 0xffu << (threadIdx.x & 24); }

// The lanes of the group for which `pred` holds, as bits 0..GROUP-1.
__device__ __forceinline__ unsigned group_ballot(unsigned mask, bool pred) {
    return (__ballot_sync(mask, pred) >> (threadIdx.x & 24)) & 0xffu;
}

// Push the children of `node` (at level `level` > 0) whose boxes lie within `thr`, the
// nearest on top; returns the new stack size. Each lane tests one child.
__device__ __forceinline__ int push_children(
    GroupStack& st, int g, int sp, int lane, unsigned mask, int node, int level, float thr,
    float fx, float fy, float fz, const float4* __restrict__ lo,
    const float4* __restrict__ hi, const long long* __restrict__ level_start,
    const long long* __restrict__ level_count) {
    const int cl = level - 1;
    const long long c = (long long)node * FANOUT + lane;
    const bool exists = c < level_count[cl];
    const long long b = level_start[cl] + c;
    const float cd = exists ? box_dist2(fx, fy, fz, lo[b], hi[b]) : INF_F;
    const bool push = exists && cd <= thr;
    const int n_push = __popc(group_ballot(mask, push));
    // Rank by (distance, lane): the pushed children hold ranks 0..n_push-1.
    int rank = 0;
#pragma unroll
    for (int j = 0; j < GROUP; ++j) {
        float o = __shfl_sync(mask, cd, j, GROUP);
        rank += (o < cd || (o == cd && j < lane)) ? 1 : 0;
    }
    if (push) {
        const int slot = sp + n_push - 1 - rank;
        st.node[g][slot] = (int)c;
        st.dist[g][slot] = cd;
        st.level[g][slot] = (unsigned char)cl;
    }
    __syncwarp(mask);
    return sp + n_push;
}

// KNN: one thread per query (measured faster here than a group per query: the k best
// must be kept per query, and a group's lanes all wait on each insertion), the k best
// kept sorted in registers, depth-first traversal nearest child first. Leaf points are
// tested in float32 first (`pts`: x, y, z, row as int bits) and a point that passes is
// measured in float64 from the sorted points next to it. The k best are kept by row
// (keeping positions instead, with rows read on exact ties, was 10% slower on an H200).
// Slots [0, K - k) hold -inf sentinels, so the worst of the k best is always bd[K - 1].
#define CSWAP(a, b)                                                  \
    if (cd[b] < cd[a]) {                                             \
        float td = cd[a]; cd[a] = cd[b]; cd[b] = td;                 \
        int tn = cn[a]; cn[a] = cn[b]; cn[b] = tn;                   \
    }

// Sort 8 children by box distance (with their numbers): a 19-comparator network.
__device__ __forceinline__ void sort8(float* cd, int* cn) {
    CSWAP(0, 1) CSWAP(2, 3) CSWAP(4, 5) CSWAP(6, 7)
    CSWAP(0, 2) CSWAP(1, 3) CSWAP(4, 6) CSWAP(5, 7)
    CSWAP(1, 2) CSWAP(5, 6) CSWAP(0, 4) CSWAP(3, 7)
    CSWAP(1, 5) CSWAP(2, 6) CSWAP(1, 4) CSWAP(3, 6)
    CSWAP(2, 4) CSWAP(3, 5) CSWAP(3, 4)
}

// KNN's stack holds at most one batch of children a level, sorted nearest on top: a
// level's children are pushed when a node of the level above is searched, and by then
// every entry above that node is used up. So when the top entry of a batch lies beyond
// the bound, the rest of its batch does too and is dropped at once (each level's batch
// start kept a byte a level in `bases`). An entry is one 64-bit word: the box distance
// rounded down to its 28 high bits (so never pruned too early), the level, the node.
__device__ __forceinline__ unsigned long long stack_entry(float d, int level, int node) {
    return ((unsigned long long)(__float_as_uint(d) >> 4) << 36) |
           ((unsigned long long)level << 32) | (unsigned)node;
}

__device__ __forceinline__ float entry_dist(unsigned long long e) {
    return __uint_as_float((unsigned)(e >> 36) << 4);
}

__device__ __forceinline__ int batch_base(const unsigned long long* bases, int level) {
    const unsigned long long w = level < 8 ? bases[0] : bases[1];
    return (int)((w >> (8 * (level & 7))) & 0xffULL);
}

__device__ __forceinline__ void set_batch_base(unsigned long long* bases, int level, int sp) {
    const int s = 8 * (level & 7);
    const unsigned long long keep = ~(0xffULL << s), put = (unsigned long long)sp << s;
    if (level < 8) {
        bases[0] = (bases[0] & keep) | put;
    } else {
        bases[1] = (bases[1] & keep) | put;
    }
}

// Offer the point at position i (float32 copy p, through the float32 test already) to a
// query's k best: measured in float64 from the sorted points next to it and inserted if
// it ranks among them by (squared chord, row); `thr` follows the k-th.
template <int K, bool TIES>
__device__ __forceinline__ void offer(const float4 p, long long i, const float4* __restrict__ pts,
                                      const double* __restrict__ sxyz, double qx, double qy,
                                      double qz, double bound_sq, bool has_max, double max_m,
                                      double radius, double* bd, int* bi, bool& tied,
                                      float& thr) {
    const double px = sxyz[3 * i], py = sxyz[3 * i + 1], pz = sxyz[3 * i + 2];
    const double ex = qx - px, ey = qy - py, ez = qz - pz;
    const double e2 = ex * ex + ey * ey + ez * ez;
    if (e2 > bd[K - 1] || e2 > bound_sq) return;
    // Compared with every slot at once (no chain of comparisons): 1.1x faster on an
    // H200. lt is false below the insertion point and true from it on.
    bool lt[K];
#pragma unroll
    for (int j = 0; j < K; ++j) lt[j] = e2 < bd[j];
    if (TIES) {
        bool tie = false;
#pragma unroll
        for (int j = 0; j < K; ++j) tie |= e2 == bd[j];
        if (tie) {
            const int row = __float_as_int(p.w);
#pragma unroll
            for (int j = 0; j < K; ++j) {
                if (e2 == bd[j]) lt[j] = row < row_at(pts, bi[j]);
            }
        }
    }
    if (!lt[K - 1]) {
        tied |= !TIES && e2 == bd[K - 1];
        return;
    }
    if (has_max && metres(qx, qy, qz, px, py, pz, radius) > max_m) return;
    const double last = bd[K - 1];
    const int pos = (int)i;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
        if (lt[j]) {
            bd[j] = lt[j - 1] ? bd[j - 1] : e2;
            bi[j] = lt[j - 1] ? bi[j - 1] : pos;
        }
    }
    if (lt[0]) {
        bd[0] = e2;
        bi[0] = pos;
    }
    tied |= !TIES && bd[K - 1] == last && last < INF_D;
    thr = prune_threshold(fmin(bd[K - 1], bound_sq));
}

// The float64 squared chord that bounds every point whose float32 squared chord is `d`
// (the inverse of prune_threshold, with the same margins).
__device__ __forceinline__ double chord_sq_above(float d) {
    if (!(d < INF_F)) return INF_D;
    const double c = sqrt((double)d) * (1.0 + MARGIN_REL) + MARGIN_ABS;
    return c * c;
}

// Position i of a window of n points scanned from a start within it (i < 2 n).
__device__ __forceinline__ int wrapped(int i, int n) { return i < n ? i : i - n; }

// The float32 squared chord of a query's k-th nearest among the n points of `win`,
// scanned from `start` on (wrapping round), about the query's own place, so that the
// bound tightens at once.
template <int K>
__device__ __forceinline__ float kth_nearest(const float4* win, int n, int start, float fx,
                                             float fy, float fz, int k) {
    float fk[K];  // the k nearest, sorted, after K - k sentinels
#pragma unroll
    for (int j = 0; j < K; ++j) fk[j] = j < K - k ? -INF_F : INF_F;
    for (int j = 0; j < n; ++j) {
        const float d2 = chord_sq(fx, fy, fz, win[wrapped(start + j, n)]);
        if (!(d2 < fk[K - 1])) continue;
        bool lt[K];
#pragma unroll
        for (int s = 0; s < K; ++s) lt[s] = d2 < fk[s];
#pragma unroll
        for (int s = K - 1; s > 0; --s) {
            if (lt[s]) fk[s] = lt[s - 1] ? fk[s - 1] : d2;
        }
        if (lt[0]) fk[0] = d2;
    }
    return fk[K - 1];
}

// Whether node `node` of level `level` holds only leaves of the window [wa, wb].
__device__ __forceinline__ bool in_window(long long node, int level, long long wa,
                                          long long wb, long long n_leaves) {
    const int sh = 3 * level;  // FANOUT = 8 children a node
    return (node << sh) >= wa && min(((node + 1) << sh) - 1, n_leaves - 1) <= wb;
}

// KNN, one thread a query. Slots hold positions and rank by (squared chord, row). The
// fast pass (TIES false) ranks equal squared chords by when they were found, and notes
// every query where that could matter (a point equal to the last slot turned away or
// pushed out, or two equal slots at the end) in `ties`; the exact pass (TIES true) then
// searches those queries again, reading rows to break the ties. Ties are rare outside
// duplicated points; with the row reads in its insertion, one pass took 1.1-1.2x as long
// as the fast pass on an H200 (more spills). The exact pass is launched over all queries
// and stops at once past the count of tied ones.
//
// With WINDOW (fast pass, queries in key order), each warp first takes the leaves
// between its first and last query's keys (`leaf_keys`: each leaf's first key, compared
// with `key_drop` low bits dropped, the queries' level), WINDOW_MARGIN more at either
// end, at most WINDOW_POINTS points, into shared memory. There each query finds its k
// nearest in float32, which bounds its k-th in float64, then measures in float64 the
// window's points within that bound; the tree search then starts from that bound and
// skips every subtree of window leaves. Where the window holds the k nearest, the
// search visits only the few nodes that meet the bound. (Queries are only nearly in key
// order, by the leaf their key falls in, which the margin leaves absorb; any window
// gives the same answers.)
// Six blocks of 128 threads per multiprocessor for k <= 10 (at most 80 registers:
// 15% faster than the compiler's choice at k = 10 on an H200).
template <int K, bool TIES, bool WINDOW>
__global__ void __launch_bounds__(128, K <= 10 ? 6 : 1)
knn(const float4* __restrict__ pts, const double* __restrict__ sxyz,
    const float4* __restrict__ lo,
    const float4* __restrict__ hi, const long long* __restrict__ level_start,
    const long long* __restrict__ level_count, int top_level, int leaf_size,
    long long n_points, const double* __restrict__ q_lat, const double* __restrict__ q_lon,
    const unsigned long long* __restrict__ q_words, unsigned long long q_mask,
    long long n_queries, const unsigned long long* __restrict__ leaf_keys, int key_drop,
    int k, double bound_sq,
    double max_m, double radius, long long* __restrict__ out_idx,
    double* __restrict__ out_dist, long long* __restrict__ ties,
    unsigned long long* __restrict__ n_ties) {
    // A warp's slice: its window and candidate lists, then the staging of its answers
    // (see the end).
    constexpr int STAGE = (32 * WRITE_SLOTS * 16 + 32 * 8) / 16;  // float4s
    constexpr int LISTED = WINDOW_POINTS + WINDOW_CAND * 32 * 2 / 16;
    constexpr int SLICE = WINDOW && LISTED > STAGE ? LISTED : STAGE;
    __shared__ float4 slices[4][SLICE];
    const int tid = threadIdx.x, lane = tid & 31;
    float4* slice = slices[tid >> 5];
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool searching = TIES ? t < (long long)*n_ties : t < n_queries;
    const unsigned live = __ballot_sync(0xffffffffu, searching);  // a prefix of the warp
    const long long n_leaves = level_count[0];
    long long wa = 0, wb = -1, pa = 0;  // the window's leaves [wa, wb], from point pa
    int wn = 0;                          // and its number of points
    if (WINDOW && live != 0u && q_words != nullptr) {  // the whole warp, before any leaves
        // The leaves holding the places of the warp's first and last query (keys at or
        // below theirs, less one): lanes 0-15 search for one, 16-31 for the other, 16
        // leaf keys a step (a 17-ary search: 5 steps over 125k leaves, not 17).
        const int half = lane >> 4, probe = lane & 15;
        const long long tq = half == 0 ? t - lane : min(t - lane + 31, n_queries - 1);
        const unsigned long long key = q_words[tq] >> __popcll(q_mask);
        long long first = 0, len = n_leaves;  // the count lies in [first, first + len]
        while (__any_sync(0xffffffffu, len > 0)) {
            const long long stride = (len + 16) / 17, j = first + (probe + 1) * stride - 1;
            const bool at_or_below =
                len > 0 && j < first + len && (leaf_keys[j] >> key_drop) <= key;
            const unsigned below = __ballot_sync(0xffffffffu, at_or_below) >> (16 * half);
            const long long c = __popc(below & 0xffffu);
            if (len > 0) {
                const long long next = first + c * stride;
                const long long last = c == 16 ? first + len : first + (c + 1) * stride - 1;
                len = min(first + len, last) - next;
                first = next;
            }
        }
        const long long r0 = __shfl_sync(0xffffffffu, first, 0) - 1;
        const long long r1 = __shfl_sync(0xffffffffu, first, 16) - 1;
        const long long cap = WINDOW_POINTS / leaf_size;
        wa = max(0LL, r0 - WINDOW_MARGIN);
        wb = min(n_leaves - 1, r1 + WINDOW_MARGIN);
        if (wb - wa + 1 > cap) {  // queries sparser than the points: the middle leaves
            wa = max(0LL, (r0 + r1) / 2 - cap / 2);
            wb = min(n_leaves - 1, wa + cap - 1);
        }
        pa = wa * leaf_size;
        wn = wb < wa ? 0 : (int)(min(n_points, (wb + 1) * leaf_size) - pa);
        for (int j = lane; j < wn; j += 32) slice[j] = pts[pa + j];
        __syncwarp();
    }
    if (!searching) return;
    const long long qi = TIES ? ties[t] : query_of(q_words, q_mask, t);
    bool tied = false;  // the fast pass: this query needs the exact one
    double qx, qy, qz;
    unit_vector(q_lat[qi], q_lon[qi], &qx, &qy, &qz);
    const float fx = (float)qx, fy = (float)qy, fz = (float)qz;
    const bool has_max = max_m >= 0.0;

    // The window's k-th nearest in float32, before the k best take their registers.
    const int start = (wn * lane) >> 5;  // about the query's own place in the window
    const float window_kth = WINDOW && wn > 0 ? kth_nearest<K>(slice, wn, start, fx, fy, fz, k)
                                              : INF_F;
    double bd[K];
    int bi[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        bool pad = j < K - k;
        bd[j] = pad ? -INF_D : INF_D;
        bi[j] = pad ? -2 : -1;
    }
    float thr = prune_threshold(fmin(bd[K - 1], bound_sq));

    if (WINDOW && wn > 0) {
        // The window's points within the bound its k-th sets, measured in float64: listed
        // first, then measured in step across the warp, so that the lanes wait on their
        // float64 loads together, not one lane after another (measured one by one in the
        // scan they took 46% of the kernel's time on an H200). Past WINDOW_CAND listed,
        // the rest of the window is measured as it is scanned.
        thr = prune_threshold(fmin(chord_sq_above(window_kth), bound_sq));
        unsigned short* listed = reinterpret_cast<unsigned short*>(slice + WINDOW_POINTS) + lane;
        int j = 0, n_listed = 0;
        for (; j < wn && n_listed < WINDOW_CAND; ++j) {
            const int w = wrapped(start + j, wn);
            if (chord_sq(fx, fy, fz, slice[w]) <= thr) listed[32 * n_listed++] = (unsigned short)w;
        }
        for (int c = 0; c < n_listed; ++c) {
            const int w = listed[32 * c];
            offer<K, TIES>(slice[w], pa + w, pts, sxyz, qx, qy, qz, bound_sq, has_max, max_m,
                           radius, bd, bi, tied, thr);
        }
        for (; j < wn; ++j) {
            const int w = wrapped(start + j, wn);
            const float4 p = slice[w];
            if (chord_sq(fx, fy, fz, p) > thr) continue;
            offer<K, TIES>(p, pa + w, pts, sxyz, qx, qy, qz, bound_sq, has_max, max_m, radius,
                           bd, bi, tied, thr);
        }
    }

    unsigned long long st[STACK];
    unsigned long long bases[2] = {0ULL, 0ULL};
    st[0] = stack_entry(0.f, top_level, 0);
    int sp = WINDOW && wn > 0 && in_window(0, top_level, wa, wb, n_leaves) ? 0 : 1;
    while (sp > 0) {
        const unsigned long long entry = st[--sp];
        const int level = (int)(entry >> 32) & 15;
        if (entry_dist(entry) > thr) {
            sp = batch_base(bases, level);  // the rest of the batch is farther still
            continue;
        }
        const long long node = (unsigned)entry;
        if (level == 0) {
            const long long s = node * leaf_size, e = min(n_points, s + leaf_size);
            // Unrolled by 4: 1-4% faster on an H200 (by 8, or no unrolling: slower).
#pragma unroll 4
            for (long long i = s; i < e; ++i) {
                const float4 p = pts[i];
                if (chord_sq(fx, fy, fz, p) > thr) continue;
                offer<K, TIES>(p, i, pts, sxyz, qx, qy, qz, bound_sq, has_max, max_m, radius,
                               bd, bi, tied, thr);
            }
        } else {
            const int cl = level - 1;
            const long long base = level_start[cl], count = level_count[cl];
            const long long c0 = node * FANOUT;
            float cd[FANOUT];
            int cn[FANOUT];
#pragma unroll
            for (int j = 0; j < FANOUT; ++j) {
                const long long c = c0 + j;
                cd[j] = c < count ? box_dist2(fx, fy, fz, lo[base + c], hi[base + c]) : INF_F;
                cn[j] = (int)c;
            }
            sort8(cd, cn);
            set_batch_base(bases, cl, sp);
            // Farthest first onto the stack, so the nearest child is searched next.
#pragma unroll
            for (int j = FANOUT - 1; j >= 0; --j) {
                if (cd[j] <= thr && cd[j] < INF_F &&
                    !(WINDOW && wn > 0 && in_window(cn[j], cl, wa, wb, n_leaves))) {
                    st[sp++] = stack_entry(cd[j], cl, cn[j]);
                }
            }
        }
    }
    if (!TIES) {
#pragma unroll
        for (int j = 1; j < K; ++j) tied |= bd[j] == bd[j - 1] && bd[j] > -INF_D && bd[j] < INF_D;
        if (tied) ties[atomicAdd(n_ties, 1ULL)] = qi;
    }
    // The answers leave through the warp's slice of shared memory, WRITE_SLOTS slots a
    // round, so that the warp writes each query's slots as one run of consecutive words:
    // coalesced, and few enough transfers that `knn` points out_idx and out_dist straight
    // at page-locked host memory, written while slower warps still search (1M points,
    // 100k queries on an H200: 1.42 -> 1.18 ms end to end, no copy after the search).
    double* w_dist = reinterpret_cast<double*>(slice);
    long long* w_idx = reinterpret_cast<long long*>(w_dist + 32 * WRITE_SLOTS);
    long long* w_query = w_idx + 32 * WRITE_SLOTS;
    const int lanes = __popc(live);
    __syncwarp(live);  // the window is read no more
    w_query[lane] = qi;
    for (int c = 0; c < k; c += WRITE_SLOTS) {
        const int m = min(WRITE_SLOTS, k - c);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const int s = j - (K - k) - c;
            if (s >= 0 && s < m) {
                const long long p = bi[j];
                const int o = lane * WRITE_SLOTS + s;
                if (p >= 0) {
                    w_idx[o] = row_at(pts, p);
                    w_dist[o] = metres(qx, qy, qz, sxyz[3 * p], sxyz[3 * p + 1],
                                       sxyz[3 * p + 2], radius);
                } else {
                    w_idx[o] = -1;
                    w_dist[o] = INF_D;
                }
            }
        }
        __syncwarp(live);
        for (int w = lane; w < lanes * m; w += lanes) {
            const int q = w / m, s = w % m;
            const long long o = w_query[q] * k + c + s;
            out_dist[o] = w_dist[q * WRITE_SLOTS + s];
            out_idx[o] = w_idx[q * WRITE_SLOTS + s];
        }
        __syncwarp(live);
    }
}

// Radius: the same traversal with a fixed threshold. Pass 1 (out_idx == nullptr)
// counts, pass 2 writes each query's rows and metres at offsets[query] and sorts
// segments of at most sort_limit entries by (metres, row) in place.
extern "C" __global__ void radius_search(
    const double* __restrict__ sxyz, const int* __restrict__ rows,
    const float4* __restrict__ lo, const float4* __restrict__ hi,
    const long long* __restrict__ level_start, const long long* __restrict__ level_count,
    int top_level, int leaf_size, long long n_points, const double* __restrict__ q_lat,
    const double* __restrict__ q_lon, const unsigned long long* __restrict__ q_words,
    unsigned long long q_mask, long long n_queries, float thr, double inner_sq,
    double outer_sq, double radius_m, double radius, long long* __restrict__ counts,
    const long long* __restrict__ offsets, long long* __restrict__ out_idx,
    double* __restrict__ out_dist, int sort_limit) {
    __shared__ GroupStack st;
    const int lane = threadIdx.x & (GROUP - 1), g = threadIdx.x / GROUP;
    const long long t = (long long)blockIdx.x * GROUPS + g;
    if (t >= n_queries) return;  // the whole group
    const unsigned mask = group_mask();
    const long long qi = query_of(q_words, q_mask, t);
    double qx, qy, qz;
    unit_vector(q_lat[qi], q_lon[qi], &qx, &qy, &qz);
    const float fx = (float)qx, fy = (float)qy, fz = (float)qz;
    const bool write = out_idx != nullptr;
    const long long first = write ? offsets[qi] : 0;
    long long found = 0;

    if (lane == 0) {
        st.node[g][0] = 0;
        st.dist[g][0] = 0.f;
        st.level[g][0] = (unsigned char)top_level;
    }
    __syncwarp(mask);
    int sp = 1;
    while (sp > 0) {
        --sp;
        const int node = st.node[g][sp];
        const int level = st.level[g][sp];
        __syncwarp(mask);
        if (level > 0) {
            sp = push_children(st, g, sp, lane, mask, node, level, thr, fx, fy, fz, lo, hi,
                               level_start, level_count);
            continue;
        }
        const long long s = (long long)node * leaf_size, e = min(n_points, s + leaf_size);
        for (long long i0 = s; i0 < e; i0 += GROUP) {
            const long long i = i0 + lane;
            bool inside = false;
            double m = 0.0;
            if (i < e) {
                const double px = sxyz[3 * i], py = sxyz[3 * i + 1], pz = sxyz[3 * i + 2];
                const double ex = qx - px, ey = qy - py, ez = qz - pz;
                const double e2 = ex * ex + ey * ey + ez * ez;
                // Clear cases by the chord alone; the band between needs the metres,
                // computed the same way in both passes so they agree.
                if (e2 <= outer_sq) {
                    if (write || e2 >= inner_sq) {
                        m = metres(qx, qy, qz, px, py, pz, radius);
                        inside = e2 < inner_sq || m <= radius_m;
                    } else {
                        inside = true;
                    }
                }
            }
            const unsigned hits = group_ballot(mask, inside);
            if (write && inside) {
                const long long o = first + found + __popc(hits & ((1u << lane) - 1u));
                out_idx[o] = rows[i];
                out_dist[o] = m;
            }
            found += __popc(hits);
        }
    }
    if (!write) {
        if (lane == 0) counts[qi] = found;
        return;
    }
    __syncwarp(mask);  // the segment's writes are visible to lane 0
    if (lane != 0 || found > sort_limit) return;  // long segments are sorted afterwards
    for (long long a = first + 1; a < first + found; ++a) {
        double d = out_dist[a];
        long long r = out_idx[a];
        long long b = a - 1;
        while (b >= first && (out_dist[b] > d || (out_dist[b] == d && out_idx[b] > r))) {
            out_dist[b + 1] = out_dist[b];
            out_idx[b + 1] = out_idx[b];
            --b;
        }
        out_dist[b + 1] = d;
        out_idx[b + 1] = r;
    }
}

// Radius segments longer than radius_search sorts itself, up to SEGMENT_SORT_MAX
// entries: one block a segment (queries[blockIdx.x]), a bitonic sort by (metres, row) in
// shared memory, padded to a power of two with entries that sort last. Longer segments
// are sorted on the host side of gpu.py (a lexsort).
#define SEGMENT_SORT_MAX 4096   // 4096 * (8 + 4) bytes: the 48 KB of static shared memory
extern "C" __global__ void sort_segments(const long long* __restrict__ offsets,
                                         const long long* __restrict__ queries,
                                         long long* __restrict__ idx,
                                         double* __restrict__ dist) {
    __shared__ double sd[SEGMENT_SORT_MAX];
    __shared__ int sr[SEGMENT_SORT_MAX];
    const long long q = queries[blockIdx.x], first = offsets[q];
    const int n = (int)(offsets[q + 1] - first);
    int p = 1;
    while (p < n) p <<= 1;
    for (int i = threadIdx.x; i < p; i += blockDim.x) {
        sd[i] = i < n ? dist[first + i] : INF_D;
        sr[i] = i < n ? (int)idx[first + i] : 0x7fffffff;
    }
    __syncthreads();
    for (int size = 2; size <= p; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < (p >> 1); i += blockDim.x) {
                const int a = 2 * i - (i & (stride - 1)), b = a + stride;
                const double da = sd[a], db = sd[b];
                const int ra = sr[a], rb = sr[b];
                const bool after = da > db || (da == db && ra > rb);
                if (after == ((a & size) == 0)) {  // ascending where bit `size` of a is 0
                    sd[a] = db;
                    sd[b] = da;
                    sr[a] = rb;
                    sr[b] = ra;
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        dist[first + i] = sd[i];
        idx[first + i] = sr[i];
    }
}

// ---------------------------------------------------------------------------------
// Distance matrices: one thread per column, MATRIX_ROWS rows per block; the block's row
// vectors are staged in shared memory, a column's stays in registers, writes are
// coalesced. (Measured on an H200, 10k x 100k: shared rows +5% over reading them from
// global memory; 64 rows and 256 threads best among 16-128 rows, 128-256 threads, one or
// two columns a thread.)
// ---------------------------------------------------------------------------------
#define MATRIX_ROWS 64

// float64: the same chord form with asin replaced by a polynomial in the squared chord
// (chord_angle_factor, above): sqrt(u) f(u - 1) = 2 asin(sqrt(u) / 2) for u in [0, 2], off
// by at most 7e-16 rad, 4e-9 m. About a fifth of the double operations of atan2 (a
// division and a long polynomial) plus sqrt of the cross product's norm.
__device__ __forceinline__ double matrix_angle(double ax, double ay, double az, double bx,
                                               double by, double bz) {
    double dot = ax * bx + ay * by + az * bz;
    bool near = dot >= 0.0;
    double dx = near ? ax - bx : ax + bx;
    double dy = near ? ay - by : ay + by;
    double dz = near ? az - bz : az + bz;
    double u = dx * dx + dy * dy + dz * dz;
    double a = sqrt(u) * chord_angle_factor(u - 1.0);
    return near ? a : 3.141592653589793 - a;
}

// float32: the chord form, 2 asin(|a - b| / 2) on the near side and pi - 2 asin(|a + b| / 2)
// on the far side, so asin's argument stays below 0.71, where it is well conditioned:
// 1.4x the atan2 form's rate in float32, largest error 3.6 m against 2.8 m (both
// float32's own precision at 20,000 km). Identical points are exactly 0 apart.
__device__ __forceinline__ float matrix_angle(float ax, float ay, float az, float bx, float by,
                                              float bz) {
    float dot = ax * bx + ay * by + az * bz;
    float s = dot >= 0.f ? -1.f : 1.f;
    float dx = ax + s * bx, dy = ay + s * by, dz = az + s * bz;
    float a = 2.f * asinf(0.5f * sqrtf(dx * dx + dy * dy + dz * dz));
    return dot >= 0.f ? a : 3.14159265358979f - a;
}

template <typename T>
__global__ void distance_matrix(const T* __restrict__ a, const T* __restrict__ b,
                                long long m, long long n, long long row0, T radius,
                                T* __restrict__ out) {
    __shared__ T rows[3 * MATRIX_ROWS];
    const long long i0 = row0 + (long long)blockIdx.y * MATRIX_ROWS;
    const int count = (int)min((long long)MATRIX_ROWS, m - i0);
    for (int t = threadIdx.x; t < 3 * count; t += blockDim.x) rows[t] = a[3 * i0 + t];
    __syncthreads();
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const T bx = b[3 * j], by = b[3 * j + 1], bz = b[3 * j + 2];
    T* o = out + (i0 - row0) * n + j;
#pragma unroll 4
    for (int r = 0; r < count; ++r) {
        *o = radius * matrix_angle(rows[3 * r], rows[3 * r + 1], rows[3 * r + 2], bx, by, bz);
        o += n;
    }
}

// ---------------------------------------------------------------------------------
// Spherical k-means: assignment (largest dot product, ties to the lowest cluster) fused
// with the accumulation of each cluster's weighted sum of unit vectors. Sums are kept
// in 64-bit fixed point (value * scale, rounded): integer addition is associative, so
// the sums, and so the whole run, are the same from run to run whatever the order in
// which threads add.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ int nearest_centroid(double x, double y, double z,
                                                const double* __restrict__ cent, int k,
                                                double* best_dot) {
    double best = -INF_D;
    int label = 0;
    for (int c = 0; c < k; ++c) {
        double dot = fma(z, cent[3 * c + 2], fma(y, cent[3 * c + 1], x * cent[3 * c]));
        if (dot > best) {
            best = dot;
            label = c;
        }
    }
    *best_dot = best;
    return label;
}

extern "C" __global__ void kmeans_assign_accumulate(
    const double* __restrict__ xyz, const double* __restrict__ weights, long long n,
    const double* __restrict__ cent, int k, double scale, int use_shared,
    unsigned long long* __restrict__ sums) {
    extern __shared__ unsigned long long acc[];
    unsigned long long* target = use_shared ? acc : sums;
    if (use_shared) {
        for (int j = threadIdx.x; j < 3 * k; j += blockDim.x) acc[j] = 0ULL;
        __syncthreads();
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        double x = xyz[3 * i], y = xyz[3 * i + 1], z = xyz[3 * i + 2];
        double best;
        int c = nearest_centroid(x, y, z, cent, k, &best);
        double w = weights != nullptr ? weights[i] : 1.0;
        if (w == 0.0) continue;
        atomicAdd(&target[3 * c], (unsigned long long)__double2ll_rn(w * x * scale));
        atomicAdd(&target[3 * c + 1], (unsigned long long)__double2ll_rn(w * y * scale));
        atomicAdd(&target[3 * c + 2], (unsigned long long)__double2ll_rn(w * z * scale));
    }
    if (use_shared) {
        __syncthreads();
        for (int j = threadIdx.x; j < 3 * k; j += blockDim.x) {
            if (acc[j] != 0ULL) atomicAdd(&sums[j], acc[j]);
        }
    }
}

// One thread per cluster: normalised mean from the fixed-point sums (an empty cluster
// keeps its centroid), updated in place, and the angle it moved (atan2 form), radians.
extern "C" __global__ void kmeans_update(const unsigned long long* __restrict__ sums,
                                         double scale, int k, double* __restrict__ cent,
                                         double* __restrict__ shift) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= k) return;
    double x = (double)(long long)sums[3 * c] / scale;
    double y = (double)(long long)sums[3 * c + 1] / scale;
    double z = (double)(long long)sums[3 * c + 2] / scale;
    double norm = sqrt(x * x + y * y + z * z);
    if (norm == 0.0) {
        shift[c] = 0.0;
        return;
    }
    x /= norm;
    y /= norm;
    z /= norm;
    shift[c] = metres(cent[3 * c], cent[3 * c + 1], cent[3 * c + 2], x, y, z, 1.0);
    cent[3 * c] = x;
    cent[3 * c + 1] = y;
    cent[3 * c + 2] = z;
}

// k-means++ step: squared angle of every point to its nearest chosen centre, updated
// with the centre at sorted position `c` (first: set), and its weight times that, to be
// summed, in row order, into the distribution of the next draw. Points and weights are in
// index order; `rows` maps them to rows.
extern "C" __global__ void kmeanspp_nearest(const double* __restrict__ xyz,
                                            const double* __restrict__ weights, long long n,
                                            long long c, int first,
                                            const int* __restrict__ rows,
                                            double* __restrict__ nearest_sq,
                                            double* __restrict__ mass) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double a = metres(xyz[3 * i], xyz[3 * i + 1], xyz[3 * i + 2], xyz[3 * c], xyz[3 * c + 1],
                      xyz[3 * c + 2], 1.0);
    double a2 = a * a;
    double near = first ? a2 : fmin(nearest_sq[i], a2);
    nearest_sq[i] = near;
    mass[rows[i]] = (weights != nullptr ? weights[i] : 1.0) * near;
}

// Final labels and each point's weighted squared great-circle metres to its centroid,
// written by row.
extern "C" __global__ void kmeans_labels(const double* __restrict__ xyz,
                                         const double* __restrict__ weights, long long n,
                                         const double* __restrict__ cent, int k, double radius,
                                         const int* __restrict__ rows, int* __restrict__ labels,
                                         double* __restrict__ sq_metres) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double x = xyz[3 * i], y = xyz[3 * i + 1], z = xyz[3 * i + 2];
    double best;
    int c = nearest_centroid(x, y, z, cent, k, &best);
    double m = metres(x, y, z, cent[3 * c], cent[3 * c + 1], cent[3 * c + 2], radius);
    double w = weights != nullptr ? weights[i] : 1.0;
    const int r = rows[i];
    labels[r] = c;
    sq_metres[r] = w * m * m;
}
"""
)
