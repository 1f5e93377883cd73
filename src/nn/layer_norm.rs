//! Layer norm for training: one op in the graph that keeps only its input (candle's
//! `layer_norm_slow` keeps eight intermediates of the input's size, 1.3 GB a norm for 64 scGPT
//! cells of 1,201 tokens) and runs as one row pass each way (CUDA kernels
//! `kernels/encoder_ops.cu` `ln_fwd_f32`, `ln_bwd_f32`; the CPU twin below, on its threads).
//!
//! On a row of d values: mean, var = mean((x - mean)^2) (biased, two passes, as PyTorch),
//! r = 1 / sqrt(var + eps), xh = (x - mean) r, y = xh w + b. Backward: g = dy w,
//! dx = r (g - mean(g) - xh mean(g xh)), dw = sum over rows of dy xh, db = sum of dy. f32 only.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::outside_graph::stacked;

/// `layer_norm(x, w, b)` over the last dimension, differentiable in all three.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> Result<Tensor> {
    let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
    if x.dtype() != DType::F32 {
        candle_core::bail!("layer-norm: takes f32, got {:?}", x.dtype());
    }
    x.apply_op3(&w, &b, Forward { eps })
}

fn row_stats(x: &[f32]) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = x.iter().sum::<f32>() / d;
    let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, var)
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
        candle_core::bail!("layer-norm: {what} must be contiguous f32");
    };
    Ok(&v[a..b])
}

#[derive(Clone, Copy)]
struct Forward {
    eps: f32,
}

impl candle_core::CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout, b: &CpuStorage, bl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w, b) = (slice(x, xl, "x")?, slice(w, wl, "the weight")?, slice(b, bl, "the bias")?);
        let d = w.len();
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(y, x)| {
            let (mean, var) = row_stats(x);
            let r = 1.0 / (var + self.eps).sqrt();
            for j in 0..d {
                y[j] = (x[j] - mean) * r * w[j] + b[j];
            }
        });
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout, w: &candle_core::CudaStorage, wl: &Layout, b: &candle_core::CudaStorage, bl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dev = x.device().clone();
        let (xv, wv, bv) = (view(x, xl)?, view(w, wl)?, view(b, bl)?);
        let d = wl.shape().elem_count();
        let n = xl.shape().elem_count();
        // SAFETY: the kernel writes every element.
        let mut y = unsafe { dev.alloc::<f32>(n)? };
        crate::gpu::train_rows::layer_norm_forward(&dev, &xv, &wv, &bv, &mut y, n / d.max(1), d, self.eps)?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(y, dev), xl.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, w, dy) = (x.detach(), w.detach(), grad.detach().contiguous()?);
        let d = w.elem_count();
        let both = x.apply_op3_no_bwd(&w, &dy, &Backward { eps: self.eps })?;
        let dx = both.get(0)?;
        let dw = super::lean_linear::column_sums(&both.get(1)?.reshape(((), d))?)?;
        let db = super::lean_linear::column_sums(&dy.reshape(((), d))?)?;
        Ok((Some(dx), Some(dw.reshape(w.shape())?), Some(db.reshape(w.shape())?)))
    }
}

/// (x, w, dy) -> (dx, dy xh) stacked on a new first dimension.
struct Backward {
    eps: f32,
}

impl candle_core::CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "layer-norm-backward"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w, dy) = (slice(x, xl, "x")?, slice(w, wl, "the weight")?, slice(g, gl, "the gradient")?);
        let (d, n) = (w.len(), x.len());
        let mut out = vec![0f32; 2 * n];
        let (dx, gx) = out.split_at_mut(n);
        dx.par_chunks_mut(d).zip(gx.par_chunks_mut(d)).zip(x.par_chunks(d).zip(dy.par_chunks(d))).for_each(|((dx, gx), (x, dy))| {
            let (mean, var) = row_stats(x);
            let r = 1.0 / (var + self.eps).sqrt();
            let (mut a, mut c) = (0f32, 0f32);
            for j in 0..d {
                let (xh, g) = ((x[j] - mean) * r, dy[j] * w[j]);
                a += g;
                c += g * xh;
            }
            let (a, c) = (a / d as f32, c / d as f32);
            for j in 0..d {
                let xh = (x[j] - mean) * r;
                dx[j] = r * (dy[j] * w[j] - a - xh * c);
                gx[j] = dy[j] * xh;
            }
        });
        Ok((CpuStorage::F32(out), stacked(xl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout, w: &candle_core::CudaStorage, wl: &Layout, g: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dev = x.device().clone();
        let (xv, wv, gv) = (view(x, xl)?, view(w, wl)?, view(g, gl)?);
        let d = wl.shape().elem_count();
        let n = xl.shape().elem_count();
        // SAFETY: the kernel writes every element of both halves.
        let mut out = unsafe { dev.alloc::<f32>(2 * n)? };
        let (mut dx, mut gx) = out.split_at_mut(n);
        crate::gpu::train_rows::layer_norm_backward(&dev, &xv, &wv, &gv, &mut dx, &mut gx, n / d.max(1), d, self.eps)?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(out, dev), stacked(xl)))
    }
}

#[cfg(feature = "cuda")]
fn view<'a>(s: &'a candle_core::CudaStorage, l: &Layout) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
    let Some((a, z)) = l.contiguous_offsets() else { candle_core::bail!("layer-norm: inputs must be contiguous") };
    Ok(s.as_cuda_slice::<f32>()?.slice(a..z))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn values_and_gradients_equal_candles_composed_norm() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0.5f32, 2.0, (3, 7, 40), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.3, 40, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.3, 40, &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 7, 40), &dev).unwrap();
        let ours = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let theirs = candle_nn::ops::layer_norm_slow(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "forward differs by {diff}");
        let go = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gt = (&theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
            let (a, t) = (go.get(v.as_tensor()).unwrap(), gt.get(v.as_tensor()).unwrap());
            let rel = ((a - t).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() / t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sqrt();
            assert!(rel < 1e-5, "d{name}: relative error {rel}");
        }
    }
}
