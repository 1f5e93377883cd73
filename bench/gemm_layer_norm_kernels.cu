// The fused product + residual + layer norm (src/gpu/kernels/gemm_layer_norm_sm90.cu) alone, on
// the device: its answer against a plain f32 reference (one block a row), and its time against
// the layer-norm kernel it replaces (encoder_ops.cu layer_norm_bf16, on the same rows) and
// against a device-to-device copy of the bytes it must move (A and x read, x written), at the
// shapes of Geneformer V1 (N = 256; k = 256 and 512) with the token count of its longest batch in
// the encoder benchmark, and short counts for the edges (a block partly past the end, one row).
//
//   scripts/build-cuda.sh                        # builds dist/cuda/gemm_layer_norm_kernels
//   dist/cuda/gemm_layer_norm_kernels            # on an sm_90 GPU
#include "../src/gpu/kernels/gemm_layer_norm_sm90.cu"
#include "../src/gpu/kernels/encoder_ops.cu"

#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda_check.cuh"

// out[row] = LayerNorm(x[row] + a[row] W^T + bias) * gamma + beta in f32; blockDim.x == n
__global__ void reference(const __nv_bfloat16 *a, const __nv_bfloat16 *w, const __nv_bfloat16 *bias, const __nv_bfloat16 *gamma,
                          const __nv_bfloat16 *beta, const __nv_bfloat16 *x, float *out, int n, int k, float eps) {
    const int row = blockIdx.x, col = threadIdx.x;
    __shared__ float part[512];
    float v = __bfloat162float(bias[col]) + __bfloat162float(x[(size_t)row * n + col]);
    for (int i = 0; i < k; i++) v += __bfloat162float(a[(size_t)row * k + i]) * __bfloat162float(w[(size_t)col * k + i]);
    part[col] = v;
    __syncthreads();
    float mean = 0.f;
    for (int i = 0; i < n; i++) mean += part[i];
    mean /= n;
    float var = 0.f;
    for (int i = 0; i < n; i++) var += (part[i] - mean) * (part[i] - mean);
    var /= n;
    out[(size_t)row * n + col] = (v - mean) * rsqrtf(var + eps) * __bfloat162float(gamma[col]) + __bfloat162float(beta[col]);
}

static unsigned long long rng = 0x5eed;  // seed of every random value below
static float uniform() {                 // [-1, 1)
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return ((rng >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}
static __nv_bfloat16 *upload(size_t n, float scale, float offset) {
    std::vector<__nv_bfloat16> h(n);
    for (auto &v : h) v = __float2bfloat16(offset + scale * uniform());
    __nv_bfloat16 *d;
    CK(cudaMalloc(&d, n * 2));
    CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}

int main() {
    struct Shape {
        const char *name;
        int tokens, n, k;
    } shapes[] = {{"v1_out_proj", 130721, 256, 256}, {"v1_ffn2", 130721, 256, 512}, {"v1_short", 1000, 256, 512}, {"v1_one_row", 1, 256, 256}};
    const float eps = 1e-12f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int reps = 20;
    auto time = [&](auto &&launch) {
        launch();
        CK(cudaEventRecord(e0));
        for (int i = 0; i < reps; i++) launch();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        CK(cudaGetLastError());
        return ms / reps;
    };
    CK(cudaFuncSetAttribute(gemm_bias_residual_layer_norm_n256_tma_sm90, cudaFuncAttributeMaxDynamicSharedMemorySize, sm90::kPlnSmem));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (auto &sh : shapes) {
        const size_t t = sh.tokens, n = sh.n, k = sh.k;
        // activations ~ what the layers see: a of unit scale, W ~ 1/sqrt(k), x of unit scale
        __nv_bfloat16 *a = upload(t * k, 1.0f, 0.f), *w = upload(n * k, 1.7f / sqrtf((float)k), 0.f), *bias = upload(n, 0.1f, 0.f),
                      *gamma = upload(n, 0.2f, 1.f), *beta = upload(n, 0.1f, 0.f), *x0 = upload(t * n, 1.0f, 0.f), *x;
        CK(cudaMalloc(&x, t * n * 2));
        float *ref;
        CK(cudaMalloc(&ref, t * n * 4));
        reference<<<t, n>>>(a, w, bias, gamma, beta, x0, ref, n, k, eps);
        CK(cudaGetLastError());
        std::vector<float> r(t * n);
        CK(cudaMemcpy(r.data(), ref, r.size() * 4, cudaMemcpyDeviceToHost));
        const size_t bytes = (t * k + 2 * t * n) * 2;  // read a and x, write x
        const double flops = 2.0 * t * n * k;
        const auto ta = tensor_map<sm90::TensorMap>(a, k, t, 64, 128), tw = tensor_map<sm90::TensorMap>(w, k, n, 64, 256),
                   tx = tensor_map<sm90::TensorMap>(x, n, t, 64, 128);
        const int tiles = (t + sm90::kGemmLnRows - 1) / sm90::kGemmLnRows;
        auto fused = [&] {
            gemm_bias_residual_layer_norm_n256_tma_sm90<<<tiles < sms ? tiles : sms, 384, sm90::kPlnSmem>>>(ta, tw, tx, tx, bias, gamma, beta, t, k, eps);
        };
        CK(cudaMemcpy(x, x0, t * n * 2, cudaMemcpyDeviceToDevice));
        fused();
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<__nv_bfloat16> got(t * n);
        CK(cudaMemcpy(got.data(), x, got.size() * 2, cudaMemcpyDeviceToHost));
        const Agreement agree = compare(got, r);
        const float ms = time(fused);  // in place, so x drifts between runs; the work does not
        printf("%-12s %6d tokens, k %d: fused rel_l2 %.2e max_abs %.2e  %7.1f us (%5.1f TFLOP/s, %5.2f TB/s)\n", sh.name, sh.tokens, sh.k,
               agree.rel_l2, agree.max_abs, ms * 1e3, flops / ms / 1e9, bytes / ms / 1e9);
        // what the fused kernel replaces a part of, and the memory bound
        const float norm = time([&] {
            layer_norm_bf16_p1<<<(t + 31) / 32, 256>>>(x, gamma, beta, t, n, eps);
        });
        __nv_bfloat16 *c0, *c1;
        CK(cudaMalloc(&c0, bytes / 2));
        CK(cudaMalloc(&c1, bytes / 2));
        const float copy = time([&] { CK(cudaMemcpyAsync(c1, c0, bytes / 2, cudaMemcpyDeviceToDevice)); });
        printf("%-12s %6d tokens, k %d: the layer norm alone %6.1f us; a copy of the bytes the fused kernel moves %6.1f us\n", sh.name,
               sh.tokens, sh.k, norm * 1e3, copy * 1e3);
        for (void *p : {(void *)a, (void *)w, (void *)bias, (void *)gamma, (void *)beta, (void *)x0, (void *)x, (void *)ref, (void *)c0, (void *)c1}) cudaFree(p);
    }
    return 0;
}
