// Pairwise distances of cells for the scIB metrics on a GPU (`gpu/pairwise.rs`): a tile of squared
// Euclidean distances, the k nearest of each row kept across column chunks, and per-label sums of
// distances (the silhouette's). f32 throughout; the distances are sums of squared differences,
// as the CPU's exact search computes them (no |a|^2 + |b|^2 - 2ab cancellation).

#include <stdint.h>

#define TILE 128
#define BK 8

// D[q * ldd + c] = sum_k (X[(q0 + q) * dp + k] - X[(c0 + c) * dp + k])^2, q < nq, c < nc.
// X is n x dp row-major with dp a multiple of 8 (zero columns past the data's width). Block:
// 256 threads, a 128 x 128 tile; each thread 8 x 8 values (rows ty*4 + {0..3, 64..67}, columns
// likewise), the dimensions staged 8 at a time through shared memory.
extern "C" __global__ void __launch_bounds__(256) sqdist_tile_f32(const float* __restrict__ X, int dp, long long q0, int nq,
                                                                  long long c0, int nc, float* __restrict__ D, long long ldd) {
    __shared__ __align__(16) float As[BK][TILE + 4];
    __shared__ __align__(16) float Bs[BK][TILE + 4];
    const int t = threadIdx.x;
    const int tx = t & 15, ty = t >> 4;
    const int qb = blockIdx.y * TILE, cb = blockIdx.x * TILE;
    // loading: thread t brings row t / 2, dimensions (t % 2) * 4 .. + 4, of each side
    const int lr = t >> 1, lk = (t & 1) * 4;
    const bool qa = qb + lr < nq, ca = cb + lr < nc;
    const float* qrow = X + (q0 + qb + lr) * (long long)dp + lk;
    const float* crow = X + (c0 + cb + lr) * (long long)dp + lk;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < dp; k0 += BK) {
        float4 a = qa ? *reinterpret_cast<const float4*>(qrow + k0) : make_float4(0.f, 0.f, 0.f, 0.f);
        float4 b = ca ? *reinterpret_cast<const float4*>(crow + k0) : make_float4(0.f, 0.f, 0.f, 0.f);
        As[lk + 0][lr] = a.x;
        As[lk + 1][lr] = a.y;
        As[lk + 2][lr] = a.z;
        As[lk + 3][lr] = a.w;
        Bs[lk + 0][lr] = b.x;
        Bs[lk + 1][lr] = b.y;
        Bs[lk + 2][lr] = b.z;
        Bs[lk + 3][lr] = b.w;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; k++) {
            float av[8], bv[8];
            float4 a0 = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
            float4 a1 = *reinterpret_cast<const float4*>(&As[k][64 + ty * 4]);
            float4 b0 = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
            float4 b1 = *reinterpret_cast<const float4*>(&Bs[k][64 + tx * 4]);
            av[0] = a0.x; av[1] = a0.y; av[2] = a0.z; av[3] = a0.w;
            av[4] = a1.x; av[5] = a1.y; av[6] = a1.z; av[7] = a1.w;
            bv[0] = b0.x; bv[1] = b0.y; bv[2] = b0.z; bv[3] = b0.w;
            bv[4] = b1.x; bv[5] = b1.y; bv[6] = b1.z; bv[7] = b1.w;
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float diff = av[i] - bv[j];
                    acc[i][j] = fmaf(diff, diff, acc[i][j]);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = qb + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (q >= nq) continue;
        float* drow = D + (long long)q * ldd;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int c = cb + h * 64 + tx * 4;
            if (c + 3 < nc) {
                *reinterpret_cast<float4*>(drow + c) = make_float4(acc[i][h * 4], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
            } else {
                for (int j = 0; j < 4 && c + j < nc; j++) drow[c + j] = acc[i][h * 4 + j];
            }
        }
    }
}

// The k nearest of each row, merged chunk by chunk. Row q of the tile D (nc squared distances to
// columns c0 .. c0 + nc) joins the row's list kept so far (best_d / best_i, k sorted entries;
// `first`: no list yet): the chunk's k smallest by (distance, column) are found by a radix select
// on the distances' bits (non-negative floats order as their bits), gathered, and sorted with the
// list (bitonic, by distance then column); the first k stay. Columns come in increasing order
// across chunks, so a chunk's value equal to the list's k-th loses the tie, as the CPU's search
// breaks ties by the smaller index. One block of 256 threads a row; shared memory: the row's
// keys (nc <= KNN_CHUNK) and 2 * KNN_PAIRS pairs.
#define KNN_THREADS 256
#define KNN_CHUNK 8192
#define KNN_PAIRS 256  // largest k

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

extern "C" __global__ void __launch_bounds__(KNN_THREADS) knn_merge_f32(const float* __restrict__ D, long long ldd, int nq, int nc, long long c0, int k,
                                                                          float* __restrict__ best_d, unsigned* __restrict__ best_i, int first) {
    __shared__ unsigned keys[KNN_CHUNK];
    __shared__ unsigned long long pairs[2 * KNN_PAIRS];
    __shared__ unsigned hist[256];
    __shared__ unsigned wcount[2][KNN_THREADS / 32];
    __shared__ unsigned sel[3];  // prefix, remaining, fast path
    const int q = blockIdx.x;
    if (q >= nq) return;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const float* drow = D + (long long)q * ldd;
    float* bd = best_d + (long long)q * k;
    unsigned* bi = best_i + (long long)q * k;
    // the list's k-th: a chunk's value at or above it cannot enter
    const unsigned worst = first ? 0xffffffffu : __float_as_uint(bd[k - 1]);
    for (int j = t; j < nc; j += KNN_THREADS) keys[j] = __float_as_uint(fmaxf(drow[j], 0.f));
    const int kk = k < nc ? k : nc;
    // how many are below the list's k-th (all of the chunk for the first)
    unsigned below = 0;
    for (int j = t; j < nc; j += KNN_THREADS) below += keys[j] < worst;
    for (int o = 16; o; o >>= 1) below += __shfl_xor_sync(0xffffffffu, below, o);
    if (lane == 0) wcount[0][warp] = below;
    __syncthreads();
    if (t == 0) {
        unsigned tot = 0;
        for (int w = 0; w < KNN_THREADS / 32; w++) tot += wcount[0][w];
        sel[2] = tot;
    }
    __syncthreads();
    const unsigned n_below = sel[2];
    if (n_below == 0) return;  // nothing of this chunk enters the list
    // threshold T and how many values equal to it to take (`remaining`)
    unsigned thr, take_eq;
    if (!first && n_below <= (unsigned)kk) {
        thr = worst;  // take every value below the list's k-th, none equal
        take_eq = 0;
    } else {
        if (t == 0) {
            sel[0] = 0;
            sel[1] = kk;
        }
        unsigned mask = 0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            hist[t] = 0;  // KNN_THREADS == 256 bins
            __syncthreads();
            const unsigned prefix = sel[0];
            for (int j0 = 0; j0 < nc; j0 += KNN_THREADS) {
                const int j = j0 + t;
                const bool in = j < nc && (keys[j] & mask) == prefix;
                const unsigned bin = in ? (keys[j] >> shift) & 255u : 256u;
                const unsigned active = __ballot_sync(0xffffffffu, in);
                if (in) {
                    const unsigned peers = __match_any_sync(active, bin);
                    if ((peers & lanemask_lt()) == 0) atomicAdd(&hist[bin], __popc(peers));
                }
            }
            __syncthreads();
            if (warp == 0) {
                // the bin holding the rem-th value: a scan over the 256 bins, 8 a lane
                unsigned h[8], s = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    h[i] = hist[lane * 8 + i];
                    s += h[i];
                }
                unsigned incl = s;
                for (int o = 1; o < 32; o <<= 1) {
                    const unsigned v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += v;
                }
                const unsigned rem = sel[1];
                const unsigned hit = __ballot_sync(0xffffffffu, incl >= rem);
                if (lane == __ffs(hit) - 1) {
                    unsigned cum = incl - s, b = 0;
                    for (; b < 7; b++) {
                        if (cum + h[b] >= rem) break;
                        cum += h[b];
                    }
                    sel[0] = prefix | ((lane * 8 + b) << shift);
                    sel[1] = rem - cum;
                }
            }
            mask |= 255u << shift;
            __syncthreads();
        }
        thr = sel[0];
        take_eq = sel[1];
    }
    // gather, in column order within each kind: values below thr, then the first take_eq equal
    // to it; each warp walks its own stretch of columns twice (count, then write)
    const int span = ((nc + KNN_THREADS - 1) / KNN_THREADS) * 32;
    const int lo = warp * span, hi = min(nc, lo + span);
    unsigned n_lt = 0, n_eq = 0;
    for (int j0 = lo; j0 < hi; j0 += 32) {
        const int j = j0 + lane;
        const unsigned key = j < hi ? keys[j] : 0xffffffffu;
        n_lt += __popc(__ballot_sync(0xffffffffu, j < hi && key < thr));
        n_eq += __popc(__ballot_sync(0xffffffffu, j < hi && key == thr));
    }
    if (lane == 0) {
        wcount[0][warp] = n_lt;
        wcount[1][warp] = n_eq;
    }
    __syncthreads();
    unsigned lt_base = 0, eq_base = 0, lt_total = 0;
    for (int w = 0; w < KNN_THREADS / 32; w++) {
        if (w < warp) {
            lt_base += wcount[0][w];
            eq_base += wcount[1][w];
        }
        lt_total += wcount[0][w];
    }
    // the list first (pairs[0 .. k)), the chunk's entries after it (pairs[k .. 2k))
    for (int j = t; j < 2 * KNN_PAIRS; j += KNN_THREADS) pairs[j] = 0xffffffffffffffffull;
    __syncthreads();
    if (!first)
        for (int j = t; j < k; j += KNN_THREADS) pairs[j] = ((unsigned long long)__float_as_uint(bd[j]) << 32) | bi[j];
    for (int j0 = lo; j0 < hi; j0 += 32) {
        const int j = j0 + lane;
        const unsigned key = j < hi ? keys[j] : 0xffffffffu;
        const bool lt = j < hi && key < thr, eq = j < hi && key == thr;
        const unsigned blt = __ballot_sync(0xffffffffu, lt), beq = __ballot_sync(0xffffffffu, eq);
        const unsigned idx = (unsigned)(c0 + j);
        if (lt) pairs[k + lt_base + __popc(blt & lanemask_lt())] = ((unsigned long long)key << 32) | idx;
        if (eq) {
            const unsigned p = eq_base + __popc(beq & lanemask_lt());
            if (p < take_eq) pairs[k + lt_total + p] = ((unsigned long long)key << 32) | idx;
        }
        lt_base += __popc(blt);
        eq_base += __popc(beq);
    }
    __syncthreads();
    // bitonic sort of the 2k pairs, padded to a power of two
    int size = 1;
    while (size < 2 * k) size <<= 1;
    for (int len = 2; len <= size; len <<= 1) {
        for (int stride = len >> 1; stride > 0; stride >>= 1) {
            for (int i = t; i < size / 2; i += KNN_THREADS) {
                const int a = 2 * i - (i & (stride - 1));
                const int b = a + stride;
                const bool up = (a & len) == 0;
                const unsigned long long x = pairs[a], y = pairs[b];
                if ((x > y) == up) {
                    pairs[a] = y;
                    pairs[b] = x;
                }
            }
            __syncthreads();
        }
    }
    for (int j = t; j < k; j += KNN_THREADS) {
        bd[j] = __uint_as_float((unsigned)(pairs[j] >> 32));
        bi[j] = (unsigned)(pairs[j] & 0xffffffffu);
    }
}

// Per-label sums of distances for the silhouette: for row q and each run of one label among the
// tile's columns (seg_label / seg_start / seg_end, columns sorted by label), sums[q * n_labels +
// label] += sum over the run of sqrt(D[q, c]). A block (256 threads) a (row, run); f32 within a
// thread's stretch, f64 across threads and chunks.
extern "C" __global__ void __launch_bounds__(256) label_sums_f32(const float* __restrict__ D, long long ldd, int nq, const int* __restrict__ seg_label,
                                                                 const int* __restrict__ seg_start, const int* __restrict__ seg_end, int n_labels,
                                                                 double* __restrict__ sums) {
    __shared__ double part[8];
    const int q = blockIdx.x, s = blockIdx.y;
    if (q >= nq) return;
    const float* drow = D + (long long)q * ldd;
    float acc = 0.f;
    for (int c = seg_start[s] + threadIdx.x; c < seg_end[s]; c += 256) acc += sqrtf(fmaxf(drow[c], 0.f));
    double v = acc;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = 0;
        for (int w = 0; w < 8; w++) tot += part[w];
        sums[(long long)q * n_labels + seg_label[s]] += tot;
    }
}
