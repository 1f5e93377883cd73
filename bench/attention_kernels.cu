// The packed attention kernels alone, on a GPU, without the rest of scfoundry: each
// kernel's answer against a plain f32 reference (one thread a query row, two passes over the
// keys), and its speed in useful TFLOP/s (4 * head_dim * sum over cells of len^2 * heads, real
// tokens only), at the four encoder shapes with real token lengths.
//
//   scripts/build-cuda.sh                                        # builds dist/cuda/attention_kernels
//   dist/cuda/attention_kernels bench/token_lengths_wu2020.txt   # on an sm_90 GPU
//
// Kernels: varlen_attention.cu (mma.sync, every GPU since sm_80) and varlen_attention_sm90.cu
// (wgmma, Hopper; tiles by TMA, and by cp.async the kernel before TMA), with and without maxima
// fixed by the first key tile.
#include "../src/gpu/kernels/varlen_attention_sm90.cu"
#include "../src/gpu/kernels/varlen_attention.cu"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.cuh"

__global__ void reference(const __nv_bfloat16 *qkv, float *out, const unsigned *cu, const int *cell_of, int tokens, int heads, float scale) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * heads) return;
    const int tok = i / heads, h = i % heads;
    const int c = cell_of[tok];
    const size_t rs = (size_t)3 * heads * 64;
    float q[64], o[64];
    for (int d = 0; d < 64; d++) q[d] = __bfloat162float(qkv[tok * rs + h * 64 + d]), o[d] = 0.f;
    float m = -INFINITY;
    for (unsigned k = cu[c]; k < cu[c + 1]; k++) {
        float s = 0.f;
        for (int d = 0; d < 64; d++) s += q[d] * __bfloat162float(qkv[k * rs + heads * 64 + h * 64 + d]);
        m = fmaxf(m, s * scale);
    }
    float l = 0.f;
    for (unsigned k = cu[c]; k < cu[c + 1]; k++) {
        float s = 0.f;
        for (int d = 0; d < 64; d++) s += q[d] * __bfloat162float(qkv[k * rs + heads * 64 + h * 64 + d]);
        const float e = expf(s * scale - m);
        l += e;
        for (int d = 0; d < 64; d++) o[d] += e * __bfloat162float(qkv[k * rs + 2 * heads * 64 + h * 64 + d]);
    }
    for (int d = 0; d < 64; d++) out[(size_t)tok * heads * 64 + h * 64 + d] = o[d] / l;
}

// the kernel before the running maxima were fixed by each block's first key tile (exact online
// softmax every tile), beside the kept one (harness only)
extern "C" __global__ void __launch_bounds__(256, 2)
    sm90_exact_max(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out, const unsigned int *__restrict__ cu,
                   const int heads, const float scale_log2) {
    sm90::attention<2, 96, 2, false>(qkv, out, cu, heads, scale_log2);
}

// the portable kernel with the exact online softmax on every tile (before maxima were fixed)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
    portable_exact_max(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out, const unsigned int *__restrict__ cu,
                       const int heads, const float scale_log2) {
    attention<2, false>(qkv, out, cu, heads, scale_log2);
}

// the kept kernel before its tiles moved by TMA: every thread issues cp.async (harness only)
extern "C" __global__ void __launch_bounds__(256, 2)
    sm90_cp_async(const __nv_bfloat16 *__restrict__ qkv, __nv_bfloat16 *__restrict__ out, const unsigned int *__restrict__ cu,
                  const int heads, const float scale_log2) {
    sm90::attention<2, 96, 2, true>(qkv, out, cu, heads, scale_log2);
}

// TMA with three key/value buffers instead of two (harness only)
extern "C" __global__ void __launch_bounds__(256, 2)
    sm90_tma_3_stages(const __grid_constant__ sm90::TensorMap map, __nv_bfloat16 *__restrict__ out, const unsigned int *__restrict__ cu,
                      const int heads, const float scale_log2) {
    sm90::attention<2, 96, 3, true, true>(nullptr, out, cu, heads, scale_log2, &map);
}

typedef void (*Kernel)(const __nv_bfloat16 *, __nv_bfloat16 *, const unsigned *, int, float);
typedef void (*TmaKernel)(sm90::TensorMap, __nv_bfloat16 *, const unsigned *, int, float);

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TOKEN_LENGTHS_FILE\n", argv[0]);
        return 2;
    }
    std::vector<int> pool;
    {
        FILE *f = fopen(argv[1], "r");
        if (!f) {
            fprintf(stderr, "cannot open %s\n", argv[1]);
            return 2;
        }
        int v;
        while (fscanf(f, "%d", &v) == 1) pool.push_back(v);
        fclose(f);
    }
    struct Shape {
        const char *name;
        int heads, max_len, cells, fixed;
        float late_keys;  // keys from the third tile of 96 on are scaled by this (1: none)
    } shapes[] = {{"geneformer_v1", 4, 2048, 256, 0, 1.f},
                  {"scgpt", 8, 1200, 256, 0, 1.f},
                  {"geneformer_v2", 12, 4096, 128, 0, 1.f},
                  {"uce_33l", 20, 1536, 128, 1072, 1.f},
                  // later keys ~100 binary orders of magnitude above the first tile's scores: the
                  // fixed-maximum kernel must take its exact path and still agree
                  {"v1_late_keys_x40", 4, 2048, 64, 0, 40.f}};
    struct K {
        const char *name;
        Kernel fn;
        int rows, threads, smem;
        bool tma;  // fn takes a tensor map of qkv, not qkv
    } kernels[] = {{"v4_mma_sync", varlen_attention_bf16_d64, 128, 128, 0},
                   {"portable_exact_max", portable_exact_max, 128, 128, 0},
                   {"sm90_tma", (Kernel)varlen_attention_bf16_d64_sm90, 128, 256, sm90::smem_bytes<2, 96, 2>(), true},
                   {"sm90_tma_3_stages", (Kernel)sm90_tma_3_stages, 128, 256, sm90::smem_bytes<2, 96, 3>(), true},
                   {"sm90_cp_async", sm90_cp_async, 128, 256, sm90::smem_bytes<2, 96, 2>()},
                   {"sm90_exact_max", sm90_exact_max, 128, 256, sm90::smem_bytes<2, 96, 2>()},
                   {"sm90_tma_again", (Kernel)varlen_attention_bf16_d64_sm90, 128, 256, sm90::smem_bytes<2, 96, 2>(), true}};
    for (auto &k : kernels) {
        if (k.smem > 0) CK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem));
        int blocks = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k.fn, k.threads, k.smem));
        printf("%-22s %3d threads, %6d bytes of shared memory, %d blocks an SM\n", k.name, k.threads, k.smem, blocks);
    }
    const float scale = 0.125f;
    unsigned long long rng = 0x5eed;  // seed of the random q, k, v values
    for (auto &sh : shapes) {
        std::vector<unsigned> cu(1, 0);
        std::vector<int> cell_of;
        double pairs = 0;
        int longest = 0;
        for (int c = 0; c < sh.cells; c++) {
            int n = sh.fixed ? sh.fixed : pool[(c * 7919) % pool.size()];
            if (n > sh.max_len) n = sh.max_len;
            cu.push_back(cu.back() + n);
            for (int i = 0; i < n; i++) cell_of.push_back(c);
            pairs += (double)n * n;
            longest = n > longest ? n : longest;
        }
        const int tokens = cu.back();
        const size_t width = (size_t)3 * sh.heads * 64;
        std::vector<__nv_bfloat16> h(tokens * width);
        for (auto &x : h) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            const float u = ((rng >> 40) & 0xFFFFFF) / 16777216.0f;  // [0, 1)
            x = __float2bfloat16((u - 0.5f) * 5.0f);                 // peaky softmax rows
        }
        if (sh.late_keys != 1.f)
            for (int c = 0; c < sh.cells; c++)
                for (unsigned t = cu[c] + 192; t < cu[c + 1]; t++)
                    for (int j = 0; j < sh.heads * 64; j++) {
                        __nv_bfloat16 &x = h[t * width + sh.heads * 64 + j];
                        x = __float2bfloat16(__bfloat162float(x) * sh.late_keys);
                    }
        __nv_bfloat16 *dq, *dout;
        float *dref;
        unsigned *dcu;
        int *dcell;
        CK(cudaMalloc(&dq, h.size() * 2));
        CK(cudaMalloc(&dout, (size_t)tokens * sh.heads * 64 * 2));
        CK(cudaMalloc(&dref, (size_t)tokens * sh.heads * 64 * 4));
        CK(cudaMalloc(&dcu, cu.size() * 4));
        CK(cudaMalloc(&dcell, cell_of.size() * 4));
        CK(cudaMemcpy(dq, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dcell, cell_of.data(), cell_of.size() * 4, cudaMemcpyHostToDevice));
        reference<<<(tokens * sh.heads + 127) / 128, 128>>>(dq, dref, dcu, dcell, tokens, sh.heads, scale);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<float> ref((size_t)tokens * sh.heads * 64);
        CK(cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost));
        const double flops = 4.0 * 64 * pairs * sh.heads;
        printf("%s: %d cells, %d tokens (longest %d), %d heads\n", sh.name, sh.cells, tokens, longest, sh.heads);
        const auto map = tensor_map<sm90::TensorMap>(dq, width, tokens, 64, 32);
        for (auto &k : kernels) {
            dim3 grid((longest + k.rows - 1) / k.rows, sh.heads, sh.cells);
            auto launch = [&] {
                if (k.tma)
                    ((TmaKernel)k.fn)<<<grid, k.threads, k.smem>>>(map, dout, dcu, sh.heads, scale * 1.4426950408889634f);
                else
                    k.fn<<<grid, k.threads, k.smem>>>(dq, dout, dcu, sh.heads, scale * 1.4426950408889634f);
            };
            CK(cudaMemset(dout, 0, (size_t)tokens * sh.heads * 64 * 2));
            launch();
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<__nv_bfloat16> got(ref.size());
            CK(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
            const Agreement agree = compare(got, ref);
            cudaEvent_t a, b;
            CK(cudaEventCreate(&a));
            CK(cudaEventCreate(&b));
            const int reps = 20;
            CK(cudaEventRecord(a));
            for (int r = 0; r < reps; r++) launch();
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            ms /= reps;
            printf("  %-22s rel_l2 %.2e max_abs %.2e  %8.3f ms  %6.1f TFLOP/s\n", k.name, agree.rel_l2, agree.max_abs, ms, flops / ms / 1e9);
        }
        cudaFree(dq);
        cudaFree(dout);
        cudaFree(dref);
        cudaFree(dcu);
        cudaFree(dcell);
    }
    return 0;
}
