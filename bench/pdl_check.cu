// Programmatic dependent launch (PDL) alone, without scfoundry: does it run on this machine, does
// the dependent kernel see the writes of the kernel before it, and what does it save a kernel
// boundary. PDL in the encoder measured +0.5-1.4% on Geneformer V1 on one H200 machine, then
// binaries with it hung on others of the same kind (BENCHMARKS.md, "GPU: transformer encoders";
// the code is in commit 2de08cb). This harness asks the question in a few seconds, case by case, from the
// safest to the least safe, and stops at the first case that does not finish in 10 s (a hung
// stream cannot be recovered in-process): the case it names is the cause.
//
// A producer grid (every block spins ~20 us, then adds 1 to a counter) is followed by a consumer
// grid (griddepcontrol.wait, then each block checks that the counter holds every producer
// block's add), on CUDA's per-thread default stream (candle's) and on a created stream, launched
// as <<<>>>, by cudaLaunchKernelEx without attributes, and with programmatic stream serialisation.
// Then, for the cases that ran, 2,000 producer/consumer pairs timed with events: the difference
// between plain and PDL launches is what PDL saves a boundary.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -o pdl_check bench/pdl_check.cu          # SASS
//   nvcc -gencode arch=compute_90a,code=compute_90a -O3 -o pdl_check_ptx bench/pdl_check.cu  # PTX, JIT by the driver, as scfoundry loads its kernels
//   ./pdl_check                          # scripts/build-cuda.sh builds both into dist/cuda
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cuda_check.cuh"

constexpr int kBlocks = 264;  // two waves' worth on 132 SMs at one block an SM

__global__ void producer(int *counter, long long spin, int trigger) {
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    if (trigger) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(counter, 1);
}

__global__ void consumer(const int *counter, int *ok, int expect) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    if (threadIdx.x == 0) ok[blockIdx.x] = *reinterpret_cast<const volatile int *>(counter) == expect;
}

enum class Launch { Plain, Ex, Pdl };
static const char *name(Launch l) { return l == Launch::Plain ? "<<<>>>" : l == Launch::Ex ? "cudaLaunchKernelEx" : "cudaLaunchKernelEx + PDL"; }

static void launch_consumer(Launch how, cudaStream_t s, const int *counter, int *ok, int expect) {
    if (how == Launch::Plain) {
        consumer<<<kBlocks, 128, 0, s>>>(counter, ok, expect);
        return;
    }
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(kBlocks);
    cfg.blockDim = dim3(128);
    cfg.stream = s;
    cfg.attrs = how == Launch::Pdl ? &attr : nullptr;
    cfg.numAttrs = how == Launch::Pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, consumer, counter, ok, expect));
}

// the stream's work done within `seconds`, or false (the caller stops: a hung stream stays hung)
static bool finishes(cudaStream_t s, double seconds) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
        const cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) return true;
        if (e != cudaErrorNotReady) {
            std::printf("  error: %s\n", cudaGetErrorString(e));
            std::exit(1);
        }
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

int main() {
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const long long spin = (long long)clock_khz * 20 / 1000;  // ~20 us at the rated clock
    int *counter, *ok;
    CK(cudaMalloc(&counter, sizeof(int)));
    CK(cudaMalloc(&ok, kBlocks * sizeof(int)));
    cudaStream_t created;
    CK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    const struct {
        const char *label;
        cudaStream_t s;
    } streams[] = {{"created stream", created}, {"per-thread default stream", cudaStreamPerThread}};
    bool ran[2][3] = {};
    for (int si = 0; si < 2; si++) {
        for (Launch how : {Launch::Plain, Launch::Ex, Launch::Pdl}) {
            for (int trigger = 0; trigger < 2; trigger++) {
                cudaStream_t s = streams[si].s;
                CK(cudaMemsetAsync(counter, 0, sizeof(int), s));
                CK(cudaMemsetAsync(ok, 0, kBlocks * sizeof(int), s));
                producer<<<kBlocks, 128, 0, s>>>(counter, spin, trigger);
                launch_consumer(how, s, counter, ok, kBlocks);
                std::printf("%-26s %-26s trigger %d: ", streams[si].label, name(how), trigger);
                std::fflush(stdout);
                if (!finishes(s, 10.0)) {
                    std::printf("DID NOT FINISH in 10 s (stopping here)\n");
                    return 2;
                }
                int host[kBlocks];
                CK(cudaMemcpy(host, ok, sizeof host, cudaMemcpyDeviceToHost));
                int good = 0;
                for (int v : host) good += v;
                std::printf("ran, %d of %d consumer blocks saw every producer write%s\n", good, kBlocks, good == kBlocks ? "" : "  <-- WRONG");
                ran[si][(int)how] = (trigger == 0 || ran[si][(int)how]) && good == kBlocks;
            }
        }
    }
    // what a boundary costs: pairs back to back, plain against PDL (the producer triggering)
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int si = 0; si < 2; si++) {
        for (Launch how : {Launch::Plain, Launch::Pdl}) {
            if (!ran[si][(int)how]) continue;
            cudaStream_t s = streams[si].s;
            const int pairs = 2000;
            float ms = 0;
            for (int rep = 0; rep < 2; rep++) {  // the first round warms up
                CK(cudaMemsetAsync(counter, 0, sizeof(int), s));
                CK(cudaEventRecord(e0, s));
                for (int i = 0; i < pairs; i++) {
                    producer<<<kBlocks, 128, 0, s>>>(counter, spin / 20, 1);
                    launch_consumer(how, s, counter, ok, -1);
                }
                CK(cudaEventRecord(e1, s));
                if (!finishes(s, 30.0)) {
                    std::printf("timing %s on the %s DID NOT FINISH\n", name(how), streams[si].label);
                    return 2;
                }
                CK(cudaEventElapsedTime(&ms, e0, e1));
            }
            std::printf("%-26s %-26s %d pairs: %.2f us a pair\n", streams[si].label, name(how), pairs, ms * 1e3f / pairs);
        }
    }
    std::printf("done\n");
    return 0;
}
