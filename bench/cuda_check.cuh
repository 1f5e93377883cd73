// What the bench harnesses (attention_kernels.cu, layer_norm_kernels.cu,
// gemm_layer_norm_kernels.cu) share. CK(call): a CUDA runtime call; on an error, prints where and
// what, and exits 1. compare(): a kernel's bf16 answer against an f32 reference.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>

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
