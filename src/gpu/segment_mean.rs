//! The mean of row spans of a `tokens x d` tensor, one span a cell: the cell embeddings of packed
//! encoders (`PackedBert::mean_spans`: Geneformer's mean over a cell's tokens). On a GPU one
//! kernel pools a whole batch (`kernels/encoder_ops.cu` `segment_mean_*`); candle's ops take a
//! narrow, a cast and a mean a cell, three kernel launches each, which at 64 cells a batch cost
//! more than a small model's encoder layers. Elsewhere the caller keeps candle's ops.

use candle_core::{DType, Result, Tensor};

/// Whether [`mean_spans`] takes `hidden`: a CUDA build, `hidden` on a GPU in bf16 or f32.
pub fn applies(hidden: &Tensor) -> bool {
    cfg!(feature = "cuda") && hidden.device().is_cuda() && matches!(hidden.dtype(), DType::BF16 | DType::F32) && hidden.rank() == 2
}

/// The mean of `hidden`'s rows `start..start + count` for each (start, count), as f32
/// `spans x d`; an empty span gives zeros. `applies` says when.
pub fn mean_spans(hidden: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor> {
    let (tokens, _) = hidden.dims2()?;
    if !applies(hidden) {
        candle_core::bail!("segment mean: takes bf16 or f32 on a GPU (PackedBert::mean_spans runs candle's ops elsewhere)");
    }
    if let Some(&(s, c)) = spans.iter().find(|&&(s, c)| s + c > tokens) {
        candle_core::bail!("segment mean: rows {s}..{} are past the {tokens} rows", s + c);
    }
    #[cfg(feature = "cuda")]
    {
        let op = cuda::SegmentMean { starts_counts: spans.iter().map(|s| s.0 as u32).chain(spans.iter().map(|s| s.1 as u32)).collect() };
        hidden.contiguous()?.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("applies() is false without the cuda feature")
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CpuStorage, CudaDevice, CudaStorage, Layout, Result, Shape};

    pub struct SegmentMean {
        /// the spans' starts, then their counts (one upload)
        pub starts_counts: Vec<u32>,
    }

    impl candle_core::CustomOp1 for SegmentMean {
        fn name(&self) -> &'static str {
            "segment-mean"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("segment-mean is for CUDA; the CPU runs PackedBert::mean_spans's candle ops")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = s.device().clone();
            let (_, d) = l.shape().dims2()?;
            let Some((o0, o1)) = l.contiguous_offsets() else {
                candle_core::bail!("segment-mean: the input must be contiguous");
            };
            let n = self.starts_counts.len() / 2;
            let mut out = dev.alloc_zeros::<f32>(n * d)?;
            let longest = self.starts_counts[n..].iter().copied().max().unwrap_or(0) as usize;
            if n == 0 || d == 0 || longest == 0 {
                return Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, d))));
            }
            // from page-locked memory: the host does not wait for the encoder queued before
            let both = crate::gpu::upload::upload_slice(&self.starts_counts, &dev)?;
            let (starts, counts) = (both.slice(0..n), both.slice(n..2 * n));
            let threads = d.min(256);
            // a block: 64 rows of one span, `threads` columns (kernels/encoder_ops.cu)
            let cfg = LaunchConfig { grid_dim: (longest.div_ceil(64) as u32, n as u32, d.div_ceil(threads) as u32), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
            let d32 = d as i32;
            match s.dtype() {
                candle_core::DType::BF16 => launch(&dev, "segment_mean_bf16", &s.as_cuda_slice::<half::bf16>()?.slice(o0..o1), &starts, &counts, &mut out, d32, cfg)?,
                candle_core::DType::F32 => launch(&dev, "segment_mean_f32", &s.as_cuda_slice::<f32>()?.slice(o0..o1), &starts, &counts, &mut out, d32, cfg)?,
                other => candle_core::bail!("segment-mean: {other:?} input"),
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, d))))
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch<T>(dev: &CudaDevice, name: &str, x: &CudaView<T>, starts: &CudaView<u32>, counts: &CudaView<u32>, out: &mut CudaSlice<f32>, d: i32, cfg: LaunchConfig) -> Result<()> {
        let func = load_kernel!(dev, name, crate::gpu::fused_encoder::MODULE, crate::gpu::fused_encoder::PTX)?;
        let mut b = func.builder();
        b.arg(x);
        b.arg(starts);
        b.arg(counts);
        b.arg(out);
        b.arg(&d);
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}
