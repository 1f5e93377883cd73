// Helpers of the Hopper (sm_90a) kernels that run on the warpgroup matrix instructions
// (varlen_attention_sm90.cu, gemm_layer_norm_sm90.cu): asynchronous copies into shared memory,
// wgmma's fences, and the 128-byte-swizzled tile layout with its matrix descriptors.
//
// A tile in shared memory is rows of 64 bf16 (128 bytes); 16-byte chunk c of row r is stored at
// chunk c ^ (r % 8) ("128-byte swizzle"). Tiles start on 1024-byte boundaries. A K-major operand
// advances 32 bytes a 16-wide k step, its 8-row groups 1024 bytes apart.
#pragma once

#include "attention_common.cuh"

namespace sm90 {

__device__ __forceinline__ void copy16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// until at most N copy groups are in flight
template <int N> __device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// cp.async writes through the generic proxy; wgmma reads through the async proxy
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// keeps the compiler from touching accumulator registers across an asynchronous matrix product
__device__ __forceinline__ void pin(float &r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void pin(uint32_t &r) { asm volatile("" : "+r"(r)::"memory"); }

// A TMA tensor map (CUtensorMap, made on the host by cuTensorMapEncodeTiled), passed by value as
// a __grid_constant__ kernel parameter; its address is what the bulk tensor copies take.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// mbarriers in shared memory: `count` arrivals (plus the transaction bytes announced) complete a
// phase; waits name the phase's parity
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory"); }
// one arrival that also announces `bytes` of bulk copies that will complete on this barrier
__device__ __forceinline__ void mbar_expect(uint32_t bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// a 2-D box of a tensor map into shared memory (coordinates innermost first), completing on `bar`
__device__ __forceinline__ void tma_load(uint32_t dst, const TensorMap &map, int c0, int c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// a 2-D box from shared memory out to a tensor map (rows past the tensor's end are dropped)
__device__ __forceinline__ void tma_store(const TensorMap &map, int c0, int c1, uint32_t src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(reinterpret_cast<uint64_t>(&map)),
                 "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// until this thread's bulk stores have read their shared memory (READ) or are written (!READ)
template <bool READ> __device__ __forceinline__ void bulk_wait() {
    if (READ)
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// until at most N committed wgmma groups are in flight
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// shared-memory matrix descriptor, 128-byte swizzle
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lead, uint32_t stride) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lead & 0x3FFFF) >> 4) << 16) | ((uint64_t)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// byte offset of 16-byte chunk c of row r in a swizzled tile
__device__ __forceinline__ uint32_t swz(int r, int c) { return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4)); }

}  // namespace sm90
