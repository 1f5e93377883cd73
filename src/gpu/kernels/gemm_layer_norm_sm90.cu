// One matrix product with its whole epilogue, for post-norm encoder layers 256 wide on Hopper
// (sm_90a):
//
//     y <- LayerNorm(x + A W^T + bias) * gamma + beta        (x, y: tokens x 256; y = x in place)
//
// that is Geneformer V1's output projection (k = 256) with its residual and norm1, or its second
// feed-forward product (k = 512) with its residual and norm2 (gpu/fused_encoder.rs), in one pass:
// the sum never goes to memory and no separate layer-norm kernel reads it back. A block owns
// 128 whole rows (each warpgroup 64 rows x 256 columns, 128 f32 accumulators a thread), so the
// row statistics are reduced in registers, the 4 lanes of a row by shuffles; the sum stays f32
// until the norm (the unfused path rounds it to bf16 first). Mean, then variance about it.
//
// A (tokens x k) and W (256 x k, PyTorch's Linear layout, K-major for wgmma) stream through
// shared memory in 64-wide k chunks, and wgmma.mma_async reads both from 128-byte-swizzled tiles
// (sm90_common.cuh). The kernel is persistent and warp-specialised (details above the kernel
// below): TMA copies feed a ring of chunk buffers across tiles, so the next tile's operands
// arrive during this tile's epilogue, and the residual comes in and the output goes out as whole
// swizzled boxes. At V1's longest batch (130,721 tokens), k = 256 / 512: on an H100, 82.2 / 105.2
// us against 96.8 / 125.2 us for the kernel it replaced in the same call (one block of 128 rows
// at a time, cp.async, the residual in a padded row-major tile; commit 896ec22), whose first
// loads and epilogue were exposed, and 71.9 / 94.2 us for a copy of the same bytes; on the H200,
// 63.7 / 92.4 us (copy 51.7 / 67.2; the old kernel took 90.6 / 118.6 in an earlier measurement).
// Not kept: W resident in shared memory at k = 256 (loaded once a block; room for only two A
// buffers beside it): 78.5 us against 63.8 (commit 3e63382; BENCHMARKS.md). (The version before that read the residual and wrote the output straight from
// the accumulator layout, 4 bytes a lane and 8 rows a warp instruction: 130.5 us instead of 90.2
// at k = 256 on the H200, load/store-unit bound.) k is a multiple of 64.

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
constexpr int kGemmLnRows = 128, kGemmLnN = 256;

// the sum over the 4 lanes that share a row (a quad of the accumulator layout)
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float2 bf2(uint32_t u) { return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u)); }

// A persistent, warp-specialised kernel (one block an SM walking the 128-row tiles,
// tile += gridDim.x): warpgroups 0 and 1 compute (64 rows each, as
// above), warpgroup 2 moves memory with TMA. Its first thread streams the 64-wide chunks of A and
// W into a ring of kPlnStages buffers (mbarriers `full` and `empty` a buffer), across tiles, so the
// next tile's chunks arrive during this tile's epilogue, and loads the residual rows into the
// tile buffer (4 boxes of 128 rows x 64 columns, 128-byte swizzled) once the previous tile's
// output has left it; its second warp stores the normalised tile (`out_ready`, `res_empty`).
// Rows past `tokens` load as zeros and are not stored. The accumulators start at zero, and bias
// and residual are added in the epilogue, read from the swizzled tile (conflict-free in the
// accumulator layout: a quad's 16 bytes, 8 rows in 8 different 16-byte columns).
constexpr int kPlnStages = 3;
constexpr int kPlnA = kGemmLnRows * 128, kPlnW = kGemmLnN * 128, kPlnStage = kPlnA + kPlnW;  // a chunk of A and of W
constexpr int kPlnTile = kGemmLnRows * kGemmLnN * 2;                                           // residual in, output out
[[maybe_unused]] constexpr int kPlnSmem = kPlnStages * kPlnStage + kPlnTile + 1024 + 128;

__device__ __forceinline__ void gemm_layer_norm_n256_tma(const TensorMap &ta, const TensorMap &tw, const TensorMap &tx,
                                                         const TensorMap &ty, const __nv_bfloat16 *__restrict__ bias, const __nv_bfloat16 *__restrict__ gamma,
                                                         const __nv_bfloat16 *__restrict__ beta, const int tokens, const int k, const float eps) {
    constexpr int ROWS = kGemmLnRows, N = kGemmLnN, S = kPlnStages;
    const int tiles = (tokens + ROWS - 1) / ROWS, chunks = k / 64;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ uint32_t vec[3][N / 2];  // bias, gamma and beta as bf16 pairs
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t pad = (1024 - (raw & 1023)) & 1023;
    const uint32_t ring = raw + pad, tile_s = ring + S * kPlnStage, bars = tile_s + kPlnTile;
    const unsigned char *tile = smem_raw + pad + S * kPlnStage;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (S + s); };
    const uint32_t res_full = bars + 16 * S, res_empty = res_full + 8, out_ready = res_full + 16;

    const int tid = threadIdx.x;
    const int wg = tid / 128;
    const int warp = (tid % 128) / 32;
    const int lane = tid % 32;
    for (int i = tid; i < 3 * N / 2; i += blockDim.x) {
        const __nv_bfloat16 *src = i < N / 2 ? bias : i < N ? gamma : beta;
        vec[i / (N / 2)][i % (N / 2)] = reinterpret_cast<const uint32_t *>(src)[i % (N / 2)];
    }
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(full(s), 1);
            mbar_init(empty(s), 8);  // the 8 consumer warps
        }
        mbar_init(res_full, 1);
        mbar_init(res_empty, 1);
        mbar_init(out_ready, 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 2) {  // the memory warpgroup: one thread loads, one stores
        if (warp == 0 && lane == 0) {
            int n = 0, it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x, it++) {
                const int row0 = t * ROWS;
                auto residual = [&] {
                    mbar_wait(res_empty, (it & 1) ^ 1);
                    mbar_expect(res_full, kPlnTile);
                    for (int cb = 0; cb < N / 64; cb++) tma_load(tile_s + cb * kPlnA, tx, cb * 64, row0, res_full);
                };
                for (int c = 0; c < chunks; c++, n++) {
                    if (c == S) residual();  // after the chunks that fit the ring now
                    const int s = n % S;
                    mbar_wait(empty(s), ((n / S) & 1) ^ 1);
                    mbar_expect(full(s), kPlnStage);
                    tma_load(ring + s * kPlnStage, ta, c * 64, row0, full(s));
                    tma_load(ring + s * kPlnStage + kPlnA, tw, c * 64, 0, full(s));
                }
                if (chunks <= S) residual();
            }
        } else if (warp == 1 && lane == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x, it++) {
                mbar_wait(out_ready, it & 1);
                for (int cb = 0; cb < N / 64; cb++) tma_store(ty, cb * 64, t * ROWS, tile_s + cb * kPlnA);
                bulk_commit();
                bulk_wait<true>();
                mbar_arrive(res_empty);
            }
            bulk_wait<false>();
        }
        return;
    }

    // a compute warpgroup: rows r0 and r0 + 8 of the tile, columns 8 j + 2 tig (+1), j < 32
    const int g = lane / 4, tig = lane % 4;
    const int r0 = wg * 64 + warp * 16 + g;
    int n = 0, it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x, it++) {
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.f;
        for (int c = 0; c < chunks; c++, n++) {
            const int s = n % S;
            mbar_wait(full(s), (n / S) & 1);
            const uint32_t at = ring + s * kPlnStage + wg * 64 * 128, wt = ring + s * kPlnStage + kPlnA;
#pragma unroll
            for (int i = 0; i < 128; i++) pin(acc[i]);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) mma_ss_n256(acc, desc(at + kk * 32, 16, 1024), desc(wt + kk * 32, 16, 1024), 1);
            wg_commit();
            if (c > 0) {  // the previous chunk's products are done: its buffer is free
                wg_wait<1>();
                __syncwarp();
                if (lane == 0) mbar_arrive(empty((n - 1) % S));
            }
        }
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < 128; i++) pin(acc[i]);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty((n - 1) % S));

        // epilogue: + bias + residual, then the norm, written back where the residual was
        mbar_wait(res_full, it & 1);
        const unsigned char *p0 = tile + r0 * 128 + tig * 4, *p1 = p0 + 8 * 128;
        auto at = [&](const unsigned char *p, int j) {
            return const_cast<uint32_t *>(reinterpret_cast<const uint32_t *>(p + (j / 8) * kPlnA + (((j % 8) ^ g) << 4)));
        };
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const float2 bb = bf2(vec[0][4 * j + tig]), v0 = bf2(*at(p0, j)), v1 = bf2(*at(p1, j));
            acc[4 * j] += v0.x + bb.x;
            acc[4 * j + 1] += v0.y + bb.y;
            acc[4 * j + 2] += v1.x + bb.x;
            acc[4 * j + 3] += v1.y + bb.y;
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
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const float2 gg = bf2(vec[1][4 * j + tig]), ee = bf2(vec[2][4 * j + tig]);
            *at(p0, j) = pack(acc[4 * j] * i0 * gg.x + ee.x, acc[4 * j + 1] * i0 * gg.y + ee.y);
            *at(p1, j) = pack(acc[4 * j + 2] * i1 * gg.x + ee.x, acc[4 * j + 3] * i1 * gg.y + ee.y);
        }
        fence_async_shared();  // the generic writes, before the TMA store reads them
        __syncwarp();
        if (lane == 0) mbar_arrive(out_ready);
    }
}

}  // namespace sm90

// y (tokens x 256) <- LayerNorm(x + a W^T + bias) * gamma + beta: Geneformer V1's output
// projection (k = 256) and second feed-forward product (k = 512) with their residuals and norms.
// Grid min(tiles, SMs), 384 threads,
// dynamic shared memory kPlnSmem; ta: a (tokens x k), tw: W (256 x k), tx: x (tokens x 256), ty:
// y (tokens x 256; the same map as tx for in place, as every layer but the first runs it), each
// bf16 with 64 x 128 (W: 64 x 256) boxes, 128-byte swizzle, zero fill.
extern "C" __global__ void __launch_bounds__(384, 1)
gemm_bias_residual_layer_norm_n256_tma_sm90(const __grid_constant__ sm90::TensorMap ta, const __grid_constant__ sm90::TensorMap tw,
                                            const __grid_constant__ sm90::TensorMap tx, const __grid_constant__ sm90::TensorMap ty,
                                            const __nv_bfloat16 *__restrict__ bias,
                                            const __nv_bfloat16 *__restrict__ gamma, const __nv_bfloat16 *__restrict__ beta,
                                            const int tokens, const int k, const float eps) {
    sm90::gemm_layer_norm_n256_tma(ta, tw, tx, ty, bias, gamma, beta, tokens, k, eps);
}
