// Adam on a GPU with clip_grad_norm_ folded in (src/gpu/adam.rs launches these; src/nn/optim.rs
// holds the rule and the CPU path, whose arithmetic these repeat, rounding for rounding):
//   sum_squares_f32  *total += sum of g[i]^2 (f32 within a block, f64 across blocks)
//   adam_moments_f32 g' = g * min(1, max_norm / (sqrt(*total) + 1e-6)) (max_norm <= 0: g' = g),
//                    m = m b1 + g' (1 - b1), v = v b2 + g'^2 (1 - b2); m and v one buffer, (2, n)
//   adam_update_f32  p -= m / (sqrt(v) / sqrt(1 - b2^t) + eps) * (lr / (1 - b1^t))
// The state moves once a step in three launches a parameter, where candle's ops took fourteen
// passes (each allocating its output) and a read-back for the norm.

extern "C" __global__ void sum_squares_f32(const float *__restrict__ g, const unsigned long long n, double *__restrict__ total) {
    float s = 0.f;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        s = fmaf(g[i], g[i], s);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __shared__ float warps[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warps[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x >> 5) ? warps[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) atomicAdd(total, (double)s);
    }
}

extern "C" __global__ void adam_moments_f32(const float *__restrict__ g, float *__restrict__ mv, const unsigned long long n,
                                            const double *__restrict__ total, const double max_norm, const float b1,
                                            const float one_minus_b1, const float b2, const float one_minus_b2) {
    float coef = 1.f;
    bool clip = false;
    if (max_norm > 0.0) {
        const double c = max_norm / (sqrt(*total) + 1e-6);
        clip = c < 1.0;
        coef = (float)c;
    }
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float gi = clip ? __fmul_rn(g[i], coef) : g[i];
        mv[i] = __fadd_rn(__fmul_rn(mv[i], b1), __fmul_rn(gi, one_minus_b1));
        mv[n + i] = __fadd_rn(__fmul_rn(mv[n + i], b2), __fmul_rn(__fmul_rn(gi, gi), one_minus_b2));
    }
}

extern "C" __global__ void adam_update_f32(float *__restrict__ p, const float *__restrict__ mv, const unsigned long long n,
                                           const float inv_bc2_sqrt, const float eps, const float step_size) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(mv[n + i]), inv_bc2_sqrt), eps);
        p[i] = __fsub_rn(p[i], __fmul_rn(__fdiv_rn(mv[i], denom), step_size));
    }
}
