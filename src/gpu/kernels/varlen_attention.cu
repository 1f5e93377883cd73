// Variable-length (packed) softmax attention for encoders, bf16 in and out, f32 softmax and
// accumulation, head dimension 64, no mask inside a sequence (what BERT-style encoders need once
// padding is gone). The algorithm is FlashAttention's online softmax (Dao et al., "FlashAttention:
// Fast and Memory-Efficient Exact Attention with IO-Awareness", NeurIPS 2022; FlashAttention-2,
// arXiv:2307.08691): tiles of 64 keys stream through shared memory, each query row keeps its
// running max and sum, and the batch x heads x s x s score tensor is never written.
//
// Layout (src/gpu/varlen_attention.rs builds it):
//   qkv  (tokens, 3 * heads * 64): each row is [q heads | k heads | v heads], the output of one
//        fused QKV projection; the cells of a batch follow each other without padding;
//   cu   (cells + 1): cell c owns tokens cu[c] .. cu[c + 1];
//   out  (tokens, heads * 64).
// Grid: (ceil(longest / 64), heads, cells); a block of 4 warps takes 64 query rows of one head of
// one cell, each warp 16 rows. Matrix products run on tensor cores through WMMA (16 x 16 x 16);
// the output accumulates in registers, rescaled row by row through a map of the accumulator
// fragment's rows (WMMA does not document its layout, so the kernel measures it at start).
// Shared tiles have padded rows and the softmax reads them rotated by lane, so the 32 lanes of a
// warp hit 32 different banks (the first version, without this, ran 2.5x slower end to end).

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;

#define HD 64
#define TILE 64
#define WARPS 4
// padded leading dimensions (in elements) so that rows of a shared tile start on different banks
#define SLD 68  // f32 scores and output, per warp
#define KLD 72  // bf16 key/value tiles, queries and probabilities

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

extern "C" __global__ void __launch_bounds__(WARPS * 32)
varlen_attention_bf16_d64(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out,
                          const unsigned int *__restrict__ cu, const int heads, const float scale_log2) {
    const int cell = blockIdx.z;
    const int head = blockIdx.y;
    const int start = cu[cell];
    const int len = cu[cell + 1] - start;
    const int q0 = blockIdx.x * TILE;
    if (q0 >= len) return;

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const size_t row_stride = (size_t)3 * heads * HD;
    const size_t out_stride = (size_t)heads * HD;

    // per warp: 16 rows of scores (f32), reused for the final output; 16 rows of probabilities
    // (bf16), first used for the query rows; the key and value tiles; each row's rescale factor
    __shared__ __align__(32) float sbuf[WARPS][16 * SLD];
    __shared__ __align__(32) __nv_bfloat16 pbuf[WARPS][16 * KLD];
    __shared__ __align__(32) __nv_bfloat16 ks[TILE * KLD];
    __shared__ __align__(32) __nv_bfloat16 vs[TILE * KLD];
    __shared__ float alpha_s[WARPS][16];

    float *sw = sbuf[warp];
    __nv_bfloat16 *pw = pbuf[warp];

    // Which row of the 16 x 16 tile each element of an accumulator fragment holds: WMMA leaves
    // the layout to the implementation, so load a tile whose values are their row numbers.
    for (int i = lane; i < 16 * 16; i += 32) sw[(i / 16) * SLD + i % 16] = (float)(i / 16);
    __syncwarp();
    Acc rowmap;
    wmma::load_matrix_sync(rowmap, sw, SLD, wmma::mem_row_major);
    __syncwarp();

    // this warp's 16 query rows (zeros past the cell) through shared memory into fragments
    for (int i = lane; i < 16 * (HD / 8); i += 32) {
        const int r = i / (HD / 8), c = i % (HD / 8);
        const int q = q0 + warp * 16 + r;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (q < len) v = *reinterpret_cast<const uint4 *>(qkv + (size_t)(start + q) * row_stride + head * HD + c * 8);
        *reinterpret_cast<uint4 *>(pw + r * KLD + c * 8) = v;
    }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> qf[HD / 16];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) wmma::load_matrix_sync(qf[kk], pw + kk * 16, KLD);

    Acc of[HD / 16];
#pragma unroll
    for (int nt = 0; nt < HD / 16; ++nt) wmma::fill_fragment(of[nt], 0.f);
    // two lanes a row: lane holds row r's columns h * 32 + ((j + lane) & 31), j < 32 (the
    // rotation by lane keeps the 32 lanes on 32 different shared-memory banks), and the row's
    // running max and sum
    const int r = lane >> 1, h = lane & 1;
    float m_r = -INFINITY, l_r = 0.f;

    for (int k0 = 0; k0 < len; k0 += TILE) {
        __syncthreads();  // every warp is done with the previous tiles
        for (int i = threadIdx.x; i < TILE * (HD / 8); i += WARPS * 32) {
            const int kr = i / (HD / 8), c = i % (HD / 8);
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (k0 + kr < len) {
                const __nv_bfloat16 *row = qkv + (size_t)(start + k0 + kr) * row_stride + head * HD + c * 8;
                kv = *reinterpret_cast<const uint4 *>(row + heads * HD);
                vv = *reinterpret_cast<const uint4 *>(row + 2 * heads * HD);
            }
            *reinterpret_cast<uint4 *>(ks + kr * KLD + c * 8) = kv;
            *reinterpret_cast<uint4 *>(vs + kr * KLD + c * 8) = vv;
        }
        __syncthreads();

        // S = Q K^T for 16 rows x 64 keys
        Acc sf[TILE / 16];
#pragma unroll
        for (int nt = 0; nt < TILE / 16; ++nt) wmma::fill_fragment(sf[nt], 0.f);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < TILE / 16; ++nt) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, ks + nt * 16 * KLD + kk * 16, KLD);
                wmma::mma_sync(sf[nt], qf[kk], kf, sf[nt]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < TILE / 16; ++nt) wmma::store_matrix_sync(sw + nt * 16, sf[nt], SLD, wmma::mem_row_major);
        __syncwarp();

        // online softmax of this tile: the row's max, then the probabilities and their sum
        float mx = -INFINITY;
#pragma unroll 4
        for (int j = 0; j < 32; ++j) {
            const int c = h * 32 + ((j + lane) & 31);
            if (k0 + c < len) mx = fmaxf(mx, sw[r * SLD + c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1)) * scale_log2;
        const float m_new = fmaxf(m_r, mx);
        const float alpha = exp2f(m_r - m_new);
        float sum = 0.f;
#pragma unroll 4
        for (int j = 0; j < 32; ++j) {
            const int c = h * 32 + ((j + lane) & 31);
            const float e = k0 + c < len ? exp2f(sw[r * SLD + c] * scale_log2 - m_new) : 0.f;
            sum += e;
            pw[r * KLD + c] = __float2bfloat16(e);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l_r = l_r * alpha + sum;
        m_r = m_new;
        if (h == 0) alpha_s[warp][r] = alpha;
        __syncwarp();

        // O = O * alpha (per row) + P V, the output kept in registers
#pragma unroll
        for (int nt = 0; nt < HD / 16; ++nt)
#pragma unroll
            for (int i = 0; i < of[nt].num_elements; ++i) of[nt].x[i] *= alpha_s[warp][(int)rowmap.x[i]];
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> pf[TILE / 16];
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) wmma::load_matrix_sync(pf[kk], pw + kk * 16, KLD);
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
#pragma unroll
            for (int nt = 0; nt < HD / 16; ++nt) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, vs + kk * 16 * KLD + nt * 16, KLD);
                wmma::mma_sync(of[nt], pf[kk], vf, of[nt]);
            }
        }
    }

    // out = O / l
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < HD / 16; ++nt) wmma::store_matrix_sync(sw + nt * 16, of[nt], SLD, wmma::mem_row_major);
    __syncwarp();
    const int q = q0 + warp * 16 + r;
    if (q < len) {
        const float inv = 1.f / l_r;
        __nv_bfloat16 *dst = out + (size_t)(start + q) * out_stride + head * HD;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            const int c = h * 32 + ((j + lane) & 31);
            dst[c] = __float2bfloat16(sw[r * SLD + c] * inv);
        }
    }
}
