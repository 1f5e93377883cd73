//! Pairwise distances of cells on a GPU, for the scIB metrics' dense passes
//! (`metrics/dense.rs` chooses between these and the CPU's): the exact k nearest neighbours of
//! every cell, and every cell's sum of distances to each label (the silhouette's).
//!
//! Both walk the n x n distances in tiles that never stay: `kernels/pairwise.cu`
//! `sqdist_tile_f32` writes a block of [`QUERY_ROWS`] rows by [`CHUNK`] columns of squared
//! distances (sums of squared differences, as the CPU's exact search computes them), then
//! `knn_merge_f32` folds each row's chunk into its k-list (radix select, bitonic merge; ties go to
//! the smaller column, as on the CPU) or `label_sums_f32` adds each label's run of the chunk to
//! the row's sums (columns sorted by label). Device memory: the cells (n x d, d padded to 8), one
//! tile (QUERY_ROWS x CHUNK f32, 256 MiB) and the block's lists or sums.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use crate::gpu::KernelImage;

static PTX: KernelImage = kernel_image!("pairwise");
const MODULE: &str = "scfoundry_pairwise";

/// Query rows of a tile.
pub const QUERY_ROWS: usize = 8192;
/// Columns of a tile (`KNN_CHUNK` in the kernel: a row's chunk sits in shared memory).
pub const CHUNK: usize = 8192;
/// Largest k of [`Cells::knn`] (`KNN_PAIRS` in the kernel).
pub const MAX_K: usize = 256;

/// Cells uploaded once (rows padded with zero columns to a multiple of 8).
pub struct Cells {
    dev: CudaDevice,
    x: CudaSlice<f32>,
    n: usize,
    dp: usize,
}

impl Cells {
    pub fn new(dev: &CudaDevice, x: &[f32], n: usize, d: usize) -> Result<Cells> {
        assert_eq!(x.len(), n * d);
        // callers may be any thread of the pool (kBET's labels run at once)
        dev.cuda_stream().context().bind_to_thread().w()?;
        let dp = d.div_ceil(8).max(1) * 8;
        let mut padded = vec![0f32; n * dp];
        for (dst, src) in padded.chunks_exact_mut(dp).zip(x.chunks_exact(d.max(1))) {
            dst[..d].copy_from_slice(src);
        }
        let x = dev.clone_htod(&padded)?;
        Ok(Cells { dev: dev.clone(), x, n, dp })
    }

    fn tile(&self, q0: usize, nq: usize, c0: usize, nc: usize, tile: &mut CudaSlice<f32>) -> Result<()> {
        let func = load_kernel!(self.dev, "sqdist_tile_f32", MODULE, PTX)?;
        let (dp, q0, nq, c0, nc, ldd) = (self.dp as i32, q0 as i64, nq as i32, c0 as i64, nc as i32, CHUNK as i64);
        let mut b = func.builder();
        b.arg(&self.x);
        b.arg(&dp);
        b.arg(&q0);
        b.arg(&nq);
        b.arg(&c0);
        b.arg(&nc);
        b.arg(tile);
        b.arg(&ldd);
        let cfg = LaunchConfig { grid_dim: ((nc as u32).div_ceil(128), (nq as u32).div_ceil(128), 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature; x holds n x dp values, the tile
        // QUERY_ROWS x CHUNK, and q0 + nq, c0 + nc <= n.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// The exact `k` nearest cells of every cell, self included (distance 0): indices and
    /// Euclidean distances, `n x k` row-major, nearest first, ties to the smaller index.
    pub fn knn(&self, k: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        let n = self.n;
        if k == 0 || k > n || k > MAX_K {
            candle_core::bail!("GPU kNN: k = {k} must be 1..={} and at most the {n} cells", MAX_K);
        }
        let func = load_kernel!(self.dev, "knn_merge_f32", MODULE, PTX)?;
        let mut tile = self.dev.alloc_zeros::<f32>(QUERY_ROWS * CHUNK)?;
        let q_rows = QUERY_ROWS.min(n);
        let mut best_d = self.dev.alloc_zeros::<f32>(q_rows * k)?;
        let mut best_i = self.dev.alloc_zeros::<u32>(q_rows * k)?;
        let mut indices = vec![0u32; n * k];
        let mut distances = vec![0f32; n * k];
        for q0 in (0..n).step_by(QUERY_ROWS) {
            let nq = QUERY_ROWS.min(n - q0);
            for (ci, c0) in (0..n).step_by(CHUNK).enumerate() {
                let nc = CHUNK.min(n - c0);
                self.tile(q0, nq, c0, nc, &mut tile)?;
                let (ldd, nq32, nc32, c0_64, k32, first) = (CHUNK as i64, nq as i32, nc as i32, c0 as i64, k as i32, (ci == 0) as i32);
                let mut b = func.builder();
                b.arg(&tile);
                b.arg(&ldd);
                b.arg(&nq32);
                b.arg(&nc32);
                b.arg(&c0_64);
                b.arg(&k32);
                b.arg(&mut best_d);
                b.arg(&mut best_i);
                b.arg(&first);
                let cfg = LaunchConfig { grid_dim: (nq as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the arguments match the kernel's signature; the lists hold nq x k
                // entries, the tile nq rows of CHUNK, nc <= CHUNK (KNN_CHUNK) and k <= MAX_K.
                unsafe { b.launch(cfg) }.w()?;
            }
            let d = self.dev.clone_dtoh(&best_d.slice(0..nq * k))?;
            let i = self.dev.clone_dtoh(&best_i.slice(0..nq * k))?;
            indices[q0 * k..(q0 + nq) * k].copy_from_slice(&i);
            for (o, v) in distances[q0 * k..(q0 + nq) * k].iter_mut().zip(&d) {
                *o = v.sqrt();
            }
        }
        Ok((indices, distances))
    }

    /// Each cell's sum of Euclidean distances to the cells of each label: `n x n_labels`
    /// row-major. The cells must be sorted by label (`codes` ascending, `0..n_labels`).
    pub fn label_sums(&self, codes: &[u32], n_labels: usize) -> Result<Vec<f64>> {
        let n = self.n;
        assert_eq!(codes.len(), n);
        assert!(codes.windows(2).all(|w| w[0] <= w[1]), "label_sums: cells must be sorted by label");
        let func = load_kernel!(self.dev, "label_sums_f32", MODULE, PTX)?;
        // each chunk's runs of one label: (label, start, end) relative to the chunk
        let mut seg_label: Vec<i32> = Vec::new();
        let mut seg_start: Vec<i32> = Vec::new();
        let mut seg_end: Vec<i32> = Vec::new();
        let mut chunk_segs: Vec<(usize, usize)> = Vec::new();
        for c0 in (0..n).step_by(CHUNK) {
            let c1 = (c0 + CHUNK).min(n);
            let first = seg_label.len();
            let mut a = c0;
            while a < c1 {
                let l = codes[a];
                let mut e = a;
                while e < c1 && codes[e] == l {
                    e += 1;
                }
                seg_label.push(l as i32);
                seg_start.push((a - c0) as i32);
                seg_end.push((e - c0) as i32);
                a = e;
            }
            chunk_segs.push((first, seg_label.len()));
        }
        let (lab_d, start_d, end_d) = (self.dev.clone_htod(&seg_label)?, self.dev.clone_htod(&seg_start)?, self.dev.clone_htod(&seg_end)?);
        let mut tile = self.dev.alloc_zeros::<f32>(QUERY_ROWS * CHUNK)?;
        let q_rows = QUERY_ROWS.min(n);
        let mut sums_d = self.dev.alloc_zeros::<f64>(q_rows * n_labels)?;
        let mut sums = vec![0f64; n * n_labels];
        for q0 in (0..n).step_by(QUERY_ROWS) {
            let nq = QUERY_ROWS.min(n - q0);
            self.dev.memcpy_htod(&vec![0f64; q_rows * n_labels], &mut sums_d)?;
            for (ci, c0) in (0..n).step_by(CHUNK).enumerate() {
                let nc = CHUNK.min(n - c0);
                self.tile(q0, nq, c0, nc, &mut tile)?;
                let (s0, s1) = chunk_segs[ci];
                let (ldd, nq32, nl32) = (CHUNK as i64, nq as i32, n_labels as i32);
                let (l, s, e) = (lab_d.slice(s0..s1), start_d.slice(s0..s1), end_d.slice(s0..s1));
                let mut b = func.builder();
                b.arg(&tile);
                b.arg(&ldd);
                b.arg(&nq32);
                b.arg(&l);
                b.arg(&s);
                b.arg(&e);
                b.arg(&nl32);
                b.arg(&mut sums_d);
                let cfg = LaunchConfig { grid_dim: (nq as u32, (s1 - s0) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the arguments match the kernel's signature; the runs lie inside the
                // chunk's nc columns, labels < n_labels, the sums hold nq x n_labels values.
                unsafe { b.launch(cfg) }.w()?;
            }
            let part = self.dev.clone_dtoh(&sums_d.slice(0..nq * n_labels))?;
            sums[q0 * n_labels..(q0 + nq) * n_labels].copy_from_slice(&part);
        }
        Ok(sums)
    }
}
