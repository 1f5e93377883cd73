// Variable-length (packed) softmax attention for Hopper (sm_90a): the same contract as
// varlen_attention.cu (bf16 qkv rows [q heads | k heads | v heads], cells back to back, `cu` the
// cells' token offsets, head dimension 64, f32 softmax and accumulation) on the warpgroup matrix
// instructions (`wgmma.mma_async`) that only Hopper has. The design follows FlashAttention-3
// (Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision",
// arXiv:2407.08608) in its simplest form:
//   - a block is KG warpgroups (128 threads each), each warpgroup 64 query rows;
//   - S = Q K^T is one wgmma chain with both operands in shared memory (128-byte swizzled rows,
//     the layout the instruction reads without bank conflicts);
//   - the online softmax runs on S in registers (exp2 without subnormals, maxima and sums in
//     independent partials), and P (bf16) stays in registers as the A operand of O += P V, with
//     V read from shared memory as an MN-major ("transposed") operand;
//   - with FIXED_MAX (the kernel below), only a block's first key tile takes the online softmax:
//     its row maxima then stay fixed, so later tiles need no maximum and O no rescale. Softmax
//     is exact for any subtracted constant; the maxima only keep 2^(s scale - m) inside f32's
//     range (and bf16's, the same), so each tile's row sums are checked against [0, 2^64], and a
//     warp with a sum outside (a key 64 binary orders of magnitude above the first tile's
//     maximum, or NaN) recomputes its scores with mma.sync and takes the online softmax for
//     that tile. +3.6-5.1% on the H200 at the four encoder shapes; 0.71x when every later tile takes
//     the exact path (bench/attention_kernels.cu, v1_late_keys_x40);
//   - key/value tiles are copied STAGES - 1 tiles ahead, by TMA (one thread issues a few bulk
//     tensor copies a tile, completing on an mbarrier; +19-22% at the four encoder shapes on the H200
//     against every thread issuing cp.async, which the template keeps for the harness). Two
//     blocks an SM interleave one block's softmax with the other's matrix products.
// Not here (measured slower at these shapes on the H200, BENCHMARKS.md): the softmax overlapped
// with P V in the same warpgroup (the compiler then waits for P V before the softmax unless P is
// double-buffered, which costs the registers of the second block an SM; with fixed maxima, tile
// t + 1's softmax during P(t) V(t), commit 397f404: no faster at 2 blocks an SM with 64-key tiles,
// slower otherwise); ping-pong scheduling of the two warpgroups with an mbarrier key/value
// pipeline; part of the exponentials as polynomials on the FMA units (both in commit 416848e;
// with fixed maxima too, 2026-12-02). Not tried: a producer warp (two blocks an SM
// leave no registers for one).
// Grid: (ceil(longest / (64 KG)), heads, cells); dynamic shared memory: smem_bytes<KG, KT, STAGES>().
//
// A tile in shared memory is rows of 64 bf16 (128 bytes); 16-byte chunk c of row r is stored at
// chunk c ^ (r % 8) ("128-byte swizzle"). Tiles start on 1024-byte boundaries. Matrix
// descriptors: K-major operands (Q, K) advance 32 bytes a 16-wide k step, 8-row groups 1024 bytes
// apart; V is MN-major: 16 keys a k step (2048 bytes), 8-row groups 1024 bytes apart.

#include "sm90_common.cuh"

namespace sm90 {

constexpr int kHead = 64;  // head dimension: one 128-byte row

// d (64 x 96, f32) (+)= A (64 x 16 from shared, K-major) * B (16 x 96 from shared, K-major)
__device__ __forceinline__ void mma_ss_n96(float *d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, %48, %49, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
        : "l"(a), "l"(b), "r"(accumulate));
}
// d (64 x 64, f32) += A (64 x 16 from registers) * B (16 x 64 from shared, MN-major)
__device__ __forceinline__ void mma_rs_n64(float *d, const uint32_t *a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// four 8 x 8 bf16 matrices from shared memory (lane l gives the address of row l % 8 of matrix l / 8)
__device__ __forceinline__ void ldsm4(uint32_t *r, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// c (16 x 8, f32) += a (16 x 16, bf16, row) * b (16 x 8, bf16, col), one warp
__device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int KT> __device__ __forceinline__ void mma_qk(float *s, uint64_t a, uint64_t b, int acc);
template <> __device__ __forceinline__ void mma_qk<96>(float *s, uint64_t a, uint64_t b, int acc) { mma_ss_n96(s, a, b, acc); }

// O's rows (this thread's two) times the softmax rescale factors
__device__ __forceinline__ void rescale(float *o, float a0, float a1) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        o[4 * j] *= a0;
        o[4 * j + 1] *= a0;
        o[4 * j + 2] *= a1;
        o[4 * j + 3] *= a1;
    }
}

// keys past the cell's end at -inf (the last tile only), this thread's places of a 64 x KT tile;
// with CAUSAL also the keys after each of its two rows (r0 and r0 + 8: tiles that reach past r0)
template <int KT, bool CAUSAL> __device__ __forceinline__ void mask_tail(float *s, int k0, int len, int tig, int r0) {
    if (k0 + KT > len) {
#pragma unroll
        for (int j = 0; j < KT / 8; j++) {
            const int c = k0 + j * 8 + tig * 2;
            if (c >= len) s[4 * j] = s[4 * j + 2] = -INFINITY;
            if (c + 1 >= len) s[4 * j + 1] = s[4 * j + 3] = -INFINITY;
        }
    }
    if (CAUSAL && k0 + KT - 1 > r0) {
#pragma unroll
        for (int j = 0; j < KT / 8; j++) {
            const int c = k0 + j * 8 + tig * 2;
            if (c > r0) s[4 * j] = -INFINITY;
            if (c + 1 > r0) s[4 * j + 1] = -INFINITY;
            if (c > r0 + 8) s[4 * j + 2] = -INFINITY;
            if (c + 1 > r0 + 8) s[4 * j + 3] = -INFINITY;
        }
    }
}
// s <- 2^(s scale - m) for this thread's two rows (maxima m0, m1); t0 and t1 their sums, each
// in four independent partials (short dependency chains)
template <int KT>
__device__ __forceinline__ void exp_rows(float *s, float scale_log2, float m0, float m1, float &t0, float &t1) {
    float sm[2][4] = {};
#pragma unroll
    for (int j = 0; j < KT / 8; j++) {
        s[4 * j] = exp2_ftz(fmaf(s[4 * j], scale_log2, -m0));
        s[4 * j + 1] = exp2_ftz(fmaf(s[4 * j + 1], scale_log2, -m0));
        s[4 * j + 2] = exp2_ftz(fmaf(s[4 * j + 2], scale_log2, -m1));
        s[4 * j + 3] = exp2_ftz(fmaf(s[4 * j + 3], scale_log2, -m1));
        sm[0][j % 4] += s[4 * j] + s[4 * j + 1];
        sm[1][j % 4] += s[4 * j + 2] + s[4 * j + 3];
    }
    t0 = (sm[0][0] + sm[0][1]) + (sm[0][2] + sm[0][3]);
    t1 = (sm[1][0] + sm[1][1]) + (sm[1][2] + sm[1][3]);
}

// The online softmax of one 64 x KT score tile in place (s becomes exp(s - running max) in
// base 2), for this thread's two rows (16 warp + g and + 8; the 4 lanes of a group share a row):
// masks keys past the cell's end, updates the running maxima m and sums l, and returns O's
// rescale factors a.
template <int KT, bool CAUSAL>
__device__ __forceinline__ void online_softmax(float *s, int k0, int len, int tig, int r0, float scale_log2, float &m0, float &m1, float &l0,
                                               float &l1, float &a0, float &a1) {
    mask_tail<KT, CAUSAL>(s, k0, len, tig, r0);
    // row maxima and sums in four independent partials (short dependency chains)
    float mx[2][4];
#pragma unroll
    for (int i = 0; i < 4; i++) mx[0][i] = mx[1][i] = -INFINITY;
#pragma unroll
    for (int j = 0; j < KT / 8; j++) {
        mx[0][j % 4] = fmaxf(mx[0][j % 4], fmaxf(s[4 * j], s[4 * j + 1]));
        mx[1][j % 4] = fmaxf(mx[1][j % 4], fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    float x0 = fmaxf(fmaxf(mx[0][0], mx[0][1]), fmaxf(mx[0][2], mx[0][3]));
    float x1 = fmaxf(fmaxf(mx[1][0], mx[1][1]), fmaxf(mx[1][2], mx[1][3]));
#pragma unroll
    for (int w = 1; w < 4; w <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, w));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, w));
    }
    const float n0 = fmaxf(m0, x0 * scale_log2), n1 = fmaxf(m1, x1 * scale_log2);
    a0 = exp2_ftz(m0 - n0);
    a1 = exp2_ftz(m1 - n1);
    m0 = n0;
    m1 = n1;
    float t0, t1;
    exp_rows<KT>(s, scale_log2, n0, n1, t0, t1);
    l0 = l0 * a0 + t0;
    l1 = l1 * a1 + t1;
}

// The softmax of a later tile against the running maxima fixed by the first tile (no maximum,
// no rescale of O): s becomes 2^(s scale - m), t0 and t1 this thread's sums of its two rows.
// Softmax is exact for any m (it cancels in O / l); m only has to keep 2^(s scale - m) inside
// f32 and bf16's range, which is the same. Returns whether a sum left [0, 2^64] (a key more than
// 64 binary orders of magnitude above the first tile's maximum, or NaN): the caller then redoes
// the tile with the exact online softmax.
template <int KT, bool CAUSAL>
__device__ __forceinline__ bool fixed_softmax(float *s, int k0, int len, int tig, int r0, float scale_log2, float m0, float m1, float &t0,
                                              float &t1) {
    mask_tail<KT, CAUSAL>(s, k0, len, tig, r0);
    exp_rows<KT>(s, scale_log2, m0, m1, t0, t1);
    return !(t0 <= 0x1p64f && t1 <= 0x1p64f);
}

// S for this warp's 16 rows of a 64 x KT tile again, from the query and key tiles still in
// shared memory, with the warp-level mma.sync (its m16n8 accumulator is wgmma's layout for a
// warp's rows: s[4 j .. 4 j + 3] = rows g and g + 8, keys 8 j + 2 tig and + 1): the rare path of
// fixed_softmax's range check, which one warp may take without the others of its warpgroup.
template <int KT> __device__ __forceinline__ void scores_again(float *s, uint32_t q, uint32_t k, int warp, int lane) {
#pragma unroll
    for (int i = 0; i < KT / 2; i++) s[i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kHead / 16; kk++) {
        uint32_t a[4];
        ldsm4(a, q + swz(warp * 16 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
        for (int j = 0; j < KT / 8; j += 2) {
            uint32_t b[4];
            ldsm4(b, k + swz((j + lane / 16) * 8 + lane % 8, kk * 2 + (lane / 8) % 2));
            mma16816(s + 4 * j, a, b[0], b[1]);
            mma16816(s + 4 * j + 4, a, b[2], b[3]);
        }
    }
}

// out rows r0 and r0 + 8 of the cell (those below len) = O / l; l is summed over the 4 lanes first
__device__ __forceinline__ void store(__nv_bfloat16 *out, const float *o, float l0, float l1, int start, int head, int heads, int r0,
                                      int len, int tig) {
#pragma unroll
    for (int w = 1; w < 4; w <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, w);
        l1 += __shfl_xor_sync(0xffffffffu, l1, w);
    }
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    const size_t out_stride = (size_t)heads * kHead;
    __nv_bfloat16 *dst = out + (size_t)start * out_stride + head * kHead + tig * 2;
    const int r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (r0 < len) *reinterpret_cast<uint32_t *>(dst + (size_t)r0 * out_stride + j * 8) = pack(o[4 * j] * i0, o[4 * j + 1] * i0);
        if (r1 < len) *reinterpret_cast<uint32_t *>(dst + (size_t)r1 * out_stride + j * 8) = pack(o[4 * j + 2] * i1, o[4 * j + 3] * i1);
    }
}

// KG warpgroups of 64 query rows, KT keys a tile
template <int KG, int KT, int STAGES> constexpr int smem_bytes() { return 64 * KG * 128 + STAGES * 2 * KT * 128 + 1024; }

// With TMA, `map` is the qkv rows as a tensor map (3 heads 64 columns x tokens, boxes of 64
// columns x 32 rows, 128-byte swizzle, zero fill past the last token) and qkv is not read: one
// thread moves each tile with a few bulk copies instead of every thread issuing cp.async. Rows
// past the cell's end then hold the next cell's keys and values: the keys are masked as before,
// and the values are zeroed in shared memory (a weight of 0 times a non-finite value of another
// cell would be NaN).
// CAUSAL: row r of a cell attends to keys 0..r only; the block reads the key tiles up to its
// last row (tile 0, which holds key 0, still fixes every row's maximum).
template <int KG, int KT, int STAGES, bool FIXED_MAX, bool TMA = false, bool CAUSAL = false>
__device__ __forceinline__ void attention(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                                          const unsigned int *__restrict__ cu, const int heads, const float scale_log2,
                                          const TensorMap *map = nullptr) {
    constexpr int ROWS = 64 * KG;
    constexpr int THREADS = 128 * KG;
    const BlockWork work = block_work(cu, ROWS);
    if (work.q0 >= work.len) return;
    const int head = work.head, start = work.start, len = work.len, q0 = work.q0;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t qs = raw + ((1024 - (raw & 1023)) & 1023);  // the tiles start on 1024-byte boundaries
    auto ks = [&](int tile) { return qs + ROWS * 128 + (tile % STAGES) * 2 * KT * 128; };
    auto vs = [&](int tile) { return ks(tile) + KT * 128; };

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const int g = lane / 4, tig = lane % 4;
    const size_t row_stride = (size_t)3 * heads * kHead;
    const __nv_bfloat16 *base = qkv + (size_t)start * row_stride + head * kHead;

    __shared__ __align__(8) uint64_t full[STAGES];  // TMA: tile t's keys and values (and tile 0 the queries) arrived
    auto bar = [&](int tile) { return smem_addr(&full[tile % STAGES]); };
    if (TMA) {
        if (tid == 0) {
            for (int i = 0; i < STAGES; i++) mbar_init(smem_addr(&full[i]), 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
    } else {
        for (int i = tid; i < ROWS * 8; i += THREADS) {
            const int r = i / 8, c = i % 8;
            const bool ok = q0 + r < len;
            copy16(qs + swz(r, c), base + (size_t)(ok ? q0 + r : 0) * row_stride + c * 8, ok);
        }
    }
    auto load_kv = [&](int tile) {
        const int k0 = tile * KT;
        if (TMA) {
            if (tid == 0) {
                mbar_expect(bar(tile), 2 * KT * 128 + (tile == 0 ? ROWS * 128 : 0));
                if (tile == 0)
                    for (int r = 0; r < ROWS; r += 32) tma_load(qs + r * 128, *map, head * kHead, start + q0 + r, bar(tile));
                for (int r = 0; r < KT; r += 32) {
                    tma_load(ks(tile) + r * 128, *map, (heads + head) * kHead, start + k0 + r, bar(tile));
                    tma_load(vs(tile) + r * 128, *map, (2 * heads + head) * kHead, start + k0 + r, bar(tile));
                }
            }
        } else {
            for (int i = tid; i < KT * 8; i += THREADS) {
                const int r = i / 8, c = i % 8;
                const bool ok = k0 + r < len;
                const __nv_bfloat16 *row = base + (size_t)(ok ? k0 + r : 0) * row_stride + c * 8;
                copy16(ks(tile) + swz(r, c), row + heads * kHead, ok);
                copy16(vs(tile) + swz(r, c), row + 2 * heads * kHead, ok);
            }
        }
    };
    const int tiles = ((CAUSAL ? min(len, q0 + ROWS) : len) + KT - 1) / KT;
    // this thread's first row of the cell (and that + 8)
    const int r0 = q0 + wg * 64 + warp * 16 + g;
    // tiles 0 .. STAGES - 2 ahead, a copy group each (the query rows go with tile 0)
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) {
        if (t < tiles) load_kv(t);
        if (!TMA) copy_commit();
    }

    float o[32];
#pragma unroll
    for (int i = 0; i < 32; i++) o[i] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const uint32_t qa = qs + wg * 64 * 128;

    for (int t = 0; t < tiles; t++) {
        // tile t is in shared memory (STAGES - 2 later groups may still be in flight) and every
        // warpgroup is done with tile t - 1, whose buffer tile t + STAGES - 1 then takes
        if (TMA) {
            mbar_wait(bar(t), (t / STAGES) & 1);
            if (t == tiles - 1 && t * KT + KT > len) {  // the last tile: values past the cell's end to 0
                for (int i = tid; i < (t * KT + KT - len) * 8; i += THREADS) {
                    const int r = len - t * KT + i / 8;
                    *reinterpret_cast<uint4 *>(smem_raw + (vs(t) - raw) + swz(r, i % 8)) = make_uint4(0, 0, 0, 0);
                }
                fence_async_shared();
            }
        } else {
            copy_wait<STAGES - 2>();
            fence_async_shared();
        }
        __syncthreads();
        if (t + STAGES - 1 < tiles) load_kv(t + STAGES - 1);
        if (!TMA) copy_commit();
        const uint32_t ka = ks(t), va = vs(t);

        // S = Q K^T (64 rows x KT keys this warpgroup)
        float s[KT / 2];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < kHead / 16; kk++) mma_qk<KT>(s, desc(qa + kk * 32, 16, 1024), desc(ka + kk * 32, 16, 1024), kk);
        wg_commit();
        wg_wait_all();
#pragma unroll
        for (int i = 0; i < KT / 2; i++) pin(s[i]);

        if (!FIXED_MAX || t == 0) {
            float a0, a1;
            online_softmax<KT, CAUSAL>(s, t * KT, len, tig, r0, scale_log2, m0, m1, l0, l1, a0, a1);
            rescale(o, a0, a1);
        } else {
            float t0, t1;
            const bool out_of_range = fixed_softmax<KT, CAUSAL>(s, t * KT, len, tig, r0, scale_log2, m0, m1, t0, t1);
            if (__any_sync(0xffffffffu, out_of_range)) {
                scores_again<KT>(s, qa, ka, warp, lane);
                float a0, a1;
                online_softmax<KT, CAUSAL>(s, t * KT, len, tig, r0, scale_log2, m0, m1, l0, l1, a0, a1);
                rescale(o, a0, a1);
            } else {
                l0 += t0;
                l1 += t1;
            }
        }
        // O += P V: the probabilities of keys 16 kk .. 16 kk + 15 are the A operand of step kk
        uint32_t p[KT / 16][4];
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            p[kk][0] = pack(s[8 * kk], s[8 * kk + 1]);
            p[kk][1] = pack(s[8 * kk + 2], s[8 * kk + 3]);
            p[kk][2] = pack(s[8 * kk + 4], s[8 * kk + 5]);
            p[kk][3] = pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
#pragma unroll
        for (int i = 0; i < 32; i++) pin(o[i]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) mma_rs_n64(o, p[kk], desc(va + kk * 2048, 1024, 1024));
        wg_commit();
        wg_wait_all();
#pragma unroll
        for (int i = 0; i < 32; i++) pin(o[i]);
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++)
#pragma unroll
            for (int i = 0; i < 4; i++) pin(p[kk][i]);
    }

    store(out, o, l0, l1, start, head, heads, r0, len, tig);
}

}  // namespace sm90

// 2 warpgroups (128 query rows) a block, 96 keys a tile, two key/value buffers, two blocks an
// SM (128 registers), maxima fixed by the first key tile, tiles moved by TMA (`map`: the qkv
// rows, boxes of 64 columns x 32 rows; gpu/varlen_attention.rs makes it). Measured on the H200
// (bench/attention_kernels.cu, BENCHMARKS.md) against 64 and 128 keys a tile, 3 and 4 buffers,
// one warpgroup a block, and the softmax overlapped with P V in the same warpgroup: this one was
// the fastest at the four benchmark shapes; TMA instead of every thread's cp.async: +19-22%.
extern "C" __global__ void __launch_bounds__(256, 2)
varlen_attention_bf16_d64_sm90(const __grid_constant__ sm90::TensorMap map, __nv_bfloat16 *__restrict__ out,
                               const unsigned int *__restrict__ cu, const int heads, const float scale_log2) {
    sm90::attention<2, 96, 2, true, true>(nullptr, out, cu, heads, scale_log2, &map);
}

// The same, causal (GPT-NeoX: Cell2Sentence's Pythia): each row attends to its cell's keys up to
// itself; a block stops at the key tile of its last row.
extern "C" __global__ void __launch_bounds__(256, 2)
varlen_attention_causal_bf16_d64_sm90(const __grid_constant__ sm90::TensorMap map, __nv_bfloat16 *__restrict__ out,
                                      const unsigned int *__restrict__ cu, const int heads, const float scale_log2) {
    sm90::attention<2, 96, 2, true, true, true>(nullptr, out, cu, heads, scale_log2, &map);
}
