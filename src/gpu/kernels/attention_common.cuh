// Helpers the two attention kernels share (varlen_attention.cu, varlen_attention_sm90.cu).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// 2^x in one instruction (exp2f adds a range check and two multiplies around it to keep
// subnormal results, which softmax weights below 2^-126 do not need)
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// two floats as a bf16 pair (lo in the low half)
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

// A block's share of the grid (row blocks, heads, cells): query rows q0 .. q0 + rows - 1 of one
// head of one cell whose tokens start at row `start` of the packed batch.
struct BlockWork {
    int head, start, len, q0;
};
__device__ __forceinline__ BlockWork block_work(const unsigned int *cu, int rows) {
    const int cell = blockIdx.z;
    const int start = cu[cell];
    return {(int)blockIdx.y, start, (int)cu[cell + 1] - start, (int)blockIdx.x * rows};
}

// Training attention's dropout mask (src/nn/dropout.rs, Mask::keeps_attention holds the rule and
// its CPU twin): the probability of query q and key c of row block bh (cell x heads + head) in
// sequences of len tokens. The four elements (q, q + 8) x (c, c + 1), q % 16 < 8 and c even, share
// one SplitMix64 draw of 64 bits, 16 bits each: exactly the four values one lane holds of an
// mma.sync accumulator tile in the forward pass (rows g, g + 8; columns 2 t, 2 t + 1), and in the
// backward pass once its key and query rows are laid out in shared memory in that order.
__device__ __forceinline__ unsigned long long attn_group_bits(const unsigned long long key, const unsigned long long bh, const int q,
                                                              const int c, const int len) {
    const unsigned long long len16 = (unsigned long long)((len + 15) & ~15), pairs = (unsigned long long)((len + 1) / 2);
    const unsigned long long group = (bh * len16 + (unsigned long long)(q & ~8)) * pairs + (unsigned long long)(c >> 1);
    unsigned long long z = key + (group + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// the multiplier of (q, c) from its group's bits: scale when its 16-bit draw is below threshold16
__device__ __forceinline__ float attn_keep(const unsigned long long bits, const int q, const int c, const unsigned int threshold16,
                                           const float scale) {
    const unsigned int draw = (unsigned int)(bits >> (16 * (((q >> 3) & 1) * 2 + (c & 1)))) & 0xffffu;
    return draw < threshold16 ? scale : 0.f;
}
