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
