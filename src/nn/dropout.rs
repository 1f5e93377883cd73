//! Dropout for training on candle whose mask is a function of (seed, call, element) and is never
//! stored. Element `i` of a call is kept when the top 24 bits of SplitMix64(key + (i + 1) x
//! golden) are below `keep x 2^24`, the key derived from the seed and the call's number. The CPU
//! (its threads) and a GPU (`kernels/encoder_ops.cu` `dropout_f32`) draw the same mask, so a
//! seed gives the same run on either; the backward pass draws the mask again instead of keeping
//! it, as the forward output of an (l x l) attention mask would otherwise stay in memory.
//!
//! PyTorch draws its masks from its own generator (Philox on CUDA): the masks differ from
//! upstream's, the rule does not (keep with probability 1 - p, kept values scaled by 1 / (1 - p)).

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::formats::splitmix::{mix, GOLDEN};

/// One call's mask: which elements are kept, and the scale of those kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mask {
    pub key: u64,
    /// kept when the element's 24-bit draw is below this
    pub threshold: u32,
    pub scale: f32,
}

impl Mask {
    /// Whether element `i` is kept.
    pub fn keeps(&self, i: u64) -> bool {
        ((mix(self.key.wrapping_add((i + 1).wrapping_mul(GOLDEN))) >> 40) as u32) < self.threshold
    }

    /// `x` with the mask applied, differentiable (the gradient is masked the same way).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1(*self)
    }

    /// `x` with the mask applied, outside the graph.
    pub fn apply_no_grad(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(self)
    }
}

/// The masks of one training run: call `n` of a run seeded `seed` has the same mask on every
/// device.
pub struct Dropout {
    pub p: f64,
    seed: u64,
    calls: u64,
}

impl Dropout {
    pub fn new(p: f64, seed: u64) -> Dropout {
        Dropout { p, seed, calls: 0 }
    }

    /// The next call's mask; `None` when nothing is dropped.
    pub fn next_mask(&mut self) -> Option<Mask> {
        if self.p <= 0.0 {
            return None;
        }
        self.calls += 1;
        let keep = 1.0 - self.p;
        Some(Mask { key: mix(self.seed ^ mix(self.calls.wrapping_mul(GOLDEN))), threshold: (keep * (1u64 << 24) as f64).round() as u32, scale: (1.0 / keep) as f32 })
    }

    /// `x` with the next call's mask applied (differentiable).
    pub fn apply(&mut self, x: &Tensor) -> Result<Tensor> {
        match self.next_mask() {
            Some(m) => m.apply(x),
            None => Ok(x.clone()),
        }
    }
}

impl candle_core::CustomOp1 for Mask {
    fn name(&self) -> &'static str {
        "counter-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("counter-dropout: the input must be contiguous");
        };
        let CpuStorage::F32(x) = s else {
            candle_core::bail!("counter-dropout: takes f32");
        };
        let x = &x[o0..o1];
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, o)| {
            let base = (c << 16) as u64;
            for (j, v) in o.iter_mut().enumerate() {
                let i = base + j as u64;
                if self.keeps(i) {
                    *v = x[i as usize] * self.scale;
                }
            }
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let Some((o0, o1)) = l.contiguous_offsets() else {
            candle_core::bail!("counter-dropout: the input must be contiguous");
        };
        if s.dtype() != candle_core::DType::F32 {
            candle_core::bail!("counter-dropout: takes f32, got {:?}", s.dtype());
        }
        let dev = s.device().clone();
        let x = s.as_cuda_slice::<f32>()?.slice(o0..o1);
        let n = o1 - o0;
        // SAFETY: every element is written by the kernel below.
        let mut out = unsafe { dev.alloc::<f32>(n)? };
        crate::gpu::dropout::launch(&dev, &x, &mut out, n, self.key, self.threshold, self.scale)?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(out, dev), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        // y = x * m: dy/dx = m, the same mask drawn again
        Ok(Some(self.apply_no_grad(grad_res)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn keeps_the_ratio_and_scales_what_it_keeps() {
        let mut d = Dropout::new(0.2, 7);
        let x = Tensor::ones(200_000, DType::F32, &Device::Cpu).unwrap();
        let y: Vec<f32> = d.apply(&x).unwrap().to_vec1().unwrap();
        let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / y.len() as f64;
        assert!((kept - 0.8).abs() < 0.005, "kept {kept}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 1.25).abs() < 1e-6));
        // the next call draws another mask; a run with the same seed draws the same ones
        let y2: Vec<f32> = d.apply(&x).unwrap().to_vec1().unwrap();
        assert_ne!(y, y2);
        let mut again = Dropout::new(0.2, 7);
        assert_eq!(again.apply(&x).unwrap().to_vec1::<f32>().unwrap(), y);
        assert_ne!(Dropout::new(0.2, 8).apply(&x).unwrap().to_vec1::<f32>().unwrap(), y);
    }

    #[test]
    fn the_gradient_is_masked_like_the_output() {
        let m = Dropout::new(0.5, 1).next_mask().unwrap();
        let x = Var::from_vec((0..1000).map(|i| i as f32 * 0.01 + 1.0).collect::<Vec<f32>>(), 1000, &Device::Cpu).unwrap();
        let w = Tensor::from_vec((0..1000).map(|i| (i % 7) as f32 - 3.0).collect::<Vec<f32>>(), 1000, &Device::Cpu).unwrap();
        let y = m.apply(x.as_tensor()).unwrap();
        let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = g.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        let (y, w): (Vec<f32>, Vec<f32>) = (y.to_vec1().unwrap(), w.to_vec1().unwrap());
        for i in 0..1000 {
            let kept = m.keeps(i as u64);
            assert_eq!(y[i] != 0.0, kept);
            assert_eq!(g[i], if kept { w[i] * 2.0 } else { 0.0 });
        }
        assert_eq!(Dropout::new(0.0, 1).next_mask(), None);
    }
}
