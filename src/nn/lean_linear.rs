//! A linear layer for training that keeps only its input between the passes. candle's graph of
//! `x W^T + b` keeps the product before the bias and, under mixed precision, bf16 copies of the
//! input and the output (three more tensors of the activations' size a layer); here the forward
//! pass runs outside the graph and one op stands for it, whose backward forms the gradients by
//! hand from x, W and dy: dx = dy W, dW = dy^T x, db = sum of dy over rows. With `mixed` (as
//! `torch.autocast` with bf16) the products take bf16 copies of their operands and sum in f32,
//! backward as forward; W, b and the output are f32, x f32 or bf16 (its gradient in its dtype).
//! On a GPU the mixed forward pass is one cuBLASLt product whose epilogue adds the bias (in bf16,
//! as autocast's `F.linear` does) and writes bf16, inside the op (no copy of the output is held
//! aside for it); widths that are not multiples of 8 take candle's product.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use super::outside_graph::Computed;

/// `x W^T + b` over the last dimension of `x` (`W`: out x in), f32.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, mixed: bool) -> Result<Tensor> {
    linear_as(x, w, b, mixed, DType::F32)
}

/// [`linear`] whose output is stored as `out` (bf16 keeps the activation at half the size when
/// the next op takes bf16 anyway, as autocast's outputs are; the bias is added in f32 first).
pub fn linear_as(x: &Tensor, w: &Tensor, b: Option<&Tensor>, mixed: bool, out: DType) -> Result<Tensor> {
    let (n_out, n_in) = w.dims2()?;
    let x = x.contiguous()?;
    let tracked = x.track_op() || w.track_op() || b.is_some_and(|b| b.track_op());
    // the op's third operand: the bias, or zeros standing for none
    let bias = || match b {
        Some(b) => Ok(b.clone()),
        None => Tensor::zeros(n_out, DType::F32, x.device()),
    };
    if mixed && x.device().is_cuda() && n_in % 8 == 0 && n_out % 8 == 0 && cfg!(feature = "cuda") {
        let op = Lean { out: None, mixed, has_bias: b.is_some(), dtype: out };
        let bias = bias()?;
        return if tracked { x.apply_op3_arc(w, &bias, Arc::new(Box::new(op))) } else { x.apply_op3_no_bwd(w, &bias, &op) };
    }
    let rows = x.elem_count() / n_in.max(1);
    let mut out_shape = x.dims().to_vec();
    *out_shape.last_mut().ok_or_else(|| candle_core::Error::Msg("linear: x has no dimension".into()))? = n_out;
    let y = product(&x.detach().reshape((rows, n_in))?, &w.detach().t()?, mixed)?;
    let y = match b {
        Some(b) => y.broadcast_add(&b.detach())?,
        None => y,
    }
    .reshape(out_shape)?
    .to_dtype(out)?;
    if !tracked {
        return Ok(y);
    }
    x.apply_op3_arc(w, &bias()?, Arc::new(Box::new(Lean { out: Some(Computed::new(y, "lean-linear")), mixed, has_bias: b.is_some(), dtype: out })))
}

/// `a b` in f32, through bf16 copies when `mixed`.
fn product(a: &Tensor, b: &Tensor, mixed: bool) -> Result<Tensor> {
    if mixed {
        as_bf16(a)?.matmul(&as_bf16(b)?)?.to_dtype(DType::F32)
    } else {
        a.matmul(b)
    }
}

/// The column sums of `dy` (`rows x n`) in f32: a bias gradient. On a GPU as the product
/// `1^T dy` (one coalesced pass; candle's sum over the first dimension reads a column a block,
/// strided); a bf16 dy sums in f32 and is rounded to bf16 once, as autocast's bias gradient is.
pub fn column_sums(dy: &Tensor) -> Result<Tensor> {
    let (rows, n) = dy.dims2()?;
    if !dy.device().is_cuda() {
        return dy.to_dtype(DType::F32)?.sum(0);
    }
    Tensor::ones((1, rows), dy.dtype(), dy.device())?.matmul(dy)?.to_dtype(DType::F32)?.reshape(n)
}

/// `t` in bf16 (itself when it is).
fn as_bf16(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::BF16 {
        Ok(t.clone())
    } else {
        t.to_dtype(DType::BF16)
    }
}

struct Lean {
    /// The output computed before the op (None: the op's CUDA forward computes it).
    out: Option<Computed>,
    mixed: bool,
    has_bias: bool,
    /// The output's dtype (the CUDA forward's; the CPU's output is computed before the op).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dtype: DType,
}

impl Lean {
    fn computed(&self) -> Result<&Computed> {
        self.out.as_ref().ok_or_else(|| candle_core::Error::Msg("lean-linear: the output was to be computed on the GPU".into()))
    }
}

impl candle_core::CustomOp3 for Lean {
    fn name(&self) -> &'static str {
        "lean-linear"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.computed()?.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, xl: &Layout, w: &candle_core::CudaStorage, wl: &Layout, b: &candle_core::CudaStorage, bl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        if let Some(c) = &self.out {
            return c.cuda();
        }
        // x W^T + b in one cuBLASLt product: bf16 operands (cast here when they are not),
        // f32 sums, the bias added in the epilogue, bf16 out
        let (n_out, n_in) = wl.shape().dims2()?;
        let rows = xl.shape().elem_count() / n_in.max(1);
        let dev = x.device().clone();
        // a contiguous bf16 operand is read in place, any other cast to a bf16 copy
        macro_rules! bf16_view {
            ($s:expr, $l:expr, $owned:ident) => {
                match ($s.dtype(), $l.contiguous_offsets()) {
                    (DType::BF16, Some((o0, o1))) if o0 % 8 == 0 => $s.as_cuda_slice::<half::bf16>()?.slice(o0..o1),
                    _ => {
                        $owned = $s.to_dtype($l, DType::BF16)?;
                        $owned.as_cuda_slice::<half::bf16>()?.slice(..)
                    }
                }
            };
        }
        let (xo, wo, bo): (candle_core::CudaStorage, candle_core::CudaStorage, candle_core::CudaStorage);
        let xv = bf16_view!(x, xl, xo);
        let wv = bf16_view!(w, wl, wo);
        let bv = bf16_view!(b, bl, bo);
        // SAFETY: the product writes every element (beta 0).
        let mut y = unsafe { dev.alloc::<half::bf16>(rows * n_out)? };
        let lt = crate::gpu::gemm::Lt::for_stream(&dev.cuda_stream())?;
        lt.linear(&xv, rows, n_in, &wv, &bv, n_out, &mut y, false, false, None)?;
        let mut dims = xl.dims().to_vec();
        *dims.last_mut().ok_or_else(|| candle_core::Error::Msg("lean-linear: x has no dimension".into()))? = n_out;
        let shape = Shape::from(dims);
        let y = candle_core::CudaStorage::wrap_cuda_slice(y, dev);
        let y = if self.dtype == DType::BF16 { y } else { y.to_dtype(&Layout::contiguous(&shape), self.dtype)? };
        Ok((y, shape))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n_out, n_in) = w.dims2()?;
        let rows = x.elem_count() / n_in.max(1);
        let x2 = x.detach().reshape((rows, n_in))?;
        let dy = grad.detach().contiguous()?.reshape((rows, n_out))?;
        let db = if self.has_bias { Some(column_sums(&dy)?) } else { None };
        if self.mixed {
            // each operand cast to bf16 once (not at all when it is bf16), and dy^T as a
            // transposed view the product reads in place (a cast of the view would write a
            // transposed copy of the activations' size)
            let (dy, x2, w) = (as_bf16(&dy)?, as_bf16(&x2)?, as_bf16(&w.detach())?);
            let dx = dy.matmul(&w)?.reshape(x.shape())?.to_dtype(x.dtype())?;
            let dw = dy.t()?.matmul(&x2)?.to_dtype(DType::F32)?;
            return Ok((Some(dx), Some(dw), db));
        }
        let dy = dy.to_dtype(DType::F32)?;
        let dx = product(&dy, &w.detach(), false)?.reshape(x.shape())?.to_dtype(x.dtype())?;
        let dw = product(&dy.t()?, &x2, false)?;
        Ok((Some(dx), Some(dw), db))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn values_and_gradients_equal_candles_graph() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 5, 8), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (6, 8), &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.5, 6, &dev).unwrap()).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (3, 5, 6), &dev).unwrap();
        for bias in [true, false] {
            let bb = bias.then(|| b.as_tensor());
            let ours = linear(x.as_tensor(), w.as_tensor(), bb, false).unwrap();
            let theirs = x.as_tensor().broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap();
            let theirs = if bias { theirs.broadcast_add(b.as_tensor()).unwrap() } else { theirs };
            let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-5, "forward differs by {diff}");
            let go = (&ours * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let gt = (&theirs * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
                match (go.get(v.as_tensor()), gt.get(v.as_tensor())) {
                    (Some(a), Some(t)) => {
                        let rel = ((a - t).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() / t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sqrt();
                        assert!(rel < 1e-5, "d{name}: relative error {rel} (bias {bias})");
                    }
                    (None, None) => {}
                    (a, t) => panic!("d{name}: ours {:?}, candle's {:?} (bias {bias})", a.is_some(), t.is_some()),
                }
            }
        }
        // a bf16 output: the same values rounded, the gradients as the f32 output's within bf16's
        // rounding of the output gradient
        let o16 = linear_as(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), false, DType::BF16).unwrap();
        assert_eq!(o16.dtype(), DType::BF16);
        let o32 = linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), false).unwrap();
        let diff = (o16.to_dtype(DType::F32).unwrap() - &o32).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 2e-2, "bf16 output differs by {diff}");
        let g16 = (o16.to_dtype(DType::F32).unwrap() * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let g32 = (&o32 * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w, &b] {
            let (a, t) = (g16.get(v.as_tensor()).unwrap(), g32.get(v.as_tensor()).unwrap());
            let rel = ((a - t).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() / t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sqrt();
            assert!(rel < 1e-2, "bf16 output: gradient off by {rel}");
        }
        // mixed (bf16 products, as autocast): the f32 graph's gradients within bf16's rounding
        let om = linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), true).unwrap();
        let gm = (&om * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
            let (a, t) = (gm.get(v.as_tensor()).unwrap(), g32.get(v.as_tensor()).unwrap());
            assert_eq!(a.dtype(), DType::F32);
            let rel = ((a - t).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() / t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sqrt();
            assert!(rel > 0.0 || name == "b", "d{name}: mixed equals f32 exactly, so no bf16 product ran");
            assert!(rel < 1e-2, "mixed: d{name} off by {rel}");
        }
        // outside a graph it is the plain product
        let t = Tensor::ones((2, 8), DType::F32, &dev).unwrap();
        assert!(!linear(&t, &t.narrow(0, 0, 1).unwrap().repeat((6, 1)).unwrap(), None, true).unwrap().track_op());
    }
}
