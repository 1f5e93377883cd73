// Variable-length (packed) softmax attention for encoders, bf16 in and out, f32 softmax and
// accumulation, head dimension 64, no mask inside a sequence (what BERT-style encoders need once
// padding is gone). At the end of the file, training's forward pass (dropout, the rows' lse) and
// FlashAttention-2's backward pass, which share this file's matrix-product helpers. The algorithm is FlashAttention-2's (Dao, "FlashAttention-2: Faster Attention
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

// acc[m] (16 rows x 8 NT columns, f32) = a[m] (16 x 64, A fragments in registers) times the first
// 8 NT rows of `tile` (64 wide, rows LD apart in shared memory) transposed: the tile's rows are
// the product's columns. Q K^T in the forward pass; K Q^T and V dO^T in the backward pass. Each
// B fragment read from shared memory feeds all M row tiles.
template <int M, int NT>
__device__ __forceinline__ void times_rows_t(float (&acc)[M][NT][4], const uint32_t (&a)[M][HD / 16][4], const __nv_bfloat16 *tile,
                                             const int lane) {
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            uint32_t b[4];
            ldsm4(b, tile + ((j + lane / 16) * 8 + lane % 8) * LD + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int m = 0; m < M; m++) {
                mma(acc[m][j], a[m][kk], b[0], b[1]);
                mma(acc[m][j + 1], a[m][kk], b[2], b[3]);
            }
        }
    }
}

// MT m16 tiles of query rows a warp (16 MT rows; a block of 4 warps takes 64 MT rows): with
// MT = 2 each key/value fragment read from shared memory feeds two matrix products.
// Training's extras (TRAIN): the dropout of the probabilities (attention_common.cuh's rule) and
// each query row's log2-sum-exp2 of the scaled scores, lse[(cell x heads + head) x len + row],
// which the backward pass recomputes the probabilities from.
struct TrainArgs {
    float *lse;
    int has_mask;
    unsigned long long key;
    unsigned int threshold16;
    float scale;
};

// CAUSAL: row r of a cell attends to keys 0..r only (GPT-NeoX); the block reads the key tiles up
// to its last row, and tile 0 (key 0) still fixes every row's maximum.
template <int MT, bool FIXED_MAX, bool TRAIN, bool CAUSAL = false>
__device__ __forceinline__ void attention(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                                          const unsigned int *__restrict__ cu, const int heads, const float scale_log2,
                                          const TrainArgs train) {
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
        times_rows_t<MT, BN / 8>(s, qf, kb, lane);
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
        if (CAUSAL) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int r0 = q0 + (warp * MT + mt) * 16 + g;
                if (k0 + BN - 1 > r0) {
#pragma unroll
                    for (int j = 0; j < BN / 8; j++) {
                        const int c = k0 + j * 8 + tig * 2;
                        if (c > r0) s[mt][j][0] = -INFINITY;
                        if (c + 1 > r0) s[mt][j][1] = -INFINITY;
                        if (c > r0 + 8) s[mt][j][2] = -INFINITY;
                        if (c + 1 > r0 + 8) s[mt][j][3] = -INFINITY;
                    }
                }
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

    const int tiles = ((CAUSAL ? min(len, q0 + ROWS) : len) + BN - 1) / BN;
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
        if (TRAIN && train.has_mask) {
            // dropout after the row sums took the whole probabilities: a lane's four values of
            // an 8-key tile (rows g, g + 8; keys c, c + 1) share one draw
            const unsigned long long bh = (unsigned long long)blockIdx.z * heads + head;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int r0 = q0 + (warp * MT + mt) * 16 + g;
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int c = k0 + j * 8 + tig * 2;
                    const unsigned long long bits = attn_group_bits(train.key, bh, r0, c, len);
                    s[mt][j][0] *= attn_keep(bits, r0, c, train.threshold16, train.scale);
                    s[mt][j][1] *= attn_keep(bits, r0, c + 1, train.threshold16, train.scale);
                    s[mt][j][2] *= attn_keep(bits, r0 + 8, c, train.threshold16, train.scale);
                    s[mt][j][3] *= attn_keep(bits, r0 + 8, c + 1, train.threshold16, train.scale);
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
        if (TRAIN && tig == 0) {
            float *lse = train.lse + ((size_t)blockIdx.z * heads + head) * len;
            if (r0 < len) lse[r0] = m[mt][0] + __log2f(l0);
            if (r1 < len) lse[r1] = m[mt][1] + __log2f(l1);
        }
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
    attention<2, true, false>(qkv, out, cu, heads, scale_log2, TrainArgs{});
}

// The same, causal (GPT-NeoX: Cell2Sentence's Pythia).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
varlen_attention_causal_bf16_d64(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                                 const unsigned int *__restrict__ cu, const int heads, const float scale_log2) {
    attention<2, true, false, true>(qkv, out, cu, heads, scale_log2, TrainArgs{});
}

// ------------------------------------------------------------------------------------ training
// Training attention (src/gpu/train_attention.rs runs these; src/nn/flash_attention.rs is the op):
// every cell of a batch has the same length `len` (cu holds c x len), dropout on the
// probabilities, and FlashAttention-2's backward pass, so no len x len tensor is ever written.

// The forward pass: the kernel above with the dropout and each row's lse kept.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
train_attention_fwd_bf16_d64(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                             const unsigned int *__restrict__ cu, const int heads, const float scale_log2, float *__restrict__ lse,
                             const int has_mask, const unsigned long long key, const unsigned int threshold16, const float drop_scale) {
    attention<2, true, true>(qkv, out, cu, heads, scale_log2, TrainArgs{lse, has_mask, key, threshold16, drop_scale});
}

// Before the backward pass: dsum[(cell x heads + head) x len + q] = sum over the head's 64 values
// of dO * O at token (cell x len + q) (FlashAttention-2's D: with dropout, rowsum(dP * P) is
// still dO . O, as O = (P * M) V and dP = (dO V^T) * M). One warp a (token, head).
extern "C" __global__ void train_attention_dsum_bf16(const __nv_bfloat16 *__restrict__ dout, const __nv_bfloat16 *__restrict__ out,
                                                     float *__restrict__ dsum, const unsigned long long tokens, const int heads, const int len) {
    const unsigned long long w = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= tokens * heads) return;
    const unsigned long long token = w / heads;
    const int head = (int)(w % heads);
    const size_t at = token * (size_t)heads * HD + head * HD + lane * 2;
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(dout + at));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(out + at));
    float v = a.x * b.x + a.y * b.y;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) {
        const unsigned long long cell = token / len, q = token % len;
        dsum[(cell * heads + head) * len + q] = v;
    }
}

// dQ (f32, summed by the backward blocks) into its columns of dqkv (bf16): n = tokens x heads x 64
extern "C" __global__ void train_attention_dq_bf16(const float *__restrict__ dq, __nv_bfloat16 *__restrict__ dqkv, const unsigned long long n,
                                                   const int heads) {
    const unsigned long long i = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (i >= n) return;
    const unsigned long long width = (unsigned long long)heads * HD;
    const unsigned long long token = i / width, col = i % width;
    *reinterpret_cast<__nv_bfloat162 *>(dqkv + token * 3 * width + col) = __floats2bfloat162_rn(dq[i], dq[i + 1]);
}

// The backward pass (FlashAttention-2, Algorithm 2): a block takes 64 keys of one head of one cell
// (grid: ceil(len / 64), heads, cells), a warp 16 of them, and walks every tile of 64 queries:
//   S^T = K Q^T, P^T = 2^(S^T scale_log2 - lse), dV += (P * M)^T dO, dP^T = V dO^T,
//   dS^T = scale P^T * (dP^T * M - D), dK += dS^T Q, dQ += dS K (dS^T through shared memory;
//   dQ added into f32 with atomics, as FlashAttention-2 does; two columns an atomic on Hopper).
// The next tile's Q and dO rows, lse and D are copied with cp.async into a second buffer while the
// current tile is used (dynamic shared memory, 55 KB: two blocks an SM at up to 255 registers).
// The warp holds S^T and its followers in registers, keys as rows, queries as columns. Key and
// query rows are laid out in shared memory so that a lane's four values of an 8-column tile (rows
// g, g + 8; columns 2 t, 2 t + 1) are keys (c, c + 1) and queries (q, q + 8): the group of the
// dropout rule (attention_common.cuh), one draw for the four, as in the forward pass. Within each
// 16 rows: key slot r holds key 2 r (r < 8) or 2 (r - 8) + 1; query slot r holds query r / 2 (r
// even) or r / 2 + 8 (r odd).
// dK and dV (scaled as the gradients of the unscaled q and k) go to their columns of dqkv; dq is
// f32 (tokens x heads x 64), zeroed before.
// dst[0] += a, dst[1] += b (dst 8-byte aligned): one vector atomic on Hopper, two before
__device__ __forceinline__ void add2(float *dst, const float a, const float b) {
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(a, b));
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}
// 4 bytes global -> shared, asynchronously; zero-filled when !valid
__device__ __forceinline__ void copy4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
// Shared memory of the backward kernel: K, dS^T, two Q and two dO tiles, two lse and two D rows.
#define TRAIN_BWD_SHARED (6 * 64 * LD * 2 + 4 * 64 * 4)
__device__ __forceinline__ int key_of_slot(int r) { return (r & ~15) + ((r & 15) < 8 ? 2 * (r & 7) : 2 * (r & 7) + 1); }
__device__ __forceinline__ int query_of_slot(int r) { return (r & ~15) + ((r & 1) ? ((r & 15) >> 1) + 8 : (r & 15) >> 1); }

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
train_attention_bwd_bf16_d64(const __nv_bfloat16 *__restrict__ qkv, const __nv_bfloat16 *__restrict__ dout, const float *__restrict__ lse,
                             const float *__restrict__ dsum, float *__restrict__ dq, __nv_bfloat16 *__restrict__ dqkv, const int len,
                             const int heads, const float scale_log2, const float scale, const int has_mask, const unsigned long long key,
                             const unsigned int threshold16, const float drop_scale) {
    constexpr int T = 64;  // keys a block, queries a tile
    const int head = blockIdx.y, cell = blockIdx.z, k0 = blockIdx.x * T;
    const unsigned long long bh = (unsigned long long)cell * heads + head;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
    const size_t row_stride = (size_t)3 * heads * HD, o_stride = (size_t)heads * HD;
    const size_t start = (size_t)cell * len;
    const __nv_bfloat16 *q_base = qkv + start * row_stride + head * HD;
    const __nv_bfloat16 *o_base = dout + start * o_stride + head * HD;
    const float *lse_bh = lse + bh * len, *d_bh = dsum + bh * len;

    // dynamic shared memory (TRAIN_BWD_SHARED bytes): K, two buffers of Q and dO tiles, dS^T (V
    // staged there first), and two buffers of the tile's lse and D
    extern __shared__ __align__(128) unsigned char train_bwd_smem[];
    __nv_bfloat16 *sm = reinterpret_cast<__nv_bfloat16 *>(train_bwd_smem);
    __nv_bfloat16 *ks = sm, *dss = sm + T * LD;
    // buffer b: Q at sm + (2 + b) T LD, dO at sm + (4 + b) T LD; lse at rows + b T, D at rows + (2 + b) T
    float *rows = reinterpret_cast<float *>(sm + 6 * T * LD);
    auto qs_buf = [&](const int b) { return sm + (2 + b) * T * LD; };
    auto os_buf = [&](const int b) { return sm + (4 + b) * T * LD; };
    // tile t's Q and dO rows (their slots) and its rows' lse and D into buffer t % 2, asynchronously;
    // rows past the end are zeros (a zero lse there is harmless: those rows' Q and dO are zero, so
    // they add nothing to dV, dS or dK, and their dQ is not written)
    auto stage = [&](const int t) {
        const int q0 = t * T, buf = t & 1;
        for (int i = tid; i < T * (HD / 8); i += WARPS * 32) {
            const int r = i / (HD / 8), c = i % (HD / 8);
            const int q = q0 + query_of_slot(r);
            const bool ok = q < len;
            copy16(qs_buf(buf) + r * LD + c * 8, q_base + (size_t)(ok ? q : 0) * row_stride + c * 8, ok);
            copy16(os_buf(buf) + r * LD + c * 8, o_base + (size_t)(ok ? q : 0) * o_stride + c * 8, ok);
        }
        if (tid < T) {
            const int q = q0 + query_of_slot(tid);
            const bool ok = q < len;
            copy4(rows + buf * T + tid, lse_bh + (ok ? q : 0), ok);
            copy4(rows + (2 + buf) * T + tid, d_bh + (ok ? q : 0), ok);
        }
        copy_commit();
    };

    // K (its slots) into ks, V into dss for now
    for (int i = tid; i < T * (HD / 8); i += WARPS * 32) {
        const int r = i / (HD / 8), c = i % (HD / 8);
        const int k = k0 + key_of_slot(r);
        const bool ok = k < len;
        const __nv_bfloat16 *row = q_base + (size_t)(ok ? k : 0) * row_stride + c * 8;
        copy16(ks + r * LD + c * 8, row + heads * HD, ok);
        copy16(dss + r * LD + c * 8, row + 2 * heads * HD, ok);
    }
    copy_commit();
    stage(0);
    copy_wait_all_but_one();
    __syncthreads();
    uint32_t kf[HD / 16][4], vf[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        ldsm4(kf[kk], ks + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
        ldsm4(vf[kk], dss + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
    }
    // this lane's keys (rows g and g + 8 of the warp's 16): c0 and c0 + 1
    const int c0 = k0 + key_of_slot(warp * 16 + g);
    const bool key0 = c0 < len, key1 = c0 + 1 < len;

    // acc (the warp's 16 key rows x 64 query slots) = a (its 16 rows, A fragments) times the
    // tile's 64 slot rows transposed: S^T = K Q^T and dP^T = V dO^T (one row tile)
    auto by_slots = [&](float (&acc)[T / 8][4], const uint32_t (&a)[HD / 16][4], const __nv_bfloat16 *tile) {
        times_rows_t<1, T / 8>(reinterpret_cast<float(&)[1][T / 8][4]>(acc), reinterpret_cast<const uint32_t(&)[1][HD / 16][4]>(a), tile, lane);
    };

    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; d++) dk[d][0] = dk[d][1] = dk[d][2] = dk[d][3] = dv[d][0] = dv[d][1] = dv[d][2] = dv[d][3] = 0.f;

    const int tiles = (len + T - 1) / T;
    for (int t = 0; t < tiles; t++) {
        const int q0 = t * T;
        // tile t has landed, and every warp is done with tile t - 1 (its buffer, and dss; the V
        // staging on the first tile): stage tile t + 1 into the other buffer while computing
        copy_wait_all();
        __syncthreads();
        if (t + 1 < tiles) stage(t + 1);
        const __nv_bfloat16 *qs = qs_buf(t & 1), *os = os_buf(t & 1);
        const float *lse_s = rows + (t & 1) * T, *d_s = rows + (2 + (t & 1)) * T;

        // S^T (16 keys x 64 query slots), then P^T in place
        float p[T / 8][4];
        by_slots(p, kf, qs);
        // the dropout multipliers of the four values (keys c0, c0 + 1; query slots 2 t, 2 t + 1)
        float km[T / 8][4];
#pragma unroll
        for (int j = 0; j < T / 8; j++) {
            const int slot = j * 8 + tig * 2;
            const float l0 = lse_s[slot], l1 = lse_s[slot + 1];
            p[j][0] = key0 ? exp2_ftz(fmaf(p[j][0], scale_log2, -l0)) : 0.f;
            p[j][1] = key0 ? exp2_ftz(fmaf(p[j][1], scale_log2, -l1)) : 0.f;
            p[j][2] = key1 ? exp2_ftz(fmaf(p[j][2], scale_log2, -l0)) : 0.f;
            p[j][3] = key1 ? exp2_ftz(fmaf(p[j][3], scale_log2, -l1)) : 0.f;
            if (has_mask) {
                const int q = q0 + query_of_slot(slot);  // and q + 8 for slot + 1
                const unsigned long long bits = attn_group_bits(key, bh, q, c0, len);
                km[j][0] = attn_keep(bits, q, c0, threshold16, drop_scale);
                km[j][1] = attn_keep(bits, q + 8, c0, threshold16, drop_scale);
                km[j][2] = attn_keep(bits, q, c0 + 1, threshold16, drop_scale);
                km[j][3] = attn_keep(bits, q + 8, c0 + 1, threshold16, drop_scale);
            } else {
                km[j][0] = km[j][1] = km[j][2] = km[j][3] = 1.f;
            }
        }
        // dV += (P * M)^T dO: the dropped P^T is the A operand (k = query slots)
#pragma unroll
        for (int kk = 0; kk < T / 16; kk++) {
            uint32_t a[4];
            a[0] = pack(p[2 * kk][0] * km[2 * kk][0], p[2 * kk][1] * km[2 * kk][1]);
            a[1] = pack(p[2 * kk][2] * km[2 * kk][2], p[2 * kk][3] * km[2 * kk][3]);
            a[2] = pack(p[2 * kk + 1][0] * km[2 * kk + 1][0], p[2 * kk + 1][1] * km[2 * kk + 1][1]);
            a[3] = pack(p[2 * kk + 1][2] * km[2 * kk + 1][2], p[2 * kk + 1][3] * km[2 * kk + 1][3]);
#pragma unroll
            for (int d = 0; d < HD / 8; d += 2) {
                uint32_t b[4];
                ldsm4_t(b, os + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + (d + lane / 16) * 8);
                mma(dv[d], a, b[0], b[1]);
                mma(dv[d + 1], a, b[2], b[3]);
            }
        }
        // dP^T = V dO^T, then dS^T = scale P^T * (dP^T * M - D) in place
        float ds[T / 8][4];
        by_slots(ds, vf, os);
#pragma unroll
        for (int j = 0; j < T / 8; j++) {
            const int slot = j * 8 + tig * 2;
            const float d0 = d_s[slot], d1 = d_s[slot + 1];
            ds[j][0] = scale * p[j][0] * (ds[j][0] * km[j][0] - d0);
            ds[j][1] = scale * p[j][1] * (ds[j][1] * km[j][1] - d1);
            ds[j][2] = scale * p[j][2] * (ds[j][2] * km[j][2] - d0);
            ds[j][3] = scale * p[j][3] * (ds[j][3] * km[j][3] - d1);
        }
        // dK += dS^T Q; dS^T to shared memory for dQ
#pragma unroll
        for (int kk = 0; kk < T / 16; kk++) {
            uint32_t a[4];
            a[0] = pack(ds[2 * kk][0], ds[2 * kk][1]);
            a[1] = pack(ds[2 * kk][2], ds[2 * kk][3]);
            a[2] = pack(ds[2 * kk + 1][0], ds[2 * kk + 1][1]);
            a[3] = pack(ds[2 * kk + 1][2], ds[2 * kk + 1][3]);
            *reinterpret_cast<uint32_t *>(dss + (warp * 16 + g) * LD + kk * 16 + tig * 2) = a[0];
            *reinterpret_cast<uint32_t *>(dss + (warp * 16 + g + 8) * LD + kk * 16 + tig * 2) = a[1];
            *reinterpret_cast<uint32_t *>(dss + (warp * 16 + g) * LD + kk * 16 + 8 + tig * 2) = a[2];
            *reinterpret_cast<uint32_t *>(dss + (warp * 16 + g + 8) * LD + kk * 16 + 8 + tig * 2) = a[3];
#pragma unroll
            for (int d = 0; d < HD / 8; d += 2) {
                uint32_t b[4];
                ldsm4_t(b, qs + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + (d + lane / 16) * 8);
                mma(dk[d], a, b[0], b[1]);
                mma(dk[d + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();
        // dQ for query slots 16 warp .. 16 warp + 15 = dS (slots x 64 keys) K: dS read back
        // transposed from dss (keys x query slots)
        float dqa[HD / 8][4];
#pragma unroll
        for (int d = 0; d < HD / 8; d++) dqa[d][0] = dqa[d][1] = dqa[d][2] = dqa[d][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < T / 16; kk++) {
            uint32_t a[4];
            ldsm4_t(a, dss + (kk * 16 + (lane / 16) * 8 + lane % 8) * LD + warp * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
            for (int d = 0; d < HD / 8; d += 2) {
                uint32_t b[4];
                ldsm4_t(b, ks + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD + (d + lane / 16) * 8);
                mma(dqa[d], a, b[0], b[1]);
                mma(dqa[d + 1], a, b[2], b[3]);
            }
        }
        const int qa = q0 + query_of_slot(warp * 16 + g), qb = q0 + query_of_slot(warp * 16 + g + 8);
#pragma unroll
        for (int d = 0; d < HD / 8; d++) {
            const int col = head * HD + d * 8 + tig * 2;
            if (qa < len) add2(dq + (start + qa) * o_stride + col, dqa[d][0], dqa[d][1]);
            if (qb < len) add2(dq + (start + qb) * o_stride + col, dqa[d][2], dqa[d][3]);
        }
    }
    // dK and dV of this lane's keys (c0: rows g; c0 + 1: rows g + 8) into dqkv
#pragma unroll
    for (int d = 0; d < HD / 8; d++) {
        const int col = head * HD + d * 8 + tig * 2;
        if (key0) {
            __nv_bfloat16 *row = dqkv + (start + c0) * row_stride + col;
            *reinterpret_cast<uint32_t *>(row + heads * HD) = pack(dk[d][0], dk[d][1]);
            *reinterpret_cast<uint32_t *>(row + 2 * heads * HD) = pack(dv[d][0], dv[d][1]);
        }
        if (key1) {
            __nv_bfloat16 *row = dqkv + (start + c0 + 1) * row_stride + col;
            *reinterpret_cast<uint32_t *>(row + heads * HD) = pack(dk[d][2], dk[d][3]);
            *reinterpret_cast<uint32_t *>(row + 2 * heads * HD) = pack(dv[d][2], dv[d][3]);
        }
    }
}
