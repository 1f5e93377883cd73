//! Training attention on a GPU in bf16 that never writes an (l x l) tensor: FlashAttention-2's
//! forward pass with dropout and its backward pass (Dao, arXiv:2307.08691; `gpu/train_attention.rs`
//! and `gpu/kernels/varlen_attention.cu`). q, k and v are read straight from the qkv projection's
//! output, `(cells, l, 3 d)` laid out `[q heads | k heads | v heads]` (as PyTorch's
//! `in_proj_weight`), and the output `(cells, l, d)` and the gradient of qkv are written in those
//! layouts, so nothing is laid out by heads and back. The forward pass keeps each query row's
//! log-sum-exp (4 bytes a row); the backward pass recomputes the probabilities from it and draws
//! the dropout mask again.
//!
//! The math is `nn::recompute_attention`'s (its CPU twin, and the path of f32 and of the CPU):
//! softmax in f32 with the scale 1/sqrt(64), the dropout rule `Mask::keeps_attention`, the
//! probabilities rounded to bf16 as the operand of `P v` and `dS` as that of `dS k` and `dS^T q`
//! (the materialised path rounds the stored scores and probabilities to bf16 too), dQ summed in
//! f32. Head size 64 and bf16 only; cells of one length.

use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use super::dropout::Mask;

/// Whether the fused path takes `qkv` (bf16, a CUDA tensor, heads of 64).
pub fn applies(qkv: &Tensor, heads: usize) -> bool {
    let width = qkv.dims().last().copied().unwrap_or(0);
    qkv.dtype() == DType::BF16 && qkv.device().is_cuda() && qkv.rank() == 3 && heads > 0 && width == 3 * heads * 64
}

/// `dropout(softmax(q k^T / 8)) v` of `qkv` (`(cells, l, 3 heads 64)`, bf16, on a GPU): `(cells, l,
/// heads 64)`, differentiable with respect to `qkv`.
pub fn attention(qkv: &Tensor, heads: usize, mask: Option<Mask>) -> Result<Tensor> {
    if !applies(qkv, heads) {
        candle_core::bail!("flash-attention: takes bf16 (cells, tokens, 3 x heads x 64) on a GPU, got {:?} {:?} on {:?} with {heads} heads", qkv.dtype(), qkv.dims(), qkv.device().location());
    }
    let qkv = qkv.contiguous()?;
    qkv.apply_op1_arc(std::sync::Arc::new(Box::new(Flash { heads, mask, lse: Mutex::new(None) })))
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Flash {
    heads: usize,
    mask: Option<Mask>,
    /// From the forward pass, for the backward pass (cells x heads x l, f32).
    #[cfg(feature = "cuda")]
    lse: Mutex<Option<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>>>,
    #[cfg(not(feature = "cuda"))]
    lse: Mutex<Option<()>>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn dims(l: &Layout, heads: usize) -> Result<(usize, usize)> {
    let (cells, len, width) = l.shape().dims3()?;
    if width != 3 * heads * 64 {
        candle_core::bail!("flash-attention: {width} columns are not 3 x {heads} heads x 64");
    }
    Ok((cells, len))
}

impl candle_core::CustomOp1 for Flash {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("flash-attention: runs on a GPU; the CPU takes nn::recompute_attention")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (cells, len) = dims(l, self.heads)?;
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("flash-attention: qkv must be contiguous");
        };
        if o0 % 8 != 0 {
            candle_core::bail!("flash-attention: qkv must start on a 16-byte boundary");
        }
        let dev = s.device().clone();
        let shape = crate::gpu::train_attention::Shape { cells, len, heads: self.heads };
        let d = self.heads * 64;
        // SAFETY: the kernel writes every row of every cell, and every row's lse.
        let mut out = unsafe { dev.alloc::<half::bf16>(cells * len * d)? };
        let mut lse = unsafe { dev.alloc::<f32>(cells * self.heads * len)? };
        crate::gpu::train_attention::forward(&dev, &s.as_cuda_slice::<half::bf16>()?.slice(o0..o1), &mut out, &mut lse, shape, super::dropout::kernel_args(self.mask))?;
        *self.lse.lock().map_err(|_| candle_core::Error::Msg("flash-attention: poisoned".into()))? = Some(lse);
        Ok((candle_core::CudaStorage::wrap_cuda_slice(out, dev), Shape::from((cells, len, d))))
    }

    fn bwd(&self, qkv: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        {
            let lse = self.lse.lock().map_err(|_| candle_core::Error::Msg("flash-attention: poisoned".into()))?.take();
            let Some(lse) = lse else {
                candle_core::bail!("flash-attention: the backward pass ran twice or before the forward pass");
            };
            let g = grad.detach().to_dtype(DType::BF16)?.contiguous()?;
            let op = Backward { heads: self.heads, mask: self.mask, lse: Mutex::new(Some(lse)) };
            Ok(Some(qkv.detach().apply_op3_no_bwd(&res.detach().contiguous()?, &g, &op)?))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (qkv, res, grad);
            candle_core::bail!("flash-attention: runs on a GPU")
        }
    }
}

/// (qkv, out, dout) -> dqkv.
#[cfg(feature = "cuda")]
struct Backward {
    heads: usize,
    mask: Option<Mask>,
    lse: Mutex<Option<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>>>,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "flash-attention-backward"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("flash-attention: runs on a GPU")
    }

    fn cuda_fwd(&self, q: &candle_core::CudaStorage, ql: &Layout, o: &candle_core::CudaStorage, ol: &Layout, g: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (cells, len) = dims(ql, self.heads)?;
        let d = self.heads * 64;
        if ol.dims() != [cells, len, d] || gl.dims() != [cells, len, d] {
            candle_core::bail!("flash-attention: out {:?} and its gradient {:?} are not ({cells}, {len}, {d})", ol.dims(), gl.dims());
        }
        let (Some((q0, q1)), Some((o0, o1)), Some((g0, g1))) = (ql.contiguous_offsets(), ol.contiguous_offsets(), gl.contiguous_offsets()) else {
            candle_core::bail!("flash-attention: the backward pass's inputs must be contiguous");
        };
        if q0 % 8 != 0 || o0 % 2 != 0 || g0 % 2 != 0 {
            candle_core::bail!("flash-attention: the backward pass's inputs are not aligned");
        }
        let lse = self.lse.lock().map_err(|_| candle_core::Error::Msg("flash-attention: poisoned".into()))?.take();
        let Some(lse) = lse else {
            candle_core::bail!("flash-attention: no lse from the forward pass");
        };
        let dev = q.device().clone();
        let shape = crate::gpu::train_attention::Shape { cells, len, heads: self.heads };
        let dqkv = crate::gpu::train_attention::backward(
            &dev,
            &q.as_cuda_slice::<half::bf16>()?.slice(q0..q1),
            &o.as_cuda_slice::<half::bf16>()?.slice(o0..o1),
            &g.as_cuda_slice::<half::bf16>()?.slice(g0..g1),
            &lse.slice(..),
            shape,
            super::dropout::kernel_args(self.mask),
        )?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(dqkv, dev), Shape::from((cells, len, 3 * d))))
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_cpu_is_refused_with_a_pointer_to_the_cpu_path() {
        let qkv = Tensor::zeros((2, 5, 3 * 64), DType::BF16, &Device::Cpu).unwrap();
        assert!(!applies(&qkv, 1));
        let e = attention(&qkv, 1, None).unwrap_err().to_string();
        assert!(e.contains("on a GPU"), "{e}");
    }
}
