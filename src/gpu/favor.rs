//! Performer's FAVOR+ features in one pass (`kernels/encoder_ops.cu` `favor_features_f32`, and
//! `favor_features_bf16` for bf16 rows, its math in f32):
//! scBERT's `softmax_kernel` after the projection, `(exp(dash - diag - stab) + eps) * ratio`.
//! candle's ops take five passes over the `cells x heads x genes x features` tensor for it (and
//! one more for each row's maximum); `methods/scbert.rs` keeps them as its CPU path and this
//! op's reference, and takes this op on a GPU. On the CPU the op runs the kernel's loop on the
//! host (what the unit test checks against candle's ops); on a GPU, `__bench-encoder --arch
//! scbert` compares the kernel with them on the first batch (`--unfused` times candle's ops).

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

/// The op: the kernel on a GPU, its loop on the host on the CPU.
struct Favor {
    m: usize,
    has_stab: bool,
    rows_per_stab: usize,
    ratio: f32,
    eps: f32,
}

impl candle_core::CustomOp3 for Favor {
    fn name(&self) -> &'static str {
        "favor-features"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, d: &CpuStorage, dl: &Layout, s: &CpuStorage, sl: &Layout) -> Result<(CpuStorage, Shape)> {
        fn slice<'s>(st: &'s CpuStorage, l: &Layout) -> Result<&'s [f32]> {
            let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("favor-features: inputs must be contiguous") };
            Ok(&st.as_slice::<f32>()?[a..b])
        }
        let (x, diag, stab) = (slice(x, xl)?, slice(d, dl)?, slice(s, sl)?);
        let mut out = vec![0f32; x.len()];
        for (row, (xs, os)) in x.chunks(self.m).zip(out.chunks_mut(self.m)).enumerate() {
            let st = if self.has_stab { stab[row / self.rows_per_stab] } else { xs.iter().copied().fold(f32::NEG_INFINITY, f32::max) };
            for (o, &v) in os.iter_mut().zip(xs) {
                *o = (((v - diag[row]) - st).exp() + self.eps) * self.ratio;
            }
        }
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout, d: &candle_core::CudaStorage, dl: &Layout, s: &candle_core::CudaStorage, sl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::forward(self, x, xl, d, dl, s, sl)
    }
}

/// `(exp(dash - diag - stab) + eps) * ratio` over `dash`'s rows of `m` values (its last
/// dimension), `diag` one value a row; `stab`: `None` for each row's own maximum, or one value
/// for each `rows / stab.len()` consecutive rows.
pub fn features(dash: &Tensor, diag: &Tensor, stab: Option<&Tensor>, ratio: f64, eps: f64) -> Result<Tensor> {
    let m = dash.dims().last().copied().unwrap_or(0);
    let rows = dash.elem_count() / m.max(1);
    if diag.elem_count() != rows || stab.is_some_and(|s| s.elem_count() == 0 || rows % s.elem_count() != 0) {
        candle_core::bail!("favor-features: {rows} rows of {m}, {} diagonal values, {:?} stabilisers", diag.elem_count(), stab.map(|s| s.elem_count()));
    }
    if diag.dtype() != DType::F32 || stab.is_some_and(|s| s.dtype() != DType::F32) {
        candle_core::bail!("favor-features takes f32 diagonal values and stabilisers");
    }
    let op = Favor { m, has_stab: stab.is_some(), rows_per_stab: stab.map_or(1, |s| rows / s.elem_count()), ratio: ratio as f32, eps: eps as f32 };
    let (diag, stab) = (diag.contiguous()?, stab.cloned().unwrap_or_else(|| diag.clone()).contiguous()?);
    match dash.dtype() {
        // bf16 rows on the CPU: the f32 loop between two conversions (the roundings of the
        // kernel's bf16 instance, whose math is f32)
        DType::BF16 if !dash.device().is_cuda() => dash.to_dtype(DType::F32)?.apply_op3_no_bwd(&diag, &stab, &op)?.to_dtype(DType::BF16),
        DType::F32 | DType::BF16 => dash.contiguous()?.apply_op3_no_bwd(&diag, &stab, &op),
        d => candle_core::bail!("favor-features takes f32 or bf16 rows, not {d:?}"),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    pub(super) fn forward(op: &super::Favor, x: &CudaStorage, xl: &Layout, d: &CudaStorage, dl: &Layout, s: &CudaStorage, sl: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = x.device().clone();
        let range = |l: &Layout| l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("favor-features: inputs must be contiguous".into()));
        let ((x0, x1), (d0, d1), (s0, s1)) = (range(xl)?, range(dl)?, range(sl)?);
        let ds = d.as_cuda_slice::<f32>()?.slice(d0..d1);
        let ss = s.as_cuda_slice::<f32>()?.slice(s0..s1);
        // rows of T (f32 or bf16) through the kernel's instance for T
        fn launch<T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
            op: &super::Favor,
            dev: &candle_core::cuda_backend::CudaDevice,
            name: &'static str,
            x: &CudaStorage,
            (x0, x1): (usize, usize),
            ds: &candle_core::cuda_backend::cudarc::driver::CudaView<f32>,
            ss: &candle_core::cuda_backend::cudarc::driver::CudaView<f32>,
        ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<T>> {
            let n = x1 - x0;
            let rows = n / op.m.max(1);
            let mut out = unsafe { dev.alloc::<T>(n)? };
            if rows > 0 {
                let func = load_kernel!(dev, name, crate::gpu::fused_encoder::MODULE, crate::gpu::fused_encoder::PTX)?;
                let (m, has, per) = (op.m as i32, op.has_stab as i32, op.rows_per_stab as i64);
                let xs = x.as_cuda_slice::<T>()?.slice(x0..x1);
                let mut b = func.builder();
                b.arg(&xs);
                b.arg(ds);
                b.arg(ss);
                b.arg(&mut out);
                b.arg(&m);
                b.arg(&has);
                b.arg(&per);
                b.arg(&op.ratio);
                b.arg(&op.eps);
                let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
                unsafe { b.launch(cfg) }.w()?;
            }
            Ok(out)
        }
        let out = match x.dtype() {
            candle_core::DType::BF16 => CudaStorage::wrap_cuda_slice(launch::<half::bf16>(op, &dev, "favor_features_bf16", x, (x0, x1), &ds, &ss)?, dev),
            _ => CudaStorage::wrap_cuda_slice(launch::<f32>(op, &dev, "favor_features_f32", x, (x0, x1), &ds, &ss)?, dev),
        };
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    /// scBERT's candle ops for the same features (methods/scbert.rs softmax_kernel's steps).
    fn reference(dash: &Tensor, diag: &Tensor, stab: &Tensor, ratio: f64, eps: f64) -> Tensor {
        let z = dash.broadcast_sub(diag).unwrap().broadcast_sub(stab).unwrap().exp().unwrap();
        ((z + eps).unwrap() * ratio).unwrap()
    }

    #[test]
    fn the_op_is_the_candle_steps_for_queries_and_keys() {
        let (b, h, n, m) = (2, 3, 5, 7);
        let dash = Tensor::randn(0f32, 2.0, (b, h, n, m), &Device::Cpu).unwrap();
        let diag = Tensor::randn(0f32, 1.0, (b, h, n, 1), &Device::Cpu).unwrap().abs().unwrap();
        let (ratio, eps) = (1.0 / (m as f64).sqrt(), 1e-4);
        // queries: each row's own maximum
        let q = features(&dash, &diag, None, ratio, eps).unwrap();
        let want = reference(&dash, &diag, &dash.max_keepdim(D::Minus1).unwrap(), ratio, eps);
        assert_eq!(q.dims(), want.dims());
        assert_eq!(q.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        // keys: the maximum over each cell's whole tensor (h x n rows)
        let stab = dash.max_keepdim(D::Minus1).unwrap().reshape((b, h * n)).unwrap().max_keepdim(1).unwrap();
        let k = features(&dash, &diag, Some(&stab), ratio, eps).unwrap();
        let want = reference(&dash, &diag, &stab.reshape((b, 1, 1, 1)).unwrap(), ratio, eps);
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        // one diagonal value a row
        assert!(features(&dash, &diag.narrow(2, 0, 4).unwrap(), None, ratio, eps).is_err());
    }
}
