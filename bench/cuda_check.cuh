// CK(call): a CUDA runtime call in the bench harnesses (attention_kernels.cu,
// layer_norm_kernels.cu); on an error, prints where and what, and exits 1.
#pragma once
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e = (x);                                                                   \
        if (e != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
