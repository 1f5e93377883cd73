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
//! flash-attention pays). `q` comes scaled by 1/sqrt(head size). In bf16 (mixed precision) the
//! products take bf16 and the softmax, the mask and `dS` are f32, as PyTorch's fused attention
//! kernels keep them.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, D};

use super::dropout::Mask;

/// `dropout(softmax(q k^T)) v` for `(.., l, hd)` tensors (`q` already scaled), differentiable
/// with respect to q, k and v; `mask` is the dropout on the probabilities (training).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<Mask>) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let out = forward(&q.detach(), &k.detach(), &v.detach(), mask)?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    q.apply_op3_arc(&k, &v, Arc::new(Box::new(Recompute { out, mask })))
}

/// softmax(q k^T) in f32.
fn probs(q: &Tensor, k: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax_last_dim(&q.matmul(&k.t()?)?.to_dtype(DType::F32)?)
}

/// The probabilities after dropout, in the products' dtype.
fn dropped(p: &Tensor, mask: Option<Mask>, dtype: DType) -> Result<Tensor> {
    match mask {
        Some(m) => m.apply_no_grad(p)?.to_dtype(dtype),
        None => p.to_dtype(dtype),
    }
}

fn forward(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<Mask>) -> Result<Tensor> {
    dropped(&probs(q, k)?, mask, v.dtype())?.matmul(v)
}

/// The op that stands for the attention in the graph: its forward hands back the output computed
/// outside the graph, its backward recomputes.
struct Recompute {
    out: Tensor,
    mask: Option<Mask>,
}

impl candle_core::CustomOp3 for Recompute {
    fn name(&self) -> &'static str {
        "recompute-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let (s, l) = self.out.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(c) => Ok((candle_core::backend::BackendStorage::try_clone(c, l)?, l.shape().clone())),
            _ => candle_core::bail!("recompute-attention: the output is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _: &candle_core::CudaStorage, _: &Layout, _: &candle_core::CudaStorage, _: &Layout, _: &candle_core::CudaStorage, _: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (s, l) = self.out.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(c) => Ok((candle_core::backend::BackendStorage::try_clone(c, l)?, l.shape().clone())),
            _ => candle_core::bail!("recompute-attention: the output is not on the GPU"),
        }
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v, g) = (q.detach(), k.detach(), v.detach(), grad.detach().contiguous()?);
        let dt = v.dtype();
        let p = probs(&q, &k)?;
        let dv = dropped(&p, self.mask, dt)?.t()?.matmul(&g)?;
        let dp = g.matmul(&v.t()?)?.to_dtype(DType::F32)?;
        let dp = match self.mask {
            Some(m) => m.apply_no_grad(&dp)?,
            None => dp,
        };
        let row = (&dp * &p)?.sum_keepdim(D::Minus1)?;
        let ds = (dp.broadcast_sub(&row)? * &p)?.to_dtype(dt)?;
        drop(p);
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn plain(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<Mask>) -> Tensor {
        let p = candle_nn::ops::softmax(&q.matmul(&k.t().unwrap()).unwrap(), D::Minus1).unwrap();
        let p = match mask {
            Some(m) => m.apply(&p).unwrap(),
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
        for mask in [None, crate::nn::dropout::Dropout::new(0.3, 5).next_mask()] {
            let ours = attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), mask).unwrap();
            let theirs = plain(q.as_tensor(), k.as_tensor(), v.as_tensor(), mask);
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
        let t = Tensor::ones(shape, DType::F32, &dev).unwrap();
        assert!(!attention(&t, &t, &t, None).unwrap().track_op());
    }
}
