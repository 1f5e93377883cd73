// The element-wise steps of a post-norm transformer encoder layer in bf16, each one pass over
// memory and in place (src/gpu/fused_encoder.rs runs them between cuBLASLt matrix products,
// whose epilogues already add the biases and the residuals):
//   layer_norm_bf16   x <- (x - mean) / sqrt(var + eps) * w + b over each row of d values
//                     (biased variance, as torch.nn.LayerNorm), f32 arithmetic;
//   gelu_erf_bf16     x <- x / 2 * (1 + erf(x / sqrt 2))          (HF "gelu", nn.GELU())
//   gelu_tanh_bf16    x <- x / 2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  ("gelu_new")
//   segment_mean_*    out[s] = mean of x's rows start[s] .. start[s] + count[s]    (cell embeddings)

#include <cuda_bf16.h>

// 8 bf16 values in one 16-byte load
struct __align__(16) Pack8 {
    __nv_bfloat162 h[4];
};

// One warp a row; d a multiple of 8 and at most 32 x 8 x MAX_PACKS (fused_encoder.rs picks the
// instance with MAX_PACKS = ceil(d / 256): the row lives in registers, and a small d keeps the
// register count, and so the number of rows in flight, high; the first version held 8 packs a
// lane for every d and ran at 0.5 TB/s on 256-wide rows). The sum and the sum of squares are
// reduced across the warp together, shifted by the row's first value (so a mean far from zero
// loses no precision): one chain of shuffles a row instead of two.
template <int MAX_PACKS>
__device__ __forceinline__ void layer_norm(__nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w,
                                           const __nv_bfloat16 *__restrict__ b, const int rows, const int d,
                                           const float eps) {
    const int warps = blockDim.x / 32;
    const int row = blockIdx.x * warps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    Pack8 *xr = reinterpret_cast<Pack8 *>(x + (size_t)row * d);
    const Pack8 *wr = reinterpret_cast<const Pack8 *>(w);
    const Pack8 *br = reinterpret_cast<const Pack8 *>(b);
    const int packs = d / 8;
    Pack8 t[MAX_PACKS];
#pragma unroll
    for (int j = 0; j < MAX_PACKS; j++)
        if (lane + 32 * j < packs) t[j] = xr[lane + 32 * j];
    const float shift = __shfl_sync(0xffffffffu, __low2float(t[0].h[0]), 0);
    float sum = 0.f, sq = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_PACKS; j++) {
        if (lane + 32 * j < packs) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 f = __bfloat1622float2(t[j].h[k]);
                const float c0 = f.x - shift, c1 = f.y - shift;
                sum += c0 + c1;
                sq = fmaf(c0, c0, fmaf(c1, c1, sq));
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
    }
    const float dm = sum / d;  // mean - shift
    const float mean = shift + dm;
    const float inv = rsqrtf(fmaxf(sq / d - dm * dm, 0.f) + eps);
#pragma unroll
    for (int j = 0; j < MAX_PACKS; j++) {
        const int p = lane + 32 * j;
        if (p < packs) {
            const Pack8 ww = wr[p], bb = br[p];
            Pack8 o;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 f = __bfloat1622float2(t[j].h[k]);
                const float2 fw = __bfloat1622float2(ww.h[k]);
                const float2 fb = __bfloat1622float2(bb.h[k]);
                o.h[k] = __floats2bfloat162_rn((f.x - mean) * inv * fw.x + fb.x, (f.y - mean) * inv * fw.y + fb.y);
            }
            xr[p] = o;
        }
    }
}

#define LAYER_NORM(P)                                                                                                    \
    extern "C" __global__ void layer_norm_bf16_p##P(__nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w, \
                                                    const __nv_bfloat16 *__restrict__ b, const int rows, const int d,   \
                                                    const float eps) {                                                  \
        layer_norm<P>(x, w, b, rows, d, eps);                                                                           \
    }
LAYER_NORM(1)
LAYER_NORM(2)
LAYER_NORM(3)
LAYER_NORM(4)
LAYER_NORM(5)
LAYER_NORM(6)
LAYER_NORM(7)
LAYER_NORM(8)

// erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7, far under bf16's rounding):
// q = erfc(|z|) = t (a1 + t (a2 + ... + t a5)) exp(-z^2), t = 1 / (1 + p |z|); libm's erff is
// about twice the instructions and this kernel is bound by them at 3072-wide rows
__device__ __forceinline__ float gelu_erf(float v) {
    const float z = fabsf(v) * 0.70710678118654752f;
    const float t = __fdividef(1.f, fmaf(0.3275911f, z, 1.f));
    const float poly = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
    const float q = poly * __expf(-z * z);
    return 0.5f * v * (v >= 0.f ? 2.f - q : q);  // 1 + erf(v / sqrt 2), without cancellation for v < 0
}
__device__ __forceinline__ float gelu_tanh(float v) {
    return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
}

template <bool ERF>
__device__ __forceinline__ void gelu_pack(Pack8 &t) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 f = __bfloat1622float2(t.h[k]);
        t.h[k] = ERF ? __floats2bfloat162_rn(gelu_erf(f.x), gelu_erf(f.y)) : __floats2bfloat162_rn(gelu_tanh(f.x), gelu_tanh(f.y));
    }
}

// grid-stride over the packs, four loads in flight a thread before any is used
template <bool ERF>
__device__ __forceinline__ void gelu_packs(Pack8 *x, const size_t packs) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < packs; i += 4 * stride) {
        Pack8 t[4];
#pragma unroll
        for (int u = 0; u < 4; u++) t[u] = x[i + u * stride];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            gelu_pack<ERF>(t[u]);
            x[i + u * stride] = t[u];
        }
    }
    for (; i < packs; i += stride) {
        Pack8 t = x[i];
        gelu_pack<ERF>(t);
        x[i] = t;
    }
}

// n / 8 packs of 8 values (n a multiple of 8; the buffer 16-byte aligned)
extern "C" __global__ void gelu_erf_bf16(__nv_bfloat16 *__restrict__ x, const unsigned long long packs) {
    gelu_packs<true>(reinterpret_cast<Pack8 *>(x), packs);
}

extern "C" __global__ void gelu_tanh_bf16(__nv_bfloat16 *__restrict__ x, const unsigned long long packs) {
    gelu_packs<false>(reinterpret_cast<Pack8 *>(x), packs);
}

// out (spans x d, f32, zeroed by the caller) += the mean of x's rows start[s] .. start[s] +
// count[s] for every span s: a block takes up to 64 rows of one span and blockDim.x columns and
// adds its share (its sum / count) atomically. Grid: (ceil(longest span / 64), spans,
// ceil(d / blockDim.x)). One launch pools a whole batch of cells (a narrow, a cast and a mean a
// cell in candle's ops: three launches a cell).
template <typename T>
__device__ __forceinline__ void segment_mean(const T *__restrict__ x, const unsigned int *__restrict__ start,
                                             const unsigned int *__restrict__ count, float *__restrict__ out, const int d) {
    const int span = blockIdx.y;
    const unsigned int c = count[span];
    const unsigned int r0 = blockIdx.x * 64;
    const int col = blockIdx.z * blockDim.x + threadIdx.x;
    if (r0 >= c || col >= d) return;
    const unsigned int r1 = min(c, r0 + 64);
    const T *p = x + (size_t)(start[span] + r0) * d + col;
    float acc = 0.f;
    for (unsigned int r = r0; r < r1; r++, p += d) acc += (float)*p;
    atomicAdd(out + (size_t)span * d + col, acc / (float)c);
}

extern "C" __global__ void segment_mean_bf16(const __nv_bfloat16 *__restrict__ x, const unsigned int *__restrict__ start,
                                             const unsigned int *__restrict__ count, float *__restrict__ out, const int d) {
    segment_mean(x, start, count, out, d);
}
extern "C" __global__ void segment_mean_f32(const float *__restrict__ x, const unsigned int *__restrict__ start,
                                            const unsigned int *__restrict__ count, float *__restrict__ out, const int d) {
    segment_mean(x, start, count, out, d);
}
