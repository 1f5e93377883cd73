// Variable-length (packed) softmax attention for encoders, bf16 in and out, f32 softmax and
// accumulation, head dimension 64, no mask inside a sequence (what BERT-style encoders need once
// padding is gone). The algorithm is FlashAttention-2's (Dao, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", arXiv:2307.08691): tiles of 64 keys stream
// through shared memory, each query row keeps its running max and sum, and the
// batch x heads x s x s score tensor is never written.
//
// Layout (src/gpu/varlen_attention.rs builds it):
//   qkv  (tokens, 3 * heads * 64): each row is [q heads | k heads | v heads], the output of one
//        fused QKV projection; the cells of a batch follow each other without padding;
//   cu   (cells + 1): cell c owns tokens cu[c] .. cu[c + 1];
//   out  (tokens, heads * 64).
// Grid: (ceil(longest / 128), heads, cells); a block of 4 warps takes 128 query rows of one head
// of one cell, each warp 32 rows (two 16-row tiles that share every key/value fragment).
//
// Version 4 (v3, WMMA with scores and probabilities through shared memory, ran at 65-70 TFLOP/s
// on the H200): the matrix products are PTX `mma.sync.m16n8k16` on fragments loaded with
// `ldmatrix`, the scores stay in registers and become the probability operand of P V directly
// (the accumulator layout of two 8-key tiles is the A-operand layout of one 16-key step), and the
// next key/value tile is copied with `cp.async` while the current one is used (two buffers; the
// query rows are staged in the second before the loop).
// Shared rows are padded to 72 elements (144 bytes) so the 8 row addresses of an `ldmatrix`
// fall on 8 different 16-byte bank groups.
// With FIXED_MAX (the kernel below) only a block's first key tile takes the online softmax; its
// row maxima then stay fixed, later tiles compute no maximum and never rescale O, and a warp
// whose tile row sums leave [0, 2^64] computes that tile again with the online softmax
// (varlen_attention_sm90.cu does the same and says why it is exact).

#include "attention_common.cuh"

#define HD 64
#define BM 64  // query rows a block per 16-row tile a warp (BM * MT rows a block)
#define BN 64  // keys a tile
#define WARPS 4
#define LD 72  // padded shared row, in elements

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read)
__device__ __forceinline__ void copy16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void copy_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldsm4(uint32_t *r, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4_t(uint32_t *r, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// c (16 x 8, f32) += a (16 x 16, bf16, row) * b (16 x 8, bf16, col)
__device__ __forceinline__ void mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// MT m16 tiles of query rows a warp (16 MT rows; a block of 4 warps takes 64 MT rows): with
// MT = 2 each key/value fragment read from shared memory feeds two matrix products.
template <int MT, bool FIXED_MAX>
__device__ __forceinline__ void attention(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                                          const unsigned int *__restrict__ cu, const int heads, const float scale_log2) {
    constexpr int ROWS = BM * MT;
    const BlockWork work = block_work(cu, ROWS);
    if (work.q0 >= work.len) return;
    const int head = work.head, start = work.start, len = work.len, q0 = work.q0;

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const size_t row_stride = (size_t)3 * heads * HD;
    const __nv_bfloat16 *base = qkv + (size_t)start * row_stride + head * HD;  // q of the cell's first token

    // two key/value buffers; the query rows are staged in the second before its first use
    // (at most 128 rows of 72 = two tiles), which keeps the block under 48 KB of shared memory
    __shared__ __align__(128) __nv_bfloat16 sm[4 * BN * LD];
    static_assert(ROWS * LD <= 2 * BN * LD, "the query rows fit in the second key/value buffer");
    __nv_bfloat16 *qs = sm + 2 * BN * LD;
    auto ks = [&](int buf) { return sm + buf * 2 * BN * LD; };
    auto vs = [&](int buf) { return sm + (buf * 2 + 1) * BN * LD; };

    // the block's query rows, then the first key/value tile: one copy group
    for (int i = tid; i < ROWS * (HD / 8); i += WARPS * 32) {
        const int r = i / (HD / 8), c = i % (HD / 8);
        const bool ok = q0 + r < len;
        copy16(qs + r * LD + c * 8, base + (size_t)(ok ? q0 + r : 0) * row_stride + c * 8, ok);
    }
    auto load_kv = [&](int tile, int buf) {
        const int k0 = tile * BN;
        for (int i = tid; i < BN * (HD / 8); i += WARPS * 32) {
            const int r = i / (HD / 8), c = i % (HD / 8);
            const bool ok = k0 + r < len;
            const __nv_bfloat16 *row = base + (size_t)(ok ? k0 + r : 0) * row_stride + c * 8;
            copy16(ks(buf) + r * LD + c * 8, row + heads * HD, ok);
            copy16(vs(buf) + r * LD + c * 8, row + 2 * heads * HD, ok);
        }
    };
    load_kv(0, 0);
    copy_commit();

    const int g = lane / 4;   // the fragment row (and row + 8) this lane holds
    const int tig = lane % 4; // its column pair
    uint32_t qf[MT][HD / 16][4];
    float o[MT][HD / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int d = 0; d < HD / 8; d++) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }

    // the query fragments, before the second buffer is filled with keys
    copy_wait_all();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) ldsm4(qf[mt][kk], qs + ((warp * MT + mt) * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
    __syncthreads();

    // S = Q K^T for the keys of tile k0 in kb: 16 rows x 64 keys an m tile, eight 16 x 8
    // accumulators; keys past the cell's end (the last tile only) at -inf
    auto scores = [&](float (&s)[MT][BN / 8][4], const __nv_bfloat16 *kb, int k0) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < BN / 8; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
            for (int j = 0; j < BN / 8; j += 2) {
                uint32_t b[4];
                ldsm4(b, kb + ((j + lane / 16) * 8 + lane % 8) * LD + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma(s[mt][j], qf[mt][kk], b[0], b[1]);
                    mma(s[mt][j + 1], qf[mt][kk], b[2], b[3]);
                }
            }
        }
        if (k0 + BN > len) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int c = k0 + j * 8 + tig * 2;
                    if (c >= len) s[mt][j][0] = s[mt][j][2] = -INFINITY;
                    if (c + 1 >= len) s[mt][j][1] = s[mt][j][3] = -INFINITY;
                }
        }
    };
    // one m tile's scores in place to 2^(s scale - m) (rows g and g + 8 against maxima m0, m1),
    // and this lane's shares of the two row sums
    auto exp_rows = [&](float (&st)[BN / 8][4], float m0, float m1, float &sum0, float &sum1) {
        sum0 = sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            st[j][0] = exp2_ftz(fmaf(st[j][0], scale_log2, -m0));
            st[j][1] = exp2_ftz(fmaf(st[j][1], scale_log2, -m0));
            st[j][2] = exp2_ftz(fmaf(st[j][2], scale_log2, -m1));
            st[j][3] = exp2_ftz(fmaf(st[j][3], scale_log2, -m1));
            sum0 += st[j][0] + st[j][1];
            sum1 += st[j][2] + st[j][3];
        }
    };
    // the online softmax of a tile in place, rows g and g + 8 of each m tile (the 4 lanes of a
    // row group share a row): new maxima, O and the sums rescaled
    auto online_softmax = [&](float (&s)[MT][BN / 8][4]) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                x0 = fmaxf(x0, fmaxf(s[mt][j][0], s[mt][j][1]));
                x1 = fmaxf(x1, fmaxf(s[mt][j][2], s[mt][j][3]));
            }
#pragma unroll
            for (int w = 1; w < 4; w <<= 1) {
                x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, w));
                x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, w));
            }
            const float n0 = fmaxf(m[mt][0], x0 * scale_log2), n1 = fmaxf(m[mt][1], x1 * scale_log2);
            const float a0 = exp2_ftz(m[mt][0] - n0), a1 = exp2_ftz(m[mt][1] - n1);
            m[mt][0] = n0;
            m[mt][1] = n1;
            float sum0, sum1;
            exp_rows(s[mt], n0, n1, sum0, sum1);
            l[mt][0] = l[mt][0] * a0 + sum0;  // this lane's share of the row sums; the 4 lanes add up at the end
            l[mt][1] = l[mt][1] * a1 + sum1;
#pragma unroll
            for (int d = 0; d < HD / 8; d++) {
                o[mt][d][0] *= a0;
                o[mt][d][1] *= a0;
                o[mt][d][2] *= a1;
                o[mt][d][3] *= a1;
            }
        }
    };

    const int tiles = (len + BN - 1) / BN;
    for (int t = 0; t < tiles; t++) {
        if (t + 1 < tiles) load_kv(t + 1, (t + 1) & 1);
        copy_commit();
        copy_wait_all_but_one();
        __syncthreads();
        const __nv_bfloat16 *kb = ks(t & 1);
        const __nv_bfloat16 *vb = vs(t & 1);

        const int k0 = t * BN;
        float s[MT][BN / 8][4];
        scores(s, kb, k0);
        if (!FIXED_MAX || t == 0) {
            online_softmax(s);
        } else {
            // the maxima of tile 0 stay: no maximum, no rescale of O (varlen_attention_sm90.cu
            // says why that is exact); a row sum outside [0, 2^64] sends the warp back
            float sum[MT][2];
            bool out_of_range = false;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                exp_rows(s[mt], m[mt][0], m[mt][1], sum[mt][0], sum[mt][1]);
                out_of_range |= !(sum[mt][0] <= 0x1p64f && sum[mt][1] <= 0x1p64f);
            }
            if (__any_sync(0xffffffffu, out_of_range)) {
                scores(s, kb, k0);
                online_softmax(s);
            } else {
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    l[mt][0] += sum[mt][0];
                    l[mt][1] += sum[mt][1];
                }
            }
        }
        // O += P V: the probabilities of keys 16 kk .. 16 kk + 15 are the A operand
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t p[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                p[mt][0] = pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                p[mt][1] = pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                p[mt][2] = pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                p[mt][3] = pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int d = 0; d < HD / 8; d += 2) {
                uint32_t b[4];
                ldsm4_t(b, vb + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + (d + lane / 16) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma(o[mt][d], p[mt], b[0], b[1]);
                    mma(o[mt][d + 1], p[mt], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is filled again
    }

    // out = O / l
    const size_t out_stride = (size_t)heads * HD;
    __nv_bfloat16 *dst = out + (size_t)start * out_stride + head * HD + tig * 2;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float l0 = l[mt][0], l1 = l[mt][1];
#pragma unroll
        for (int w = 1; w < 4; w <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, w);
            l1 += __shfl_xor_sync(0xffffffffu, l1, w);
        }
        const float i0 = 1.f / l0, i1 = 1.f / l1;
        const int r0 = q0 + (warp * MT + mt) * 16 + g, r1 = r0 + 8;
#pragma unroll
        for (int d = 0; d < HD / 8; d++) {
            if (r0 < len) *reinterpret_cast<uint32_t *>(dst + (size_t)r0 * out_stride + d * 8) = pack(o[mt][d][0] * i0, o[mt][d][1] * i0);
            if (r1 < len) *reinterpret_cast<uint32_t *>(dst + (size_t)r1 * out_stride + d * 8) = pack(o[mt][d][2] * i1, o[mt][d][3] * i1);
        }
    }
}

// 32 query rows a warp, 128 a block (grid x = ceil(longest / 128)), maxima fixed by the first key
// tile; two blocks an SM. Measured on the H200 against 16 rows a warp (128 registers, four blocks
// an SM): attention 12-17% faster at the four encoder shapes (bench/encoder_shapes.sh; BENCHMARKS.md).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
varlen_attention_bf16_d64(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                          const unsigned int *__restrict__ cu, const int heads, const float scale_log2) {
    attention<2, true>(qkv, out, cu, heads, scale_log2);
}
