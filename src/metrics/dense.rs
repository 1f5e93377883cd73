//! Where the metrics' dense pairwise passes run: the exact kNN (the Benchmarker's 90-NN, kBET's
//! kNN in each label's diffusion map) and the label silhouette's per-label distance sums, the
//! O(n² d) work of a benchmark. On the CPU by default (`neighbors.rs`, `silhouette.rs`); with a
//! GPU (`benchmark --device cuda`) on it (`gpu/pairwise.rs`), the same definitions: sums of
//! squared differences in f32, self at distance 0, ties to the smaller index.
//!
//! A GPU pass that fails (out of memory, a driver error) runs on the CPU instead, and says so in
//! [`Dense::fallbacks`], which the benchmark task reports as warnings and in results.json. Each
//! pass is timed ([`Dense::passes`]), with kBET's diffusion maps beside them (the CPU's share).

use std::sync::Mutex;
use std::time::Instant;

use super::neighbors::{exact_knn, NeighborsResults};

/// The device of the dense passes, and what fell back from it to the CPU.
#[derive(Default)]
pub struct Dense {
    #[cfg(feature = "cuda")]
    gpu: Option<candle_core::CudaDevice>,
    fallbacks: Mutex<Vec<String>>,
    passes: Mutex<Vec<Pass>>,
}

/// One timed pass: what, over how many cells, where, how long (wall seconds; passes of kBET's
/// labels run at once, so their seconds may sum past the metric's).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Pass {
    pub what: &'static str,
    pub cells: usize,
    pub device: &'static str,
    pub seconds: f64,
}

impl Dense {
    /// Problems smaller than this many cells stay on the CPU (a few milliseconds there).
    pub const GPU_MIN_CELLS: usize = 2048;

    /// Everything on the CPU.
    pub fn cpu() -> Dense {
        Dense::default()
    }

    /// On `device`: a GPU when it is one (in a CUDA build), else the CPU.
    pub fn on(device: &candle_core::Device) -> Dense {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => Dense { gpu: Some(d.clone()), ..Default::default() },
            _ => Dense::cpu(),
        }
    }

    /// Whether the dense passes go to a GPU.
    pub fn is_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.gpu.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Where the passes run, for reports: "cpu" or "cuda".
    pub fn name(&self) -> &'static str {
        if self.is_gpu() {
            "cuda"
        } else {
            "cpu"
        }
    }

    /// The GPU passes that ran on the CPU instead, and why.
    pub fn fallbacks(&self) -> Vec<String> {
        self.fallbacks.lock().map(|f| f.clone()).unwrap_or_default()
    }

    #[allow(dead_code)]
    fn fell_back(&self, what: String) {
        if let Ok(mut f) = self.fallbacks.lock() {
            f.push(what);
        }
    }

    /// The passes so far, in the order they ended.
    pub fn passes(&self) -> Vec<Pass> {
        self.passes.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Record a pass that began at `t`.
    pub fn record(&self, what: &'static str, cells: usize, device: &'static str, t: Instant) {
        if let Ok(mut p) = self.passes.lock() {
            p.push(Pass { what, cells, device, seconds: t.elapsed().as_secs_f64() });
        }
    }

    /// The exact `k`-NN of `x` (`n x d`), self included: [`exact_knn`]'s result.
    pub fn knn(&self, what: &'static str, x: &[f32], n: usize, d: usize, k: usize) -> NeighborsResults {
        let t = Instant::now();
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.gpu {
            if n >= Self::GPU_MIN_CELLS && k <= crate::gpu::pairwise::MAX_K {
                match crate::gpu::pairwise::Cells::new(dev, x, n, d).and_then(|c| c.knn(k)) {
                    Ok((indices, distances)) => {
                        self.record(what, n, "cuda", t);
                        return NeighborsResults::new(indices, distances, n, k);
                    }
                    Err(e) => self.fell_back(format!("{what} ({k}-NN of {n} cells) ran on the CPU: the GPU's failed ({e})")),
                }
            }
        }
        let nn = exact_knn(x, n, d, k);
        self.record(what, n, "cpu", t);
        nn
    }

    /// Each cell's sum of Euclidean distances to each label's cells (`n x n_labels`), the cells
    /// sorted by label (`codes` ascending); `None` where the CPU should compute them (no GPU, a
    /// small problem, or the GPU failed).
    pub fn label_sums(&self, x: &[f32], n: usize, d: usize, codes: &[u32], n_labels: usize) -> Option<Vec<f64>> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.gpu {
            if n >= Self::GPU_MIN_CELLS {
                let t = Instant::now();
                match crate::gpu::pairwise::Cells::new(dev, x, n, d).and_then(|c| c.label_sums(codes, n_labels)) {
                    Ok(s) => {
                        self.record("label silhouette distances", n, "cuda", t);
                        return Some(s);
                    }
                    Err(e) => self.fell_back(format!("the label silhouette's distances of {n} cells ran on the CPU: the GPU's failed ({e})")),
                }
            }
        }
        let _ = (x, n, d, codes, n_labels);
        None
    }
}
