// The encoder's in-place layer norm alone, on a GPU: the kept kernel
// (src/gpu/kernels/encoder_ops.cu layer_norm_bf16_pP) against variants and against an in-place
// copy of the same bytes (the memory bound), at the four encoder shapes' largest batches (rows =
// tokens of the longest batch, d = the model width). Each variant's output is compared with the
// kept kernel's on the same random rows. Prints registers a thread, blocks an SM, us a launch
// and TB/s (2 x rows x d x 2 bytes: one read, one write).
//
//   scripts/build-cuda.sh                 # builds dist/cuda/layer_norm_kernels
//   dist/cuda/layer_norm_kernels          # on a GPU machine
#include "../src/gpu/kernels/encoder_ops.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.cuh"

// Variant: the rows kept as bf16 packs in registers (4 registers a pack instead of 8), widened
// to f32 when used; ROWS rows a warp, all loaded before any is reduced; at least MINB blocks an
// SM (the register cap that implies). More warps an SM keep more loads in flight.
template <int P, int ROWS, int MINB>
__global__ void __launch_bounds__(256, MINB) ln_packed(__nv_bfloat16 *x, const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ b,
                                                 const int rows, const int d, const float eps) {
    const int warps = blockDim.x / 32;
    const int row0 = (blockIdx.x * warps + threadIdx.x / 32) * ROWS;
    const int lane = threadIdx.x % 32;
    if (row0 >= rows) return;
    const int packs = d / 8;
    Pack8 v[ROWS][P];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int q = lane + 32 * j;
            if (row0 + r < rows && q < packs) v[r][j] = reinterpret_cast<const Pack8 *>(x + (size_t)(row0 + r) * d)[q];
            else v[r][j] = Pack8{};
        }
    float shift[ROWS], sum[ROWS], sq[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        shift[r] = __shfl_sync(0xffffffffu, __low2float(v[r][0].h[0]), 0);
        sum[r] = 0.f;
        sq[r] = 0.f;
#pragma unroll
        for (int j = 0; j < P; j++)
            if (lane + 32 * j < packs)
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const float2 f = __bfloat1622float2(v[r][j].h[k]);
                    const float c0 = f.x - shift[r], c1 = f.y - shift[r];
                    sum[r] += c0 + c1;
                    sq[r] = fmaf(c0, c0, fmaf(c1, c1, sq[r]));
                }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], o);
            sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], o);
        }
#pragma unroll
    for (int j = 0; j < P; j++) {
        const int q = lane + 32 * j;
        if (q >= packs) continue;
        const Pack8 ww = reinterpret_cast<const Pack8 *>(w)[q], bb = reinterpret_cast<const Pack8 *>(b)[q];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (row0 + r >= rows) continue;
            const float dm = sum[r] / d, mean = shift[r] + dm;
            const float inv = rsqrtf(fmaxf(sq[r] / d - dm * dm, 0.f) + eps);
            Pack8 o;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 f = __bfloat1622float2(v[r][j].h[k]), fw = __bfloat1622float2(ww.h[k]), fb = __bfloat1622float2(bb.h[k]);
                o.h[k] = __floats2bfloat162_rn((f.x - mean) * inv * fw.x + fb.x, (f.y - mean) * inv * fw.y + fb.y);
            }
            reinterpret_cast<Pack8 *>(x + (size_t)(row0 + r) * d)[q] = o;
        }
    }
}

// the memory bound: every 16-byte pack read and written back in place (four in flight a thread)
__global__ void copy_in_place(Pack8 *x, const size_t packs, const unsigned flip) {
    map_packs_in_place(x, packs, [flip](Pack8 &t) { reinterpret_cast<unsigned *>(&t)[0] ^= flip; });
}

typedef void (*Ln)(__nv_bfloat16 *, const __nv_bfloat16 *, const __nv_bfloat16 *, int, int, float);

struct Case {
    const char *shape;
    int rows, d;
};

static float bf(__nv_bfloat16 h) { return __bfloat162float(h); }

int main() {
    const Case cases[] = {{"Geneformer V1", 130721, 256}, {"scGPT", 76800, 512}, {"Geneformer V2", 40313, 768}, {"UCE", 17152, 1280}};
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (const Case &c : cases) {
        const size_t n = (size_t)c.rows * c.d;
        std::vector<__nv_bfloat16> h(n), hw(c.d), hb(c.d);
        unsigned s = 12345;
        auto rnd = [&]() { s = s * 1664525u + 1013904223u; return (float)((s >> 8) & 0xFFFF) / 65536.f - 0.5f; };
        for (size_t i = 0; i < n; i++) h[i] = __float2bfloat16(3.f * rnd() + 0.5f);
        for (int i = 0; i < c.d; i++) hw[i] = __float2bfloat16(1.f + rnd()), hb[i] = __float2bfloat16(rnd());
        __nv_bfloat16 *x, *y, *w, *b;
        CK(cudaMalloc(&x, n * 2));
        CK(cudaMalloc(&y, n * 2));
        CK(cudaMalloc(&w, c.d * 2));
        CK(cudaMalloc(&b, c.d * 2));
        CK(cudaMemcpy(w, hw.data(), c.d * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b, hb.data(), c.d * 2, cudaMemcpyHostToDevice));
        const int P = (c.d + 255) / 256;
        struct V {
            const char *name;
            Ln k;
            int rows_a_warp;
        };
        std::vector<V> vs;
        // the variants measured on 2026-12-02 (BENCHMARKS.md); those capping the registers for
        // more blocks an SM (ln_packed's MINB) spilled or ran slower at every width
        switch (P) {
            case 1: vs = {{"kept (f32 rows, 4 a warp)", layer_norm_bf16_p1, 4}, {"bf16 rows, 4 a warp", ln_packed<1, 4, 1>, 4}, {"bf16 rows, 2 a warp, 8/SM", ln_packed<1, 2, 8>, 2}}; break;
            case 2: vs = {{"kept (f32 rows, 2 a warp)", layer_norm_bf16_p2, 2}, {"bf16 rows, 2 a warp", ln_packed<2, 2, 1>, 2}, {"bf16 rows, 1 a warp, 8/SM", ln_packed<2, 1, 8>, 1}}; break;
            case 3: vs = {{"kept (f32 rows, 1 a warp)", layer_norm_bf16_p3, 1}, {"bf16 rows, 1 a warp, 6/SM", ln_packed<3, 1, 6>, 1}}; break;
            default: vs = {{"kept (f32 rows, 1 a warp)", layer_norm_bf16_p5, 1}, {"bf16 rows, 1 a warp, 4/SM", ln_packed<5, 1, 4>, 1}}; break;
        }
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        const double bytes = 2.0 * n * 2;
        auto time = [&](auto launch) {
            float best = 1e30f;
            for (int round = 0; round < 3; round++) {
                launch();
                CK(cudaEventRecord(e0));
                for (int i = 0; i < 20; i++) launch();
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                best = std::min(best, ms / 20);
            }
            return best * 1e3f;  // us
        };
        {
            const size_t packs = n / 8;
            const int grid = sms * 8;
            const float us = time([&] { copy_in_place<<<grid, 256>>>(reinterpret_cast<Pack8 *>(x), packs, 1u); });
            CK(cudaGetLastError());
            printf("%s (%d x %d): in-place copy %.1f us, %.2f TB/s\n", c.shape, c.rows, c.d, us, bytes / us / 1e6);
        }
        std::vector<__nv_bfloat16> ref(n), out(n);
        for (size_t vi = 0; vi < vs.size(); vi++) {
            const V &v = vs[vi];
            cudaFuncAttributes attr;
            CK(cudaFuncGetAttributes(&attr, v.k));
            int per_sm = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.k, 256, 0));
            const int grid = (c.rows + 8 * v.rows_a_warp - 1) / (8 * v.rows_a_warp);
            CK(cudaMemcpy(y, h.data(), n * 2, cudaMemcpyHostToDevice));
            v.k<<<grid, 256>>>(y, w, b, c.rows, c.d, 1e-12f);
            CK(cudaGetLastError());
            CK(cudaMemcpy(vi == 0 ? ref.data() : out.data(), y, n * 2, cudaMemcpyDeviceToHost));
            double worst = 0.0;
            if (vi > 0)
                for (size_t i = 0; i < n; i++) worst = std::max(worst, (double)fabsf(bf(out[i]) - bf(ref[i])));
            // timed on the same buffer over and over (layer norm of a normalised row is stable)
            const float us = time([&] { v.k<<<grid, 256>>>(y, w, b, c.rows, c.d, 1e-12f); });
            CK(cudaGetLastError());
            printf("  %-28s regs %3d, blocks/SM %2d: %7.1f us, %.2f TB/s%s", v.name, attr.numRegs, per_sm, us, bytes / us / 1e6, vi ? "" : "\n");
            if (vi) printf(", largest difference from kept %.3g\n", worst);
        }
        CK(cudaFree(x));
        CK(cudaFree(y));
        CK(cudaFree(w));
        CK(cudaFree(b));
    }
    return 0;
}
