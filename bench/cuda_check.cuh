// What the bench harnesses (attention_kernels.cu, layer_norm_kernels.cu,
// gemm_layer_norm_kernels.cu) share. CK(call): a CUDA runtime call; on an error, prints where and
// what, and exits 1. compare(): a kernel's bf16 answer against an f32 reference. tensor_map(): a
// TMA tensor map as the Hopper kernels take it (tensor_map<sm90::TensorMap>(...)).
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cstring>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e = (x);                                                                   \
        if (e != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

// relative L2 error (|got - want| / |want|) and largest absolute difference
struct Agreement {
    double rel_l2, max_abs;
};
inline Agreement compare(const std::vector<__nv_bfloat16> &got, const std::vector<float> &want) {
    double num = 0, den = 0, worst = 0;
    for (size_t i = 0; i < want.size(); i++) {
        const double d = (double)__bfloat162float(got[i]) - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
        worst = fmax(worst, fabs(d));
    }
    return {sqrt(num / den), worst};
}

// a 2-D bf16 tensor map (inner x outer elements, rows inner * 2 bytes apart), boxes of
// box_inner x box_outer, 128-byte swizzle, zero fill past the end: what gpu/gemm_layer_norm.rs
// makes with cudarc
template <class Map> Map tensor_map(const void *p, uint64_t inner, uint64_t outer, uint32_t box_inner, uint32_t box_outer) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&encode, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess) {
            fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
            exit(1);
        }
    }
    CUtensorMap m;
    const cuuint64_t dims[2] = {inner, outer}, strides[1] = {inner * 2};
    const cuuint32_t box[2] = {box_inner, box_outer}, unit[2] = {1, 1};
    const CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(p), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled: error %d\n", (int)r);
        exit(1);
    }
    static_assert(sizeof(Map) == sizeof(CUtensorMap), "a tensor map is 128 bytes");
    Map out;
    memcpy(&out, &m, sizeof out);
    return out;
}
