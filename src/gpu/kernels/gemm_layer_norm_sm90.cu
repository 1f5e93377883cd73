// One matrix product with its whole epilogue, for post-norm encoder layers 256 wide on Hopper
// (sm_90a):
//
//     x <- LayerNorm(x + A W^T + bias) * gamma + beta        (x: tokens x 256, in place)
//
// that is Geneformer V1's output projection (k = 256) with its residual and norm1, or its second
// feed-forward product (k = 512) with its residual and norm2 (gpu/fused_encoder.rs), in one pass:
// the sum never goes to memory and no separate layer-norm kernel reads it back. A block owns
// 128 whole rows (each warpgroup 64 rows x 256 columns, 128 f32 accumulators a thread), so the
// row statistics are reduced in registers, the 4 lanes of a row by shuffles; the sum stays f32
// until the norm (the unfused path rounds it to bf16 first). Mean, then variance about it.
//
// A (tokens x k) and W (256 x k, PyTorch's Linear layout, K-major for wgmma) stream through
// shared memory in 64-wide k chunks with cp.async, STAGES - 1 chunks ahead, and wgmma.mma_async
// reads both from 128-byte-swizzled tiles (sm90_common.cuh). The residual rows come in with the
// first chunk, whole 16-byte pieces, into a row-major tile (rows padded by 16 bytes, so the
// accumulator layout reads it without bank conflicts), and are the accumulators' starting values
// with the bias; the normalised rows go back through the same tile, so global memory sees only
// whole 16-byte pieces. (An earlier version that read and wrote straight from the accumulator
// layout, 4 bytes a lane and 8 rows a warp instruction, took 130.5 us instead of 90.2 at V1's
// output projection on the H200: the load/store unit, not the tensor cores, was its limit;
// BENCHMARKS.md, session 16.) k is a multiple of 64.
// Grid: ceil(tokens / 128); 256 threads; dynamic shared memory kGemmLnSmem.

#include "sm90_common.cuh"

namespace sm90 {

// d (64 x 256, f32) (+)= A (64 x 16 from shared, K-major) * B (16 x 256 from shared, K-major)
__device__ __forceinline__ void mma_ss_n256(float *d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(a), "l"(b), "r"(accumulate));
}

// the same sizes as gpu/gemm_layer_norm.rs (ROWS, SHARED)
constexpr int kGemmLnRows = 128, kGemmLnN = 256, kGemmLnStages = 3;
constexpr int kGemmLnStage = (kGemmLnRows + kGemmLnN) * 128;  // a chunk of A and of W
constexpr int kGemmLnPitch = kGemmLnN * 2 + 16;               // a row of the residual/output tile, bytes
[[maybe_unused]] constexpr int kGemmLnSmem = kGemmLnStages * kGemmLnStage + kGemmLnRows * kGemmLnPitch + 1024;

// the sum over the 4 lanes that share a row (a quad of the accumulator layout)
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float2 bf2(uint32_t u) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u)); }

__device__ __forceinline__ void gemm_layer_norm_n256(const __nv_bfloat16 *__restrict__ a, const __nv_bfloat16 *__restrict__ w,
                                                     const __nv_bfloat16 *__restrict__ bias, const __nv_bfloat16 *__restrict__ gamma,
                                                     const __nv_bfloat16 *__restrict__ beta, __nv_bfloat16 *x, const int tokens, const int k,
                                                     const float eps) {
    constexpr int ROWS = kGemmLnRows, N = kGemmLnN, STAGES = kGemmLnStages, PITCH = kGemmLnPitch, THREADS = 256;
    const int row0 = blockIdx.x * ROWS;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // bias, gamma and beta as bf16 pairs
    __shared__ uint32_t vec[3][N / 2];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t pad = (1024 - (raw & 1023)) & 1023;
    const uint32_t base = raw + pad;
    auto as = [&](int chunk) { return base + (chunk % STAGES) * kGemmLnStage; };
    auto ws = [&](int chunk) { return as(chunk) + ROWS * 128; };
    unsigned char *tile = smem_raw + pad + STAGES * kGemmLnStage;  // residual in, output out
    const uint32_t tile_s = base + STAGES * kGemmLnStage;

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    const int g = lane / 4, tig = lane % 4;

    for (int i = tid; i < 3 * N / 2; i += THREADS) {
        const __nv_bfloat16 *src = i < N / 2 ? bias : i < N ? gamma : beta;
        vec[i / (N / 2)][i % (N / 2)] = reinterpret_cast<const uint32_t *>(src)[i % (N / 2)];
    }
    // the residual rows, 32 16-byte pieces a row, 16 a thread (rows past the end zero-filled)
#pragma unroll
    for (int i = 0; i < ROWS * (N / 8) / THREADS; i++) {
        const int e = tid + i * THREADS, r = e / (N / 8), q = e % (N / 8);
        const bool ok = row0 + r < tokens;
        copy16(tile_s + r * PITCH + q * 16, ok ? x + (size_t)(row0 + r) * N + q * 8 : x, ok);
    }
    const int chunks = k / 64;
    // this thread's copies: 16-byte piece tid % 8 of rows tid / 8 + 32 i of a chunk (4 rows of A,
    // 8 of W); row r + 32 i sits 4096 bytes after row r in a swizzled tile
    const int lr = tid / 8, lc = tid % 8;
    const uint32_t so = swz(lr, lc);
    const __nv_bfloat16 *ap = a + (size_t)(row0 + lr) * k + lc * 8, *wp = w + (size_t)lr * k + lc * 8;
    const size_t step = (size_t)32 * k;  // 32 rows
    auto load = [&](int chunk) {
        const int k0 = chunk * 64;
        const uint32_t sa = as(chunk) + so, sw = ws(chunk) + so;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const bool ok = row0 + lr + 32 * i < tokens;
            copy16(sa + i * 4096, ok ? ap + i * step + k0 : a, ok);
        }
#pragma unroll
        for (int i = 0; i < 8; i++) copy16(sw + i * 4096, wp + i * step + k0, true);
    };
    // chunks 0 .. STAGES - 2 ahead, a copy group each (the residual goes with chunk 0)
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < chunks) load(s);
        copy_commit();
    }

    // this thread's rows lr0 and lr0 + 8 of the tile; its columns 8 j + 2 tig (+1), j < 32
    const int lr0 = wg * 64 + warp * 16 + g;
    uint32_t *t0 = reinterpret_cast<uint32_t *>(tile + lr0 * PITCH) + tig;
    uint32_t *t1 = reinterpret_cast<uint32_t *>(tile + (lr0 + 8) * PITCH) + tig;
    float acc[128];
    for (int c = 0; c < chunks; c++) {
        // chunk c is in shared memory and every warpgroup is done with chunk c - 1, whose
        // buffer chunk c + STAGES - 1 then takes
        copy_wait<STAGES - 2>();
        fence_async_shared();
        __syncthreads();
        if (c == 0) {  // the accumulators start as residual + bias
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const float2 bb = bf2(vec[0][4 * j + tig]), v0 = bf2(t0[4 * j]), v1 = bf2(t1[4 * j]);
                acc[4 * j] = v0.x + bb.x;
                acc[4 * j + 1] = v0.y + bb.y;
                acc[4 * j + 2] = v1.x + bb.x;
                acc[4 * j + 3] = v1.y + bb.y;
            }
        }
        if (c + STAGES - 1 < chunks) load(c + STAGES - 1);
        copy_commit();
        const uint32_t at = as(c) + wg * 64 * 128, wt = ws(c);
#pragma unroll
        for (int i = 0; i < 128; i++) pin(acc[i]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) mma_ss_n256(acc, desc(at + kk * 32, 16, 1024), desc(wt + kk * 32, 16, 1024), 1);
        wg_commit();
        wg_wait_all();
#pragma unroll
        for (int i = 0; i < 128; i++) pin(acc[i]);
    }

    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        s0 += acc[4 * j] + acc[4 * j + 1];
        s1 += acc[4 * j + 2] + acc[4 * j + 3];
    }
    const float mean0 = quad_sum(s0) * (1.f / N), mean1 = quad_sum(s1) * (1.f / N);
    float q0 = 0.f, q1 = 0.f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        acc[4 * j] -= mean0;
        acc[4 * j + 1] -= mean0;
        acc[4 * j + 2] -= mean1;
        acc[4 * j + 3] -= mean1;
        q0 += acc[4 * j] * acc[4 * j] + acc[4 * j + 1] * acc[4 * j + 1];
        q1 += acc[4 * j + 2] * acc[4 * j + 2] + acc[4 * j + 3] * acc[4 * j + 3];
    }
    const float i0 = rsqrtf(quad_sum(q0) * (1.f / N) + eps), i1 = rsqrtf(quad_sum(q1) * (1.f / N) + eps);
    // the normalised rows into the tile, where this thread read its residual
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const float2 gg = bf2(vec[1][4 * j + tig]), ee = bf2(vec[2][4 * j + tig]);
        t0[4 * j] = pack(acc[4 * j] * i0 * gg.x + ee.x, acc[4 * j + 1] * i0 * gg.y + ee.y);
        t1[4 * j] = pack(acc[4 * j + 2] * i1 * gg.x + ee.x, acc[4 * j + 3] * i1 * gg.y + ee.y);
    }
    __syncthreads();
    // and out in whole 16-byte pieces, rows below tokens
#pragma unroll 4
    for (int i = 0; i < ROWS * (N / 8) / THREADS; i++) {
        const int e = tid + i * THREADS, r = e / (N / 8), q = e % (N / 8);
        if (row0 + r < tokens) *reinterpret_cast<uint4 *>(x + (size_t)(row0 + r) * N + q * 8) = *reinterpret_cast<const uint4 *>(tile + r * PITCH + q * 16);
    }
}

}  // namespace sm90

// x (tokens x 256) <- LayerNorm(x + a W^T + bias) * gamma + beta: Geneformer V1's output
// projection (k = 256) and second feed-forward product (k = 512) with their residuals and norms
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_bias_residual_layer_norm_n256_sm90(const __nv_bfloat16 *__restrict__ a, const __nv_bfloat16 *__restrict__ w,
                                        const __nv_bfloat16 *__restrict__ bias, const __nv_bfloat16 *__restrict__ gamma,
                                        const __nv_bfloat16 *__restrict__ beta, __nv_bfloat16 *x, const int tokens, const int k,
                                        const float eps) {
    sm90::gemm_layer_norm_n256(a, w, bias, gamma, beta, x, tokens, k, eps);
}
