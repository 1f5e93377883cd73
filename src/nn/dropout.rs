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

    /// Whether attention probability (query `q`, key `c`) of row block `bh` (cell x heads +
    /// head) is kept, in sequences of `len` tokens. The attention rule differs from
    /// [`Mask::keeps`]: the four elements (q, q + 8) x (c, c + 1) with q % 16 < 8 and c even
    /// share one draw of 64 bits, 16 bits each, kept when below `threshold / 2^8` (the keep
    /// ratio to 16 bits instead of 24). Those four are the values one GPU lane holds of a
    /// matrix-product tile in the fused attention kernels, so each draws once for four
    /// (`gpu/kernels/attention_common.cuh`, `attn_group_bits`, repeats this).
    pub fn keeps_attention(&self, bh: u64, q: u64, c: u64, len: u64) -> bool {
        let (len16, pairs) = (len.div_ceil(16) * 16, len.div_ceil(2));
        let group = (bh * len16 + (q & !8)) * pairs + (c >> 1);
        let bits = mix(self.key.wrapping_add((group + 1).wrapping_mul(GOLDEN)));
        let draw = (bits >> (16 * (((q >> 3) & 1) * 2 + (c & 1)))) as u32 & 0xffff;
        draw < self.threshold >> 8
    }

    /// The attention multiplier of (query `q`, key `c`) of row block `bh`: the scale when
    /// kept, else 0.
    pub fn attention_multiplier(&self, bh: u64, q: u64, c: u64, len: u64) -> f32 {
        if self.keeps_attention(bh, q, c, len) {
            self.scale
        } else {
            0.0
        }
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

/// The kernels' form of a mask (`gpu::train_rows::MaskArgs`): (has one, key, threshold, scale).
#[cfg(feature = "cuda")]
pub(crate) fn kernel_args(mask: Option<Mask>) -> crate::gpu::train_rows::MaskArgs {
    match mask {
        Some(m) => (1, m.key, m.threshold, m.scale),
        None => (0, 0, 0, 1.0),
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
    fn the_attention_rule_keeps_the_ratio_and_shares_a_draw_by_four() {
        let m = Dropout::new(0.2, 7).next_mask().unwrap();
        let len = 37u64;
        let (mut kept, mut n) = (0usize, 0usize);
        for bh in 0..6 {
            for q in 0..len {
                for c in 0..len {
                    n += 1;
                    kept += m.keeps_attention(bh, q, c, len) as usize;
                }
            }
        }
        let ratio = kept as f64 / n as f64;
        assert!((ratio - 0.8).abs() < 0.01, "kept {ratio}");
        // the four elements of a group are not all the same draw: over many groups, their
        // keep decisions differ somewhere
        let differ = (0..len / 2).any(|c2| m.keeps_attention(0, 0, 2 * c2, len) != m.keeps_attention(0, 8, 2 * c2 + 1, len));
        assert!(differ);
        // another row block or key draws another mask
        let same = (0..len).all(|c| m.keeps_attention(0, 3, c, len) == m.keeps_attention(1, 3, c, len));
        assert!(!same);
        assert_eq!(m.attention_multiplier(0, 0, 0, len), if m.keeps_attention(0, 0, 0, len) { m.scale } else { 0.0 });
    }

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
