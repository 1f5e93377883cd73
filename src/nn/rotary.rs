//! Rotary position embedding (Su et al., "RoFormer", arXiv:2104.09864) in GPT-NeoX's
//! rotate-half form, as Hugging Face's `modeling_gpt_neox.py` applies it: the first `dims`
//! values of each head's query and key are split in halves `x1`, `x2` and become
//! `x1 cos - x2 sin` and `x2 cos + x1 sin` at angle `position x inv_freq[i]`; the rest of the
//! head passes through. Positions count from each packed cell's first token (a right-padded or
//! lone cell's positions 0..n-1, as upstream gives them).
//!
//! Two paths with one answer: candle ops in f32 on any device (the reference), and on a GPU one
//! pass over the bf16 QKV rows in place (`kernels/encoder_ops.cu` `rotary_qk_bf16`, the angles
//! and products in f32, each value rounded to bf16 once), which the fused encoder
//! (`gpu/fused_encoder.rs`) runs between the QKV product and attention.

use candle_core::{DType, Result, Tensor};

/// The rotated share of each head and its frequencies.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotary {
    /// values of each head rotated (even, at most the head's width)
    pub dims: usize,
    /// `dims / 2` frequencies: `1 / base^(2 i / dims)`
    pub inv_freq: Vec<f32>,
}

impl Rotary {
    /// GPT-NeoX's frequencies over `dims` values of base `base` (float32 as torch computes them).
    pub fn new(dims: usize, base: f64) -> Rotary {
        let inv_freq = (0..dims / 2).map(|i| (1.0 / base.powf((2 * i) as f32 as f64 / dims as f64)) as f32).collect();
        Rotary { dims, inv_freq }
    }

    /// `qkv` (`tokens x 3 heads head_dim`, `[q | k | v]`) with its queries and keys rotated at each
    /// token's position in its cell (`cu`: the cells' token offsets). Computed in f32, returned in
    /// `qkv`'s dtype.
    pub fn apply(&self, qkv: &Tensor, cu: &[u32], heads: usize) -> Result<Tensor> {
        let (t, w) = qkv.dims2()?;
        let hd = w / 3 / heads.max(1);
        let (rot, half) = (self.dims, self.dims / 2);
        if rot == 0 {
            return Ok(qkv.clone());
        }
        if rot > hd || rot % 2 != 0 || cu.last().map(|&e| e as usize) != Some(t) {
            candle_core::bail!("rotary: {rot} rotated values of {hd}-wide heads over {t} tokens (cells end at {:?})", cu.last());
        }
        let (mut cos, mut sin) = (Vec::with_capacity(t * half), Vec::with_capacity(t * half));
        for c in cu.windows(2) {
            for p in 0..c[1].saturating_sub(c[0]) {
                for &f in &self.inv_freq {
                    let a = p as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        let dev = qkv.device();
        let cos = Tensor::from_vec(cos, (t, 1, 1, half), dev)?;
        let sin = Tensor::from_vec(sin, (t, 1, 1, half), dev)?;
        let x = qkv.to_dtype(DType::F32)?.reshape((t, 3, heads, hd))?;
        let qk = x.narrow(1, 0, 2)?;
        let (x1, x2) = (qk.narrow(3, 0, half)?, qk.narrow(3, half, half)?);
        let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        let mut parts = vec![r1, r2];
        if rot < hd {
            parts.push(qk.narrow(3, rot, hd - rot)?);
        }
        let qk = Tensor::cat(&parts, 3)?;
        Tensor::cat(&[qk, x.narrow(1, 2, 1)?], 1)?.reshape((t, w))?.to_dtype(qkv.dtype())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn rotates_the_first_dims_of_q_and_k_from_each_cells_start() {
        // 2 heads of 4, 2 rotated values each; cells of 2 and 3 tokens
        let (heads, hd) = (2, 4);
        let w = 3 * heads * hd;
        let cu = [0u32, 2, 5];
        let vals: Vec<f32> = (0..5 * w).map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0).collect();
        let qkv = Tensor::from_vec(vals.clone(), (5, w), &Device::Cpu).unwrap();
        let r = Rotary::new(2, 10000.0);
        assert_eq!(r.inv_freq, vec![1.0]);
        let got: Vec<Vec<f32>> = r.apply(&qkv, &cu, heads).unwrap().to_vec2().unwrap();
        let pos = [0usize, 1, 0, 1, 2];
        for (tok, row) in got.iter().enumerate() {
            let (c, s) = ((pos[tok] as f32).cos(), (pos[tok] as f32).sin());
            for part in 0..3 {
                for h in 0..heads {
                    let o = part * heads * hd + h * hd;
                    let x = &vals[tok * w + o..tok * w + o + hd];
                    let want = if part == 2 { x.to_vec() } else { vec![x[0] * c - x[1] * s, x[1] * c + x[0] * s, x[2], x[3]] };
                    for (a, b) in row[o..o + hd].iter().zip(&want) {
                        assert!((a - b).abs() < 1e-6, "token {tok} part {part} head {h}: {a} vs {b}");
                    }
                }
            }
        }
        // position 0 of every cell is untouched
        assert_eq!(got[2], vals[2 * w..3 * w].to_vec());
    }
}
