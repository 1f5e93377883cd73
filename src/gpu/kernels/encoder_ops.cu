// The element-wise steps of a post-norm transformer encoder layer in bf16, each one pass over
// memory and in place (src/gpu/fused_encoder.rs runs them between cuBLASLt matrix products,
// whose epilogues already add the biases and the residuals):
//   layer_norm_bf16   x <- (x - mean) / sqrt(var + eps) * w + b over each row of d values
//                     (biased variance, as torch.nn.LayerNorm), f32 arithmetic;
//   layer_norm_to_bf16  the same into another buffer (pre-norm layers' branches);
//   embed_layer_norm_bf16  the same over BERT's summed embeddings (gpu/embedding.rs);
//   norm_add_bf16     out <- LayerNorm(a[idx]) + b[idx2] (scGPT's gene and value encodings);
//   gelu_erf_bf16     x <- x / 2 * (1 + erf(x / sqrt 2))          (HF "gelu", nn.GELU())
//   gelu_tanh_bf16    x <- x / 2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  ("gelu_new")
//   rotary_qk_bf16    GPT-NeoX's rotary embedding of the queries and keys of packed cells, in
//                     place (nn/rotary.rs: positions from each cell's start)
//   segment_mean_*    out[s] = mean of x's rows start[s] .. start[s] + count[s]    (cell embeddings)
//   segment_max_*     out[s] = the same rows' column maxima (scFoundation's max pooling)
//   dropout_f32       out[i] = x[i] * scale when element i is kept, else 0 (nn/dropout.rs: the
//                     mask is a hash of (key, i), the same on the CPU)
//   add_dropped_*, dropped_to_*, act_dropped_*, act_dropped_bwd_*: training's residual sum and
//                     activations with that dropout, forward and backward (nn/train_ops.rs)
//   favor_features_*  Performer's FAVOR+ features from the projected rows, one pass (scBERT;
//                     gpu/favor.rs)
//   gatv2_attention_f32  one GATv2 layer's attention over padded neighbour lists, scores,
//                     softmax and weighted sum in one pass (gpu/gat_attention.rs; Novae)
//   retention_split_*  CellFM's q/k/v/u from their one product, into heads, with relu, scale,
//                     key mask, value scale and silu in the same pass (gpu/retention.rs)
//   retention_merge_*  CellFM's SRMSNorm of each head's output times u, back to token rows
//                     (gpu/retention.rs)

#include <cuda_bf16.h>

#include "attention_common.cuh"

// 8 bf16 values in one 16-byte load
struct __align__(16) Pack8 {
    __nv_bfloat162 h[4];
};

// Layer norm over rows of d values (d a multiple of 8, at most 32 x 8 x MAX_PACKS): one warp
// takes ROWS rows and holds them in registers as f32, packs of 8 a lane (fused_encoder.rs picks
// the instance with MAX_PACKS = ceil(d / 256): a small d keeps the register count, and so the
// number of rows in flight, high; the first version held 8 packs a lane for every d and ran at
// 0.5 TB/s on 256-wide rows). A warp loads all its rows before reducing any, so narrow rows
// (256 and 512 wide: 1 and 2 packs a lane) keep 2 KB a warp in flight instead of one row's 512
// or 1,024 bytes. The sum and the sum of squares are reduced across the warp together, shifted
// by the row's first value (so a mean far from zero loses no precision): one chain of shuffles
// a row, the ROWS chains interleaved.
//
// With kEmbed the rows are BERT's embeddings, summed as they are loaded: row r is
// word[idx[r]] + position[idx[rows + r]] + token_type, then normalised into `out` (one kernel for
// what candle's ops do in five: two gathers, two adds and a layer norm). With kNormAdd row r is
// word[idx[r]] normalised, plus position[idx[rows + r]] after the norm. With kInPlace the rows
// are read from `x` and written to `out` (`out` may be `x`: no __restrict__ on either). The
// kernels: layer_norm_bf16 and layer_norm_to_bf16 (kInPlace), embed_layer_norm_bf16 (kEmbed), norm_add_bf16 (kNormAdd: scGPT's
// LayerNorm(gene embedding) + value encoding, gpu/embedding.rs).
constexpr int kInPlace = 0, kEmbed = 1, kNormAdd = 2;

template <int MAX_PACKS>
__host__ __device__ constexpr int rows_a_warp() { return MAX_PACKS == 1 ? 4 : MAX_PACKS == 2 ? 2 : 1; }

__device__ __forceinline__ void add_pack(float *v, const Pack8 &p) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 f = __bfloat1622float2(p.h[k]);
        v[2 * k] += f.x;
        v[2 * k + 1] += f.y;
    }
}

template <int MAX_PACKS, int MODE>
__device__ __forceinline__ void norm_rows(__nv_bfloat16 *out, const __nv_bfloat16 *x, const unsigned int *__restrict__ idx,
                                          const __nv_bfloat16 *__restrict__ word, const __nv_bfloat16 *__restrict__ position,
                                          const __nv_bfloat16 *__restrict__ token_type, const __nv_bfloat16 *__restrict__ w,
                                          const __nv_bfloat16 *__restrict__ b, const int rows, const int d, const float eps) {
    constexpr int ROWS = rows_a_warp<MAX_PACKS>();
    const int warps = blockDim.x / 32;
    const int row0 = (blockIdx.x * warps + threadIdx.x / 32) * ROWS;
    const int lane = threadIdx.x % 32;
    if (row0 >= rows) return;
    const int packs = d / 8;
    float v[ROWS][MAX_PACKS][8];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int row = row0 + r;
        const Pack8 *a = nullptr, *p = nullptr;
        if (row < rows) {
            if (MODE != kInPlace) {
                a = reinterpret_cast<const Pack8 *>(word + (size_t)idx[row] * d);
                p = reinterpret_cast<const Pack8 *>(position + (size_t)idx[rows + row] * d);
            } else {
                a = reinterpret_cast<const Pack8 *>(x + (size_t)row * d);
            }
        }
#pragma unroll
        for (int j = 0; j < MAX_PACKS; j++) {
#pragma unroll
            for (int k = 0; k < 8; k++) v[r][j][k] = 0.f;
            const int q = lane + 32 * j;
            if (row < rows && q < packs) {
                add_pack(v[r][j], a[q]);
                if (MODE == kEmbed) {
                    add_pack(v[r][j], p[q]);
                    add_pack(v[r][j], reinterpret_cast<const Pack8 *>(token_type)[q]);
                }
            }
        }
    }
    float shift[ROWS], sum[ROWS], sq[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        shift[r] = __shfl_sync(0xffffffffu, v[r][0][0], 0);
        sum[r] = 0.f;
        sq[r] = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_PACKS; j++) {
            if (lane + 32 * j < packs) {
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    const float c = v[r][j][k] - shift[r];
                    sum[r] += c;
                    sq[r] = fmaf(c, c, sq[r]);
                }
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], o);
            sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], o);
        }
    }
    float mean[ROWS], inv[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const float dm = sum[r] / d;  // mean - shift
        mean[r] = shift[r] + dm;
        inv[r] = rsqrtf(fmaxf(sq[r] / d - dm * dm, 0.f) + eps);
    }
    const Pack8 *wr = reinterpret_cast<const Pack8 *>(w);
    const Pack8 *br = reinterpret_cast<const Pack8 *>(b);
#pragma unroll
    for (int j = 0; j < MAX_PACKS; j++) {
        const int q = lane + 32 * j;
        if (q < packs) {
            const Pack8 ww = wr[q], bb = br[q];
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (row0 + r < rows) {
                    Pack8 o, add = {};
                    if (MODE == kNormAdd) add = reinterpret_cast<const Pack8 *>(position + (size_t)idx[rows + row0 + r] * d)[q];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const float2 fw = __bfloat1622float2(ww.h[k]);
                        const float2 fb = __bfloat1622float2(bb.h[k]);
                        const float2 fa = MODE == kNormAdd ? __bfloat1622float2(add.h[k]) : make_float2(0.f, 0.f);
                        o.h[k] = __floats2bfloat162_rn((v[r][j][2 * k] - mean[r]) * inv[r] * fw.x + fb.x + fa.x,
                                                       (v[r][j][2 * k + 1] - mean[r]) * inv[r] * fw.y + fb.y + fa.y);
                    }
                    reinterpret_cast<Pack8 *>(out + (size_t)(row0 + r) * d)[q] = o;
                }
            }
        }
    }
}

// x (rows x d) normalised in place; a block of 256 threads takes 8 x rows_a_warp<P>() rows
#define LAYER_NORM(P)                                                                                                     \
    extern "C" __global__ void layer_norm_bf16_p##P(__nv_bfloat16 *x, const __nv_bfloat16 *__restrict__ w,               \
                                                    const __nv_bfloat16 *__restrict__ b, const int rows, const int d,    \
                                                    const float eps) {                                                   \
        norm_rows<P, kInPlace>(x, x, nullptr, nullptr, nullptr, nullptr, w, b, rows, d, eps);                            \
    }                                                                                                                    \
    extern "C" __global__ void layer_norm_to_bf16_p##P(const __nv_bfloat16 *x, __nv_bfloat16 *out,                       \
                                                       const __nv_bfloat16 *__restrict__ w,                              \
                                                       const __nv_bfloat16 *__restrict__ b, const int rows, const int d, \
                                                       const float eps) {                                                \
        norm_rows<P, kInPlace>(out, x, nullptr, nullptr, nullptr, nullptr, w, b, rows, d, eps);                          \
    }                                                                                                                    \
    extern "C" __global__ void embed_layer_norm_bf16_p##P(                                                               \
        __nv_bfloat16 *__restrict__ out, const unsigned int *__restrict__ idx, const __nv_bfloat16 *__restrict__ word,   \
        const __nv_bfloat16 *__restrict__ position, const __nv_bfloat16 *__restrict__ token_type,                        \
        const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ b, const int rows, const int d,           \
        const float eps) {                                                                                               \
        norm_rows<P, kEmbed>(out, nullptr, idx, word, position, token_type, w, b, rows, d, eps);                         \
    }                                                                                                                    \
    extern "C" __global__ void norm_add_bf16_p##P(                                                                       \
        __nv_bfloat16 *__restrict__ out, const unsigned int *__restrict__ idx, const __nv_bfloat16 *__restrict__ rows_a, \
        const __nv_bfloat16 *__restrict__ rows_b, const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ b, \
        const int rows, const int d, const float eps) {                                                                  \
        norm_rows<P, kNormAdd>(out, nullptr, idx, rows_a, rows_b, nullptr, w, b, rows, d, eps);                          \
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

// `op` on every pack in place, grid-stride, four loads in flight a thread before any is used
// (bench/layer_norm_kernels.cu times its copy bound with the same loop)
template <class Op>
__device__ __forceinline__ void map_packs_in_place(Pack8 *x, const size_t packs, Op op) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < packs; i += 4 * stride) {
        Pack8 t[4];
#pragma unroll
        for (int u = 0; u < 4; u++) t[u] = x[i + u * stride];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            op(t[u]);
            x[i + u * stride] = t[u];
        }
    }
    for (; i < packs; i += stride) {
        Pack8 t = x[i];
        op(t);
        x[i] = t;
    }
}

template <bool ERF>
__device__ __forceinline__ void gelu_packs(Pack8 *x, const size_t packs) {
    map_packs_in_place(x, packs, [](Pack8 &t) { gelu_pack<ERF>(t); });
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

// Column maxima of x's rows start[s] .. start[s] + count[s] for every span s, as order-keeping
// u32 keys (key(a) < key(b) exactly when a < b for non-NaN floats; 0 is below every float), so
// that blocks of 64 rows can merge by atomicMax into a zeroed buffer; segment_max_decode turns the
// keys back into floats (an empty span: 0). Grid as segment_mean's.
__device__ __forceinline__ unsigned int max_key(const float v) {
    const unsigned int b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
template <typename T>
__device__ __forceinline__ void segment_max(const T *__restrict__ x, const unsigned int *__restrict__ start,
                                            const unsigned int *__restrict__ count, unsigned int *__restrict__ keys, const int d) {
    const int span = blockIdx.y;
    const unsigned int c = count[span];
    const unsigned int r0 = blockIdx.x * 64;
    const int col = blockIdx.z * blockDim.x + threadIdx.x;
    if (r0 >= c || col >= d) return;
    const unsigned int r1 = min(c, r0 + 64);
    const T *p = x + (size_t)(start[span] + r0) * d + col;
    float m = (float)*p;
    p += d;
    for (unsigned int r = r0 + 1; r < r1; r++, p += d) m = fmaxf(m, (float)*p);
    atomicMax(keys + (size_t)span * d + col, max_key(m));
}
extern "C" __global__ void segment_max_bf16(const __nv_bfloat16 *__restrict__ x, const unsigned int *__restrict__ start,
                                            const unsigned int *__restrict__ count, unsigned int *__restrict__ keys, const int d) {
    segment_max(x, start, count, keys, d);
}
extern "C" __global__ void segment_max_f32(const float *__restrict__ x, const unsigned int *__restrict__ start,
                                           const unsigned int *__restrict__ count, unsigned int *__restrict__ keys, const int d) {
    segment_max(x, start, count, keys, d);
}
extern "C" __global__ void segment_max_decode(const unsigned int *__restrict__ keys, float *__restrict__ out, const unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned int k = keys[i];
    out[i] = k == 0u ? 0.f : __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// CSR rows into a zeroed dense n x n_cols matrix (src/gpu/csr_dense.rs): block r writes row r's
// values, each column at most once a row.
extern "C" __global__ void csr_to_dense_f32(const unsigned int *__restrict__ offsets, const unsigned int *__restrict__ cols,
                                            const float *__restrict__ vals, float *__restrict__ out,
                                            const unsigned long long n_cols) {
    const unsigned int end = offsets[blockIdx.x + 1];
    float *row = out + (unsigned long long)blockIdx.x * n_cols;
    for (unsigned int k = offsets[blockIdx.x] + threadIdx.x; k < end; k += blockDim.x) row[cols[k]] = vals[k];
}

// Element i is kept when the top 24 bits of SplitMix64(key + (i + 1) * golden) are below threshold.
__device__ __forceinline__ bool dropout_keeps(const unsigned long long key, const unsigned long long i, const unsigned int threshold) {
    unsigned long long z = key + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (unsigned int)(z >> 40) < threshold;
}
// Counter-based dropout (src/nn/dropout.rs holds the CPU twin and the rule): element i is kept
// when the top 24 bits of SplitMix64(key + (i + 1) * golden) are below `threshold`.
extern "C" __global__ void dropout_f32(const float *__restrict__ x, float *__restrict__ out, const unsigned long long key,
                                       const unsigned int threshold, const float scale, const unsigned long long n) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = dropout_keeps(key, i, threshold) ? x[i] * scale : 0.f;
    }
}

__device__ __forceinline__ float to_f(const float v) { return v; }
__device__ __forceinline__ float to_f(const __nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_f(float *p, const float v) { *p = v; }
__device__ __forceinline__ void from_f(__nv_bfloat16 *p, const float v) { *p = __float2bfloat16(v); }

// Training's residual and feed-forward steps with dropout (src/nn/train_ops.rs holds the CPU
// twins; the mask is dropout_f32's rule, element i of the tensor; has_mask 0: nothing dropped):
//   add_dropped_*      z[i] = x[i] + (kept ? y[i] * scale : 0)     (x, z f32; y the branch)
//   dropped_to_*       dy[i] = kept ? g[i] * scale : 0             (its backward, into y's dtype)
//   act_dropped_*      out[i] = kept ? a(h[i]) * scale : 0, a(v) = v > 0 ? v : slope v (ReLU: slope 0)
//   act_dropped_bwd_*  dh[i] = kept ? g[i] a'(h[i]) scale : 0, from the output (out > 0 iff
//                      kept and h > 0) and, for a leaky slope where out <= 0, the mask drawn again
#define TRAIN_ELEMENTWISE(SUFFIX, T)                                                                                   \
    extern "C" __global__ void add_dropped_##SUFFIX(const float *__restrict__ x, const T *__restrict__ y,               \
                                                    float *__restrict__ z, const int has_mask,                          \
                                                    const unsigned long long key, const unsigned int threshold,        \
                                                    const float scale, const unsigned long long n) {                    \
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                  \
             i += (unsigned long long)gridDim.x * blockDim.x) {                                                         \
            const bool kept = !has_mask || dropout_keeps(key, i, threshold);                                            \
            z[i] = kept ? x[i] + __fmul_rn(to_f(y[i]), scale) : x[i];                                                                \
        }                                                                                                               \
    }                                                                                                                   \
    extern "C" __global__ void dropped_to_##SUFFIX(const float *__restrict__ g, T *__restrict__ dy, const int has_mask, \
                                                   const unsigned long long key, const unsigned int threshold,         \
                                                   const float scale, const unsigned long long n) {                     \
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                  \
             i += (unsigned long long)gridDim.x * blockDim.x) {                                                         \
            const bool kept = !has_mask || dropout_keeps(key, i, threshold);                                            \
            from_f(dy + i, kept ? g[i] * scale : 0.f);                                                                  \
        }                                                                                                               \
    }                                                                                                                   \
    extern "C" __global__ void act_dropped_##SUFFIX(const T *__restrict__ h, T *__restrict__ out, const float slope,    \
                                                    const int has_mask, const unsigned long long key,                   \
                                                    const unsigned int threshold, const float scale,                    \
                                                    const unsigned long long n) {                                       \
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                  \
             i += (unsigned long long)gridDim.x * blockDim.x) {                                                         \
            const float v = to_f(h[i]);                                                                                 \
            const float a = v > 0.f ? v : __fmul_rn(v, slope);                                                          \
            const bool kept = !has_mask || dropout_keeps(key, i, threshold);                                            \
            from_f(out + i, kept ? __fmul_rn(a, scale) : 0.f);                                                          \
        }                                                                                                               \
    }                                                                                                                   \
    extern "C" __global__ void act_dropped_bwd_##SUFFIX(const T *__restrict__ out, const T *__restrict__ g,             \
                                                        T *__restrict__ dh, const float slope, const int has_mask,      \
                                                        const unsigned long long key, const unsigned int threshold,    \
                                                        const float scale, const unsigned long long n) {                \
        for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                  \
             i += (unsigned long long)gridDim.x * blockDim.x) {                                                         \
            const float gv = to_f(g[i]);                                                                                \
            float d;                                                                                                    \
            if (to_f(out[i]) > 0.f) d = gv * scale;                                                                     \
            else if (slope == 0.f || (has_mask && !dropout_keeps(key, i, threshold))) d = 0.f;                          \
            else d = __fmul_rn(gv, slope) * scale;                                                                      \
            from_f(dh + i, d);                                                                                          \
        }                                                                                                               \
    }
TRAIN_ELEMENTWISE(f32, float)
TRAIN_ELEMENTWISE(bf16, __nv_bfloat16)

// Training attention's row passes (src/nn/recompute_attention.rs holds the CPU twin and the
// algebra): one warp a row of l scores, softmax in f32, the attention dropout mask
// (attention_common.cuh, attn_group_bits: a draw shared by four elements) applied on the way out.
__device__ __forceinline__ float ld_f(const float *p) { return *p; }
__device__ __forceinline__ float ld_f(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st_f(float *p, const float v) { *p = v; }
__device__ __forceinline__ void st_f(__nv_bfloat16 *p, const float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ float warp_max_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// the attention multiplier of element j of score row `row` (query row % l of row block row / l)
__device__ __forceinline__ float keep_mul_attn(const int has_mask, const unsigned long long key, const unsigned long long row, const int j,
                                               const int l, const unsigned int threshold, const float scale) {
    if (!has_mask) return 1.f;
    const int q = (int)(row % (unsigned long long)l);
    return attn_keep(attn_group_bits(key, row / (unsigned long long)l, q, j, l), q, j, threshold >> 8, scale);
}
// the row's max and 1 / sum(exp(c s - max)) of the scaled scores
template <typename T>
__device__ __forceinline__ void row_softmax_stats(const T *s, const int l, const int lane, const float c, float &m, float &inv) {
    m = __int_as_float(0xff800000u);  // -inf
    for (int j = lane; j < l; j += 32) m = fmaxf(m, ld_f(s + j) * c);
    m = warp_max_f(m);
    float z = 0.f;
    for (int j = lane; j < l; j += 32) z += expf(ld_f(s + j) * c - m);
    inv = 1.f / warp_sum_f(z);
}
// pd = dropout(softmax(c s))
template <typename T>
__device__ void attn_probs(const T *s, T *pd, const unsigned long long rows, const int l, const float c, const int has_mask,
                           const unsigned long long key, const unsigned int threshold, const float scale) {
    const unsigned long long row = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const unsigned long long base = row * (unsigned long long)l;
    float m, inv;
    row_softmax_stats(s + base, l, lane, c, m, inv);
    for (int j = lane; j < l; j += 32)
        st_f(pd + base + j, expf(ld_f(s + base + j) * c - m) * inv * keep_mul_attn(has_mask, key, row, j, l, threshold, scale));
}
// from the scores s and dPd = dO v^T: pd = dropout(P) and ds = c P * (dP - rowsum(dP * P)),
// dP = dropout(dPd), P = softmax(c s)
template <typename T>
__device__ void attn_ds(const T *s, const T *dpd, T *pd, T *ds, const unsigned long long rows, const int l,
                        const float c, const int has_mask, const unsigned long long key, const unsigned int threshold, const float scale) {
    const unsigned long long row = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const unsigned long long base = row * (unsigned long long)l;
    float m, inv;
    row_softmax_stats(s + base, l, lane, c, m, inv);
    float acc = 0.f;
    for (int j = lane; j < l; j += 32) {
        const float p = expf(ld_f(s + base + j) * c - m) * inv;
        acc += ld_f(dpd + base + j) * keep_mul_attn(has_mask, key, row, j, l, threshold, scale) * p;
    }
    acc = warp_sum_f(acc);
    for (int j = lane; j < l; j += 32) {
        const float p = expf(ld_f(s + base + j) * c - m) * inv;
        const float k = keep_mul_attn(has_mask, key, row, j, l, threshold, scale);
        st_f(ds + base + j, c * p * (ld_f(dpd + base + j) * k - acc));
        st_f(pd + base + j, p * k);
    }
}
#define ATTN_ROWS(T, SUFFIX)                                                                                             \
    extern "C" __global__ void attn_probs_##SUFFIX(const T *s, T *pd, const unsigned long long rows, const int l,     \
                                                   const float c, const int has_mask, const unsigned long long key,    \
                                                   const unsigned int threshold, const float scale) {                  \
        attn_probs(s, pd, rows, l, c, has_mask, key, threshold, scale);                                                \
    }                                                                                                                  \
    extern "C" __global__ void attn_ds_##SUFFIX(const T *s, const T *dpd, T *pd, T *ds, const unsigned long long rows, \
                                                const int l, const float c, const int has_mask,                        \
                                                const unsigned long long key, const unsigned int threshold,            \
                                                const float scale) {                                                   \
        attn_ds(s, dpd, pd, ds, rows, l, c, has_mask, key, threshold, scale);                                          \
    }
ATTN_ROWS(float, f32)
ATTN_ROWS(__nv_bfloat16, bf16)

// Layer norm for training in f32 (src/nn/layer_norm.rs holds the CPU twin and the algebra):
// one warp a row of d values, two-pass statistics.
__device__ __forceinline__ void ln_row_stats(const float *x, const int d, float &mean, float &r, const float eps) {
    const int lane = threadIdx.x & 31;
    float s = 0.f;
    for (int j = lane; j < d; j += 32) s += x[j];
    mean = warp_sum_f(s) / (float)d;
    float v = 0.f;
    for (int j = lane; j < d; j += 32) {
        const float t = x[j] - mean;
        v += t * t;
    }
    r = 1.f / sqrtf(warp_sum_f(v) / (float)d + eps);
}
extern "C" __global__ void ln_fwd_f32(const float *__restrict__ x, const float *__restrict__ w, const float *__restrict__ b,
                                      float *__restrict__ y, const unsigned long long rows, const int d, const float eps) {
    const unsigned long long row = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *xr = x + row * d;
    float mean, r;
    ln_row_stats(xr, d, mean, r, eps);
    for (int j = lane; j < d; j += 32) y[row * d + j] = (xr[j] - mean) * r * w[j] + b[j];
}
// dx = r (g - mean(g) - xh mean(g xh)), g = dy w; gx = dy xh (summed over rows for dw)
extern "C" __global__ void ln_bwd_f32(const float *__restrict__ x, const float *__restrict__ w, const float *__restrict__ dy,
                                      float *__restrict__ dx, float *__restrict__ gx, const unsigned long long rows, const int d,
                                      const float eps) {
    const unsigned long long row = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *xr = x + row * d, *dyr = dy + row * d;
    float mean, r;
    ln_row_stats(xr, d, mean, r, eps);
    float a = 0.f, c = 0.f;
    for (int j = lane; j < d; j += 32) {
        const float g = dyr[j] * w[j];
        a += g;
        c += g * (xr[j] - mean) * r;
    }
    a = warp_sum_f(a) / (float)d;
    c = warp_sum_f(c) / (float)d;
    for (int j = lane; j < d; j += 32) {
        const float xh = (xr[j] - mean) * r;
        dx[row * d + j] = r * (dyr[j] * w[j] - a - xh * c);
        gx[row * d + j] = dyr[j] * xh;
    }
}

// GPT-NeoX's rotary embedding (nn/rotary.rs is the rule and its reference) over packed cells'
// QKV rows ([q heads | k heads | v heads], heads 64 wide), in place: for each token p of cell
// blockIdx.y (position p - start), head h and pair i < rot / 2 of its query and its key,
// x[i] <- x[i] cos - x[i + rot/2] sin and x[i + rot/2] <- x[i + rot/2] cos + x[i] sin at angle
// position x inv_freq[i], in f32 (cosf, sinf: full range reduction), each value rounded once.
// Grid: (ceil(longest x heads x rot / 2 / 256), cells).
extern "C" __global__ void rotary_qk_bf16(__nv_bfloat16 *__restrict__ qkv, const unsigned int *__restrict__ cu,
                                          const float *__restrict__ inv_freq, const int heads, const int rot) {
    const int half = rot / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int i = (int)(idx % half);
    const int h = (int)((idx / half) % heads);
    const long long p = idx / ((long long)half * heads);
    const unsigned int start = cu[blockIdx.y], len = cu[blockIdx.y + 1] - start;
    if (p >= len) return;
    float sn, cs;
    sincosf((float)p * inv_freq[i], &sn, &cs);
    __nv_bfloat16 *row = qkv + ((size_t)start + p) * 3 * heads * 64 + h * 64;
#pragma unroll
    for (int part = 0; part < 2; part++) {
        __nv_bfloat16 *x = row + part * heads * 64;
        const float a = __bfloat162float(x[i]), b = __bfloat162float(x[i + half]);
        x[i] = __float2bfloat16(a * cs - b * sn);
        x[i + half] = __float2bfloat16(b * cs + a * sn);
    }
}

// One GATv2 layer's message passing (torch_geometric's GATv2Conv with an edge attribute, as
// src/methods/novae.rs's candle ops compute it; gpu/gat_attention.rs), for node blockIdx.x and
// channel t = head * c + k (one thread a channel, blockDim = heads * c):
//   e_j = leaky_relu(xl[nbr_j] + xr[i] + attr_j * lin_edge, 0.2),  s_j = sum_k e_j * att + mask_j,
//   alpha = softmax_j(s) (minus the max, over the sum plus 1e-16),  out[i] = sum_j alpha_j xl[nbr_j],
// over the node's d padded neighbour slots j (nbr_j >= n: the padding's zero row; its mask is
// -1e30, so its weight is exactly 0). Each head's score sums its c channels in order from
// shared memory (deterministic). Shared memory: d x heads scores, then heads x c partials.
extern "C" __global__ void gatv2_attention_f32(const float *__restrict__ xl, const float *__restrict__ xr,
                                               const unsigned int *__restrict__ nbr, const float *__restrict__ attr,
                                               const float *__restrict__ mask, const float *__restrict__ lin_edge,
                                               const float *__restrict__ att, float *__restrict__ out, const int n,
                                               const int d, const int heads, const int c) {
    extern __shared__ float smem[];
    float *score = smem;              // [d][heads]
    float *part = smem + d * heads;   // [heads * c]
    const int i = blockIdx.x, t = threadIdx.x, hc = heads * c, h = t / c, k = t % c;
    const float xi = xr[(size_t)i * hc + t], we = lin_edge[t], wa = att[t];
    for (int j = 0; j < d; j++) {
        const unsigned int src = nbr[(size_t)i * d + j];
        const float xj = src < (unsigned int)n ? xl[(size_t)src * hc + t] : 0.f;
        float e = xj + xi + attr[(size_t)i * d + j] * we;
        e = fmaxf(e, 0.2f * e);
        part[t] = e * wa;
        __syncthreads();
        if (k == 0) {
            float acc = 0.f;
            for (int q = 0; q < c; q++) acc += part[h * c + q];
            score[j * heads + h] = acc + mask[(size_t)i * d + j];
        }
        __syncthreads();
    }
    float m = -INFINITY;
    for (int j = 0; j < d; j++) m = fmaxf(m, score[j * heads + h]);
    float z = 0.f;
    for (int j = 0; j < d; j++) z += expf(score[j * heads + h] - m);
    z += 1e-16f;
    float acc = 0.f;
    for (int j = 0; j < d; j++) {
        const unsigned int src = nbr[(size_t)i * d + j];
        if (src >= (unsigned int)n) continue;
        acc += xl[(size_t)src * hc + t] * (expf(score[j * heads + h] - m) / z);
    }
    out[(size_t)i * hc + t] = acc;
}

// Performer's softmax-kernel features (scBERT's FAVOR+, src/methods/scbert.rs softmax_kernel is
// the rule and its reference; gpu/favor.rs), one block a row of m projected values:
//   out = (exp(dash - diag[row] - stab) + eps) * ratio,
// each step rounded to f32 as candle's ops round it; stab is the row's own maximum (queries:
// has_stab 0) or stab[row / rows_per_stab] (keys: the maximum over the cell's whole tensor).
// T = float or bf16 rows (bf16: the math in f32, one rounding of the output); diag and stab f32.
template <typename T>
__device__ __forceinline__ void favor_features(const T *__restrict__ dash, const float *__restrict__ diag,
                                               const float *__restrict__ stab, T *__restrict__ out, const int m,
                                               const int has_stab, const long long rows_per_stab, const float ratio,
                                               const float eps) {
    __shared__ float red[32];
    const long long row = blockIdx.x;
    const T *x = dash + row * m;
    float s;
    if (has_stab) {
        s = stab[row / rows_per_stab];
    } else {
        float mx = -INFINITY;
        for (int j = threadIdx.x; j < m; j += blockDim.x) mx = fmaxf(mx, to_f(x[j]));
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
        __syncthreads();
        if (threadIdx.x < 32) {
            mx = threadIdx.x < (blockDim.x + 31) / 32 ? red[threadIdx.x] : -INFINITY;
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
            if (threadIdx.x == 0) red[0] = mx;
        }
        __syncthreads();
        s = red[0];
    }
    const float dg = diag[row];
    for (int j = threadIdx.x; j < m; j += blockDim.x) {
        const float a = to_f(x[j]) - dg;
        const float b = a - s;
        from_f(out + row * m + j, (expf(b) + eps) * ratio);
    }
}
#define FAVOR_FEATURES(T, SUFFIX)                                                                                  \
    extern "C" __global__ void favor_features_##SUFFIX(const T *__restrict__ dash, const float *__restrict__ diag, \
                                                       const float *__restrict__ stab, T *__restrict__ out,         \
                                                       const int m, const int has_stab,                             \
                                                       const long long rows_per_stab, const float ratio,            \
                                                       const float eps) {                                           \
        favor_features<T>(dash, diag, stab, out, m, has_stab, rows_per_stab, ratio, eps);                           \
    }
FAVOR_FEATURES(float, f32)
FAVOR_FEATURES(__nv_bfloat16, bf16)

// CellFM's retention, around its two small products (gpu/retention.rs; methods/cellfm.rs
// Retention is the rule and its reference). qkvu: rows = cells x l tokens of 4 d values (q, k, v,
// u, each heads x hd), as the one product of the four projections writes them; out: (4, cells,
// heads, l, hd) with q = relu(q) * inv_scale, k = relu(k) * inv_scale * mask[row],
// v = v * vscale[cell], u = silu(u). One block a token row; math in f32, one rounding
// (to_f / from_f above).
template <typename T>
__device__ __forceinline__ void retention_split(const T *__restrict__ qkvu, const float *__restrict__ mask,
                                                const float *__restrict__ vscale, T *__restrict__ out, const int cells,
                                                const int l, const int heads, const int hd, const float inv_scale) {
    const long long row = blockIdx.x;
    const int cell = (int)(row / l), pos = (int)(row % l);
    const int d = heads * hd;
    const float mk = mask[row], vs = vscale[cell];
    const T *x = qkvu + row * 4LL * d;
    for (int e = threadIdx.x; e < 4 * d; e += blockDim.x) {
        const int part = e / d, rem = e % d, head = rem / hd, c = rem % hd;
        const float v = to_f(x[e]);
        float y;
        if (part == 0) y = fmaxf(v, 0.f) * inv_scale;
        else if (part == 1) y = fmaxf(v, 0.f) * inv_scale * mk;
        else if (part == 2) y = v * vs;
        else y = v / (1.f + expf(-v));
        from_f(out + ((((long long)part * cells + cell) * heads + head) * l + pos) * hd + c, y);
    }
}

// o, u: (cells, heads, l, hd); out: (cells, l, heads x hd) = o / max(|o / sqrt(hd)|_2, 1e-12) * u,
// one warp a (cell, head, token) row, the norm in f32.
template <typename T>
__device__ __forceinline__ void retention_merge(const T *__restrict__ o, const T *__restrict__ u, T *__restrict__ out,
                                                const long long rows, const int l, const int heads, const int hd) {
    const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const T *x = o + r * hd;
    const float inv_sqrt = rsqrtf((float)hd);
    float ss = 0.f;
    for (int c = lane; c < hd; c += 32) {
        const float v = to_f(x[c]) * inv_sqrt;
        ss += v * v;
    }
    for (int s = 16; s > 0; s >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, s);
    const float inv = 1.f / fmaxf(sqrtf(ss), 1e-12f);
    const long long cell = r / ((long long)heads * l);
    const int head = (int)((r / l) % heads), pos = (int)(r % l);
    T *dst = out + ((cell * l + pos) * heads + head) * hd;
    for (int c = lane; c < hd; c += 32) from_f(dst + c, to_f(x[c]) * inv * to_f(u[r * hd + c]));
}

#define RETENTION(SUFFIX, T)                                                                                      \
    extern "C" __global__ void retention_split_##SUFFIX(const T *__restrict__ qkvu, const float *__restrict__ mask, \
                                                        const float *__restrict__ vscale, T *__restrict__ out,      \
                                                        const int cells, const int l, const int heads, const int hd, \
                                                        const float inv_scale) {                                   \
        retention_split<T>(qkvu, mask, vscale, out, cells, l, heads, hd, inv_scale);                              \
    }                                                                                                             \
    extern "C" __global__ void retention_merge_##SUFFIX(const T *__restrict__ o, const T *__restrict__ u,         \
                                                        T *__restrict__ out, const long long rows, const int l,     \
                                                        const int heads, const int hd) {                          \
        retention_merge<T>(o, u, out, rows, l, heads, hd);                                                        \
    }
RETENTION(f32, float)
RETENTION(bf16, __nv_bfloat16)
