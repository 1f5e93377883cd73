//! The mean and the column maxima of row spans of a `tokens x d` tensor, one span a cell: the
//! cell embeddings of packed encoders (Geneformer's mean over a cell's tokens, scFoundation's max
//! and mean over its genes). On a GPU one kernel pools a whole batch (`kernels/encoder_ops.cu`
//! `segment_mean_*`, `segment_max_*`); candle's ops take a narrow, a cast and a reduction a
//! cell, three kernel launches each, which at 64 cells a batch cost more than a small model's
//! encoder layers. Elsewhere (the CPU, other dtypes) candle's ops, a span at a time: the
//! kernels' reference in `__bench-encoder --check`.

use candle_core::{DType, Result, Tensor};

/// Whether the kernels take `hidden`: a CUDA build, `hidden` on a GPU in bf16 or f32.
pub fn applies(hidden: &Tensor) -> bool {
    cfg!(feature = "cuda") && hidden.device().is_cuda() && matches!(hidden.dtype(), DType::BF16 | DType::F32) && hidden.rank() == 2
}

/// The pooling of a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    Mean,
    Max,
}

/// The mean of `hidden`'s rows `start..start + count` for each (start, count), as f32
/// `spans x d`; an empty span gives zeros.
pub fn mean_spans(hidden: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor> {
    pool_spans(hidden, spans, Pool::Mean)
}

/// The column maxima of `hidden`'s rows `start..start + count` for each (start, count), as f32
/// `spans x d`; an empty span gives zeros.
pub fn max_spans(hidden: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor> {
    pool_spans(hidden, spans, Pool::Max)
}

/// `pool` over each span: one kernel on a GPU (`applies`), candle's ops elsewhere.
pub fn pool_spans(hidden: &Tensor, spans: &[(usize, usize)], pool: Pool) -> Result<Tensor> {
    let (tokens, _) = hidden.dims2()?;
    if let Some(&(s, c)) = spans.iter().find(|&&(s, c)| s + c > tokens) {
        candle_core::bail!("segment pool: rows {s}..{} are past the {tokens} rows", s + c);
    }
    if !applies(hidden) {
        return pool_spans_candle(hidden, spans, pool);
    }
    #[cfg(feature = "cuda")]
    {
        let op = cuda::SegmentPool { starts_counts: spans.iter().map(|s| s.0 as u32).chain(spans.iter().map(|s| s.1 as u32)).collect(), pool };
        hidden.contiguous()?.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("applies() is false without the cuda feature")
}

/// [`pool_spans`] in candle's ops, a span at a time, in f32.
pub fn pool_spans_candle(hidden: &Tensor, spans: &[(usize, usize)], pool: Pool) -> Result<Tensor> {
    let d = hidden.dims2()?.1;
    let mut rows = Vec::with_capacity(spans.len());
    for &(s, count) in spans {
        rows.push(if count == 0 {
            Tensor::zeros((1, d), DType::F32, hidden.device())?
        } else {
            let part = hidden.narrow(0, s, count)?.to_dtype(DType::F32)?;
            match pool {
                Pool::Mean => part.mean_keepdim(0)?,
                Pool::Max => part.max_keepdim(0)?,
            }
        });
    }
    if rows.is_empty() {
        return Tensor::zeros((0, d), DType::F32, hidden.device());
    }
    Tensor::cat(&rows, 0)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CpuStorage, CudaDevice, CudaStorage, Layout, Result, Shape};

    use super::Pool;

    pub struct SegmentPool {
        /// the spans' starts, then their counts (one upload)
        pub starts_counts: Vec<u32>,
        pub pool: Pool,
    }

    impl candle_core::CustomOp1 for SegmentPool {
        fn name(&self) -> &'static str {
            "segment-pool"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("segment-pool is for CUDA; the CPU runs segment_pool::pool_spans_candle")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = s.device().clone();
            let (_, d) = l.shape().dims2()?;
            let Some((o0, o1)) = l.contiguous_offsets() else {
                candle_core::bail!("segment-pool: the input must be contiguous");
            };
            let n = self.starts_counts.len() / 2;
            let longest = self.starts_counts[n..].iter().copied().max().unwrap_or(0) as usize;
            if n == 0 || d == 0 || longest == 0 {
                let out = dev.alloc_zeros::<f32>(n * d)?;
                return Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, d))));
            }
            // from page-locked memory: the host does not wait for the encoder queued before
            let both = crate::gpu::upload::upload_slice(&self.starts_counts, &dev)?;
            let (starts, counts) = (both.slice(0..n), both.slice(n..2 * n));
            let threads = d.min(256);
            // a block: 64 rows of one span, `threads` columns (kernels/encoder_ops.cu)
            let cfg = LaunchConfig { grid_dim: (longest.div_ceil(64) as u32, n as u32, d.div_ceil(threads) as u32), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
            let d32 = d as i32;
            let out = match self.pool {
                Pool::Mean => {
                    let mut out = dev.alloc_zeros::<f32>(n * d)?;
                    launch(&dev, "segment_mean", s, (o0, o1), &starts, &counts, &mut out, d32, cfg)?;
                    out
                }
                Pool::Max => {
                    // order-keeping keys merged by atomicMax, then turned back into floats
                    let mut keys = dev.alloc_zeros::<u32>(n * d)?;
                    launch(&dev, "segment_max", s, (o0, o1), &starts, &counts, &mut keys, d32, cfg)?;
                    let mut out = unsafe { dev.alloc::<f32>(n * d)? };
                    let func = load_kernel!(dev, "segment_max_decode", crate::gpu::fused_encoder::MODULE, crate::gpu::fused_encoder::PTX)?;
                    let total = (n * d) as u32;
                    let mut b = func.builder();
                    b.arg(&keys);
                    b.arg(&mut out);
                    b.arg(&total);
                    unsafe { b.launch(LaunchConfig { grid_dim: (total.div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) }.w()?;
                    out
                }
            };
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, d))))
        }
    }

    /// Kernel `{kernel}_bf16` or `{kernel}_f32` (by `s`'s dtype) over `s`'s values `range`.
    #[allow(clippy::too_many_arguments)]
    fn launch<O: DeviceRepr>(dev: &CudaDevice, kernel: &str, s: &CudaStorage, range: (usize, usize), starts: &CudaView<u32>, counts: &CudaView<u32>, out: &mut CudaSlice<O>, d: i32, cfg: LaunchConfig) -> Result<()> {
        let (o0, o1) = range;
        match s.dtype() {
            candle_core::DType::BF16 => launch_typed(dev, &format!("{kernel}_bf16"), &s.as_cuda_slice::<half::bf16>()?.slice(o0..o1), starts, counts, out, d, cfg),
            candle_core::DType::F32 => launch_typed(dev, &format!("{kernel}_f32"), &s.as_cuda_slice::<f32>()?.slice(o0..o1), starts, counts, out, d, cfg),
            other => candle_core::bail!("segment-pool: {other:?} input"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_typed<T, O: DeviceRepr>(dev: &CudaDevice, name: &str, x: &CudaView<T>, starts: &CudaView<u32>, counts: &CudaView<u32>, out: &mut CudaSlice<O>, d: i32, cfg: LaunchConfig) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn spans_pool_their_own_rows() {
        let x = Tensor::new(&[[1f32, -5.0], [3.0, -1.0], [-2.0, 4.0], [7.0, 0.5]], &Device::Cpu).unwrap();
        let spans = [(0, 2), (1, 3), (3, 0)];
        let mean: Vec<f32> = mean_spans(&x, &spans).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        for (got, want) in mean.iter().zip([2.0, -3.0, 8.0 / 3.0, 3.5 / 3.0, 0.0, 0.0]) {
            assert!((got - want).abs() < 1e-6, "{mean:?}");
        }
        let max = max_spans(&x, &spans).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(max, vec![vec![3.0, -1.0], vec![7.0, 4.0], vec![0.0, 0.0]]);
        assert!(max_spans(&x, &[(3, 2)]).unwrap_err().to_string().contains("past the 4 rows"));
    }
}
