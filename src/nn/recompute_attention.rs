//! Dense self-attention for training that keeps no (l x l) tensor between the forward and the
//! backward pass. candle's autograd keeps every intermediate of `softmax(q k^T) v` (the scores,
//! the probabilities, the dropout mask and the dropped probabilities: four `b x h x l x l`
//! tensors a layer, 12 GB a layer for 64 scGPT cells of 1,201 tokens in f32), which at 12 layers
//! does not fit a GPU. Here the forward pass runs outside the graph and one op stands for it;
//! its backward recomputes the probabilities from q and k (and draws the dropout mask again) and
//! forms the gradients by hand, one layer at a time:
//!
//! P = softmax(q k^T), Pd = P * M, O = Pd v;
//! dV = Pd^T dO, dPd = dO v^T, dP = dPd * M, dS = P * (dP - rowsum(dP * P)), dQ = dS k,
//! dK = dS^T q.
//!
//! The price is the forward product and softmax once more in the backward pass (as
//! flash-attention pays). The scale (1/sqrt(head size)) is applied to the scores inside the row
//! passes. In bf16 (mixed precision) the
//! products take bf16 and the softmax, the mask and `dS` are f32, as PyTorch's fused attention
//! kernels keep them.

use std::sync::Arc;

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::dropout::Mask;
use super::outside_graph::{stacked, Computed};
use super::step_profile::StepProfile;

/// `dropout(softmax(scale q k^T)) v` where `heads` stacks q, k and v, `(3, .., l, hd)` (laid out
/// by heads in one copy), differentiable with respect to `heads`; `mask` is the dropout on the
/// probabilities (training). `profile`: the parts' times go there (`SCFOUNDRY_STEP_PROFILE`).
pub fn attention(heads: &Tensor, scale: f32, mask: Option<Mask>, profile: Option<&StepProfile>) -> Result<Tensor> {
    let heads = heads.contiguous()?;
    let out = {
        let h = heads.detach();
        forward(&h.get(0)?, &h.get(1)?, &h.get(2)?, scale, mask, profile)?
    };
    if !heads.track_op() {
        return Ok(out);
    }
    heads.apply_op1_arc(Arc::new(Box::new(Recompute { out: Computed::new(out, "recompute-attention"), scale, mask, profile: profile.cloned() })))
}

/// `f`, as part `name` of the attention when profiling.
fn part<T>(profile: Option<&StepProfile>, name: &str, backward: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match profile {
        Some(p) => p.part(name, backward, f),
        None => f(),
    }
}

fn forward(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, mask: Option<Mask>, profile: Option<&StepProfile>) -> Result<Tensor> {
    let s = part(profile, "attention: q k^T", false, || q.matmul(&k.t()?))?;
    let pd = part(profile, "attention: softmax, dropout", false, || s.apply_op1_no_bwd(&Probs { scale, mask }))?;
    drop(s);
    part(profile, "attention: P v", false, || pd.matmul(v))
}

/// The op that stands for the attention in the graph: its forward hands back (a copy of) the
/// output computed outside the graph and lets that go, so one copy is held until the backward
/// pass; its backward recomputes.
struct Recompute {
    out: Computed,
    scale: f32,
    mask: Option<Mask>,
    profile: Option<StepProfile>,
}

impl candle_core::CustomOp1 for Recompute {
    fn name(&self) -> &'static str {
        "recompute-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(&self, heads: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let h = heads.detach();
        let (q, k, v) = (h.get(0)?, h.get(1)?, h.get(2)?);
        let g = grad.detach().to_dtype(h.dtype())?.contiguous()?;
        let pr = self.profile.as_ref();
        let s = part(pr, "attention: q k^T", true, || q.matmul(&k.t()?))?;
        let dpd = part(pr, "attention: dO v^T", true, || g.matmul(&v.t()?))?;
        let both = part(pr, "attention: softmax, dropout, dS", true, || s.apply_op2_no_bwd(&dpd, &Grads { scale: self.scale, mask: self.mask }))?;
        drop((s, dpd));
        let (pd, ds) = (both.get(0)?, both.get(1)?);
        let dv = part(pr, "attention: dV, dQ, dK", true, || pd.t()?.matmul(&g))?;
        drop(pd);
        let dq = part(pr, "attention: dV, dQ, dK", true, || ds.matmul(&k))?;
        let dk = part(pr, "attention: dV, dQ, dK", true, || ds.t()?.matmul(&q))?;
        Ok(Some(Tensor::stack(&[dq, dk, dv], 0)?))
    }
}

// ----------------------------------------------------------------------------- row passes
//
// On each row of l scores s (f32 arithmetic whatever the storage): P = softmax(c s) with c the
// scale (1 / sqrt(head size)), the dropout
// multiplier k_j of element j of the row (Mask::keeps_attention's rule; scale when kept, 0 when
// dropped, 1 without dropout). Forward: Pd = P k. Backward, from dPd = dO v^T: dP = dPd k, r = sum(dP P),
// dS = c P (dP - r) (the gradient of the unscaled scores), and Pd again (for dV). The CUDA kernels (`gpu::train_rows`) do the same
// with one warp a row.

/// The multiplier of element j of score row `row` (query row % l of row block row / l).
fn keep_mul(mask: Option<Mask>, row: usize, j: usize, l: usize) -> f32 {
    match mask {
        None => 1.0,
        Some(m) => m.attention_multiplier((row / l) as u64, (row % l) as u64, j as u64, l as u64),
    }
}

/// A row's max and 1 / sum(exp(s - max)).
fn row_stats(s: &[f32]) -> (f32, f32) {
    let m = s.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    (m, 1.0 / s.iter().map(|&x| (x - m).exp()).sum::<f32>())
}

fn rows_probs<T: WithDType>(s: &[T], l: usize, c: f32, mask: Option<Mask>) -> Vec<T> {
    let mut out = vec![T::zero(); s.len()];
    out.par_chunks_mut(l).zip(s.par_chunks(l)).enumerate().for_each(|(r, (o, s))| {
        let s: Vec<f32> = s.iter().map(|x| x.to_f64() as f32 * c).collect();
        let (m, inv) = row_stats(&s);
        for (j, o) in o.iter_mut().enumerate() {
            *o = T::from_f64(((s[j] - m).exp() * inv * keep_mul(mask, r, j, l)) as f64);
        }
    });
    out
}

/// (Pd, dS) one after the other.
fn rows_grads<T: WithDType>(s: &[T], dpd: &[T], l: usize, c: f32, mask: Option<Mask>) -> Vec<T> {
    let n = s.len();
    let mut out = vec![T::zero(); 2 * n];
    let (pd, ds) = out.split_at_mut(n);
    pd.par_chunks_mut(l).zip(ds.par_chunks_mut(l)).zip(s.par_chunks(l).zip(dpd.par_chunks(l))).enumerate().for_each(|(r, ((pd, ds), (s, dpd)))| {
        let s: Vec<f32> = s.iter().map(|x| x.to_f64() as f32 * c).collect();
        let (m, inv) = row_stats(&s);
        let p: Vec<f32> = s.iter().map(|&x| (x - m).exp() * inv).collect();
        let k: Vec<f32> = (0..l).map(|j| keep_mul(mask, r, j, l)).collect();
        let acc: f32 = (0..l).map(|j| dpd[j].to_f64() as f32 * k[j] * p[j]).sum();
        for j in 0..l {
            ds[j] = T::from_f64((c * p[j] * (dpd[j].to_f64() as f32 * k[j] - acc)) as f64);
            pd[j] = T::from_f64((p[j] * k[j]) as f64);
        }
    });
    out
}

fn contiguous<'a, T>(x: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&x[a..b]),
        None => candle_core::bail!("recompute-attention: {what} must be contiguous"),
    }
}

/// Scores -> dropped probabilities (the forward row pass).
struct Probs {
    scale: f32,
    mask: Option<Mask>,
}

impl candle_core::CustomOp1 for Probs {
    fn name(&self) -> &'static str {
        "attention-probs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = l.dims().last().copied().unwrap_or(1);
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(rows_probs(contiguous(x, l, "the scores")?, n, self.scale, self.mask)),
            CpuStorage::BF16(x) => CpuStorage::BF16(rows_probs(contiguous(x, l, "the scores")?, n, self.scale, self.mask)),
            _ => candle_core::bail!("recompute-attention: takes f32 or bf16"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("recompute-attention: the scores must be contiguous");
        };
        let dev = s.device().clone();
        let n = l.dims().last().copied().unwrap_or(1);
        let rows = (o1 - o0) / n.max(1);
        let m = super::dropout::kernel_args(self.mask);
        let out = match s.dtype() {
            candle_core::DType::F32 => {
                // SAFETY: the kernel writes every element.
                let mut out = unsafe { dev.alloc::<f32>(o1 - o0)? };
                crate::gpu::train_rows::probs(&dev, "f32", &s.as_cuda_slice::<f32>()?.slice(o0..o1), &mut out, rows, n, self.scale, m)?;
                candle_core::CudaStorage::wrap_cuda_slice(out, dev)
            }
            candle_core::DType::BF16 => {
                // SAFETY: the kernel writes every element.
                let mut out = unsafe { dev.alloc::<half::bf16>(o1 - o0)? };
                crate::gpu::train_rows::probs(&dev, "bf16", &s.as_cuda_slice::<half::bf16>()?.slice(o0..o1), &mut out, rows, n, self.scale, m)?;
                candle_core::CudaStorage::wrap_cuda_slice(out, dev)
            }
            d => candle_core::bail!("recompute-attention: takes f32 or bf16, got {d:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}

/// (scores, dPd) -> (Pd, dS) stacked on a new first dimension (the backward row pass).
struct Grads {
    scale: f32,
    mask: Option<Mask>,
}

impl candle_core::CustomOp2 for Grads {
    fn name(&self) -> &'static str {
        "attention-grads"
    }

    fn cpu_fwd(&self, s: &CpuStorage, sl: &Layout, d: &CpuStorage, dl: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = sl.dims().last().copied().unwrap_or(1);
        if sl.shape() != dl.shape() {
            candle_core::bail!("recompute-attention: scores {:?} and dPd {:?} differ", sl.shape(), dl.shape());
        }
        let out = match (s, d) {
            (CpuStorage::F32(s), CpuStorage::F32(d)) => CpuStorage::F32(rows_grads(contiguous(s, sl, "the scores")?, contiguous(d, dl, "dPd")?, n, self.scale, self.mask)),
            (CpuStorage::BF16(s), CpuStorage::BF16(d)) => CpuStorage::BF16(rows_grads(contiguous(s, sl, "the scores")?, contiguous(d, dl, "dPd")?, n, self.scale, self.mask)),
            _ => candle_core::bail!("recompute-attention: takes f32 or bf16, both the same"),
        };
        Ok((out, stacked(sl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, sl: &Layout, d: &candle_core::CudaStorage, dl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (Some((s0, s1)), Some((d0, d1))) = (sl.contiguous_offsets(), dl.contiguous_offsets()) else {
            candle_core::bail!("recompute-attention: the scores and dPd must be contiguous");
        };
        if sl.shape() != dl.shape() || s.dtype() != d.dtype() {
            candle_core::bail!("recompute-attention: scores and dPd differ in shape or dtype");
        }
        let dev = s.device().clone();
        let n = sl.dims().last().copied().unwrap_or(1);
        let len = s1 - s0;
        let rows = len / n.max(1);
        let m = super::dropout::kernel_args(self.mask);
        macro_rules! run {
            ($t:ty, $suffix:expr) => {{
                // SAFETY: the kernel writes every element of both halves.
                let mut out = unsafe { dev.alloc::<$t>(2 * len)? };
                let (mut pd, mut ds) = out.split_at_mut(len);
                crate::gpu::train_rows::grads(&dev, $suffix, &s.as_cuda_slice::<$t>()?.slice(s0..s1), &d.as_cuda_slice::<$t>()?.slice(d0..d1), &mut pd, &mut ds, rows, n, self.scale, m)?;
                out
            }};
        }
        let out = match s.dtype() {
            candle_core::DType::F32 => candle_core::CudaStorage::wrap_cuda_slice(run!(f32, "f32"), dev),
            candle_core::DType::BF16 => candle_core::CudaStorage::wrap_cuda_slice(run!(half::bf16, "bf16"), dev),
            d => candle_core::bail!("recompute-attention: takes f32 or bf16, got {d:?}"),
        };
        Ok((out, stacked(sl)))
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var, D};

    fn plain(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, mask: Option<Mask>) -> Tensor {
        let p = candle_nn::ops::softmax(&(q * scale).unwrap().matmul(&k.t().unwrap()).unwrap(), D::Minus1).unwrap();
        let p = match mask {
            Some(m) => {
                let dims = p.dims().to_vec();
                let l = dims[dims.len() - 1];
                let rows = p.elem_count() / l;
                let k: Vec<f32> = (0..rows * l).map(|i| keep_mul(Some(m), i / l, i % l, l)).collect();
                (&p * Tensor::from_vec(k, dims, p.device()).unwrap()).unwrap()
            }
            None => p,
        };
        p.matmul(v).unwrap()
    }

    #[test]
    fn gradients_equal_those_of_candles_own_graph() {
        let dev = Device::Cpu;
        let shape = (2, 3, 17, 8);
        let draw = |s: u64| Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev).unwrap().affine(1.0, s as f64 * 0.01).unwrap()).unwrap();
        let (q, k, v) = (draw(1), draw(2), draw(3));
        let w = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let scale = 1.0 / 8f32.sqrt();
        for mask in [None, crate::nn::dropout::Dropout::new(0.3, 5).next_mask()] {
            let heads = Tensor::stack(&[q.as_tensor(), k.as_tensor(), v.as_tensor()], 0).unwrap();
            let ours = attention(&heads, scale, mask, None).unwrap();
            let theirs = plain(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale as f64, mask);
            let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < 1e-5, "forward differs by {diff}");
            let go = (&ours * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gt = (&theirs * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                let (a, b) = (go.get(x.as_tensor()).unwrap(), gt.get(x.as_tensor()).unwrap());
                let rel = ((a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sqrt();
                assert!(rel < 1e-5, "d{name}: relative error {rel} (mask {mask:?})");
            }
        }
        // outside a graph it is the plain forward
        let t = Tensor::ones((3, 2, 3, 17, 8), DType::F32, &dev).unwrap();
        assert!(!attention(&t, scale, None, None).unwrap().track_op());
    }
}
