//! Softmax attention over packed cells: the cells of a batch follow each other in one
//! `(tokens, 3 * heads * head_dim)` QKV tensor without padding, and `cu` (cells + 1 offsets, as
//! FlashAttention's `cu_seqlens`) says where each begins. Each cell's tokens attend to that
//! cell's tokens only, so no padding is ever computed and no mask is needed. Causal attention
//! (GPT-NeoX: each token sees its cell's tokens up to itself) is the same with the keys past the
//! query masked, and a block's key tiles past its last query row skipped.
//!
//! Two paths with one answer:
//! - on a GPU, bf16, head dimension 64 (Geneformer V1/V2, scGPT, UCE): one fused kernel (online
//!   softmax over key tiles on tensor cores, no score tensor in memory), built into the CUDA
//!   binary by build.rs: `kernels/varlen_attention_sm90.cu` (wgmma) on Hopper (compute
//!   capability 9.x), `kernels/varlen_attention.cu` (mma.sync) on any other GPU or where
//!   `SCFOUNDRY_ATTENTION=portable` asks for it;
//! - anything else (the CPU, f32, other head sizes): [`reference`], plain candle ops a cell at a
//!   time in f32. It is the oracle the kernel is checked against (`__bench-encoder --check`).

use candle_core::{DType, Result, Tensor, D};

/// Scaled dot-product attention of every cell over its own tokens: `qkv` is
/// `(tokens, 3 * heads * head_dim)` laid out `[q | k | v]`, `cu` the cells' token offsets
/// (`cu[0] == 0`, `cu[last] == tokens`). Returns `(tokens, heads * head_dim)` in `qkv`'s dtype.
pub fn varlen_attention(qkv: &Tensor, cu: &[u32], heads: usize) -> Result<Tensor> {
    varlen_attention_with(qkv, cu, heads, false)
}

/// [`varlen_attention`], causal when asked: token i of a cell attends to its tokens 0..=i.
pub fn varlen_attention_with(qkv: &Tensor, cu: &[u32], heads: usize, causal: bool) -> Result<Tensor> {
    let (tokens, width) = qkv.dims2()?;
    check(tokens, width, cu, heads)?;
    varlen_attention_scaled(qkv, cu, heads, causal, default_scale(width / 3 / heads))
}

/// [`varlen_attention_with`] with the scores multiplied by `scale` instead of
/// `1 / sqrt(head_dim)`: for heads widened with zero columns (`TransformerStack::pad_heads`),
/// whose scores keep their real width's scale.
pub fn varlen_attention_scaled(qkv: &Tensor, cu: &[u32], heads: usize, causal: bool, scale: f64) -> Result<Tensor> {
    let (tokens, width) = qkv.dims2()?;
    check(tokens, width, cu, heads)?;
    if fused_kernel_applies(qkv, width / 3 / heads) {
        #[cfg(feature = "cuda")]
        {
            let offsets = crate::gpu::upload::upload_u32(cu, qkv.device())?;
            return qkv.contiguous()?.apply_op2_no_bwd(&offsets, &cuda::VarlenAttention { heads, longest: longest(cu), causal, scale: scale as f32 });
        }
    }
    reference_scaled(qkv, cu, heads, causal, scale)
}

/// `1 / sqrt(head_dim)`: the scores' scale of heads `head_dim` wide.
pub fn default_scale(head_dim: usize) -> f64 {
    1.0 / (head_dim.max(1) as f64).sqrt()
}

/// Whether `varlen_attention` runs the fused kernel for this input.
pub fn fused_kernel_applies(qkv: &Tensor, head_dim: usize) -> bool {
    cfg!(feature = "cuda") && qkv.device().is_cuda() && qkv.dtype() == DType::BF16 && head_dim == 64
}

fn check(tokens: usize, width: usize, cu: &[u32], heads: usize) -> Result<()> {
    if heads == 0 || width % (3 * heads) != 0 {
        candle_core::bail!("varlen attention: a QKV row of {width} values is not 3 x {heads} heads");
    }
    if cu.first() != Some(&0) || cu.last().map(|&t| t as usize) != Some(tokens) || cu.windows(2).any(|w| w[1] < w[0]) {
        candle_core::bail!("varlen attention: cell offsets must rise from 0 to the {tokens} tokens");
    }
    Ok(())
}

/// The longest cell's token count (the attention kernel's grid is sized by it).
#[cfg(feature = "cuda")]
pub(crate) fn longest(cu: &[u32]) -> usize {
    cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0)
}

/// Attention scores one batched product of the reference path may hold (floats, 1 GiB in f32).
const REFERENCE_SCORES: usize = 1 << 28;

/// The same attention from plain candle ops, computed in f32: softmax(q k^T / sqrt(head_dim)) v
/// per head. Consecutive cells of the same length run as one batched product (up to
/// `REFERENCE_SCORES` scores: scPRINT's cells all have --max-len tokens), others one at a time.
pub fn reference(qkv: &Tensor, cu: &[u32], heads: usize) -> Result<Tensor> {
    reference_with(qkv, cu, heads, false)
}

/// [`reference`], causal when asked (the keys past each query at -inf before the softmax).
pub fn reference_with(qkv: &Tensor, cu: &[u32], heads: usize, causal: bool) -> Result<Tensor> {
    let (tokens, width) = qkv.dims2()?;
    check(tokens, width, cu, heads)?;
    reference_scaled(qkv, cu, heads, causal, default_scale(width / 3 / heads))
}

/// [`reference_with`] with the scores multiplied by `scale` (see [`varlen_attention_scaled`]).
pub fn reference_scaled(qkv: &Tensor, cu: &[u32], heads: usize, causal: bool, scale: f64) -> Result<Tensor> {
    let (tokens, width) = qkv.dims2()?;
    check(tokens, width, cu, heads)?;
    let d = width / 3;
    let hd = d / heads;
    let x = qkv.to_dtype(DType::F32)?;
    let mut parts = Vec::with_capacity(cu.len().saturating_sub(1));
    let mut c = 0;
    while c + 1 < cu.len() {
        let (s, n) = (cu[c] as usize, (cu[c + 1] - cu[c]) as usize);
        // the run of following cells of this length, as many as the score budget holds
        let most = (REFERENCE_SCORES / (heads * n * n).max(1)).max(1);
        let mut k = 1;
        while k < most && c + k + 1 < cu.len() && (cu[c + k + 1] - cu[c + k]) as usize == n {
            k += 1;
        }
        c += k;
        if n == 0 {
            continue;
        }
        let cells = x.narrow(0, s, k * n)?;
        let split = |i: usize| cells.narrow(1, i * d, d)?.reshape((k, n, heads, hd))?.transpose(1, 2)?.contiguous(); // (k, heads, n, hd)
        let (q, kk, v) = (split(0)?, split(1)?, split(2)?);
        let mut scores = (q.matmul(&kk.transpose(2, 3)?.contiguous()?)? * scale)?;
        if causal {
            let mask: Vec<f32> = (0..n * n).map(|i| if i % n > i / n { f32::NEG_INFINITY } else { 0.0 }).collect();
            scores = scores.broadcast_add(&Tensor::from_vec(mask, (n, n), x.device())?)?;
        }
        let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
        parts.push(p.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((k * n, d))?);
    }
    if parts.is_empty() {
        return Tensor::zeros((0, d), qkv.dtype(), qkv.device());
    }
    Tensor::cat(&parts, 0)?.to_dtype(qkv.dtype())
}

#[cfg(feature = "cuda")]
pub use cuda::kernel_name;
#[cfg(feature = "cuda")]
pub(crate) use cuda::launch as launch_fused;

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::cuda_backend::DeviceId;
    use candle_core::{CpuStorage, CudaDevice, CudaStorage, Layout, Result, Shape};
    use std::sync::Mutex;

    use crate::gpu::tma;
    use crate::gpu::KernelImage;

    pub(crate) static PTX: KernelImage = kernel_image!("varlen_attention");
    pub(crate) const MODULE: &str = "scfoundry_varlen_attention";
    /// Empty unless the binary was built for compute capability 9.0 (build.rs); runs on 9.0 alone (sm_90a).
    static PTX_SM90: KernelImage = kernel_image!("varlen_attention_sm90");
    /// The Hopper kernel's dynamic shared memory: 128 query rows and two buffers of 96 key and
    /// 96 value rows, 128 bytes each, and 1024 bytes to align the tiles (kernels/varlen_attention_sm90.cu).
    const SM90_SHARED: u32 = 128 * 128 + 2 * 2 * 96 * 128 + 1024;
    const SM90_KERNEL: &str = "varlen_attention_bf16_d64_sm90";
    const SM90_CAUSAL: &str = "varlen_attention_causal_bf16_d64_sm90";
    const SM90_MODULE: &str = "scfoundry_varlen_attention_sm90";

    /// Which attention kernel runs on `dev`: "sm90" (wgmma, Hopper) or "portable" (mma.sync).
    /// Decided once per device (the first launch reads SCFOUNDRY_ATTENTION, asks the compute
    /// capability and raises the Hopper kernel's shared-memory limit), not on every launch.
    pub fn kernel_name(dev: &CudaDevice) -> Result<&'static str> {
        static CHOSEN: Mutex<Vec<(DeviceId, &'static str)>> = Mutex::new(Vec::new());
        let mut chosen = CHOSEN.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, name)) = chosen.iter().find(|(id, _)| *id == dev.id()) {
            return Ok(name);
        }
        let hopper = !PTX_SM90.is_empty() && matches!(dev.cuda_stream().context().compute_capability(), Ok((9, 0)));
        let name = if hopper && std::env::var(crate::env::EnvVars::ATTENTION).map_or(true, |v| v != "portable") {
            for kernel in [SM90_KERNEL, SM90_CAUSAL] {
                let func = load_kernel!(dev, kernel, SM90_MODULE, PTX_SM90)?;
                func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SM90_SHARED as i32).w()?;
            }
            "sm90"
        } else {
            "portable"
        };
        chosen.push((dev.id(), name));
        Ok(name)
    }

    /// The kernel over `qkv` (`tokens x 3 d`, bf16) into `out` (`tokens x d`): every row of a cell
    /// with tokens is written. `longest` is the longest cell's token count. The Hopper kernel reads
    /// `qkv` through a TMA tensor map (boxes of 64 columns x 32 rows); a `qkv` that cannot be one
    /// (not on a 16-byte boundary) takes the portable kernel. `causal`: each token attends to its
    /// cell's tokens up to itself. `scale` multiplies the scores (`1/sqrt(64)` = 0.125 but for
    /// heads widened with zero columns).
    #[allow(clippy::too_many_arguments)]
    pub fn launch(dev: &CudaDevice, qkv: &CudaView<half::bf16>, out: &mut CudaSlice<half::bf16>, offsets: &CudaView<u32>, heads: usize, longest: usize, cells: usize, causal: bool, scale: f32) -> Result<()> {
        // either kernel: a block takes 128 query rows of one head of one cell
        let grid_dim = (longest.div_ceil(128) as u32, heads as u32, cells as u32);
        let scale_log2 = scale * std::f32::consts::LOG2_E; // the kernels work in base 2
        let width = 3 * heads * 64;
        let stream = dev.cuda_stream();
        // the guard records the kernel's read of qkv on the stream when it drops, after the launch
        let (ptr, _read_qkv) = qkv.device_ptr(&stream);
        let heads = heads as i32;
        if kernel_name(dev)? == "sm90" && tma::fits(ptr, width) {
            let map = tma::tensor_map(ptr, qkv.len() / width, width, 32)?;
            let func = load_kernel!(dev, if causal { SM90_CAUSAL } else { SM90_KERNEL }, SM90_MODULE, PTX_SM90)?;
            let cfg = LaunchConfig { grid_dim, block_dim: (256, 1, 1), shared_mem_bytes: SM90_SHARED };
            let mut b = func.builder();
            b.arg(&map);
            b.arg(out);
            b.arg(offsets);
            b.arg(&heads);
            b.arg(&scale_log2);
            unsafe { b.launch(cfg) }.w()?;
        } else {
            let func = load_kernel!(dev, if causal { "varlen_attention_causal_bf16_d64" } else { "varlen_attention_bf16_d64" }, MODULE, PTX)?;
            let cfg = LaunchConfig { grid_dim, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
            let mut b = func.builder();
            b.arg(qkv);
            b.arg(out);
            b.arg(offsets);
            b.arg(&heads);
            b.arg(&scale_log2);
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    }

    pub struct VarlenAttention {
        pub heads: usize,
        pub longest: usize,
        pub causal: bool,
        pub scale: f32,
    }

    impl candle_core::CustomOp2 for VarlenAttention {
        fn name(&self) -> &'static str {
            "varlen-attention"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            candle_core::bail!("varlen-attention: the fused kernel is for CUDA; the CPU runs varlen_attention::reference")
        }

        fn cuda_fwd(&self, qkv: &CudaStorage, ql: &Layout, cu: &CudaStorage, cl: &Layout) -> Result<(CudaStorage, Shape)> {
            let dev = qkv.device().clone();
            let (tokens, width) = ql.shape().dims2()?;
            let d = width / 3;
            let cells = cl.shape().elem_count().saturating_sub(1);
            let (Some((q_start, q_end)), Some((c_start, c_end))) = (ql.contiguous_offsets(), cl.contiguous_offsets()) else {
                candle_core::bail!("varlen-attention: inputs must be contiguous");
            };
            if q_start % 8 != 0 {
                candle_core::bail!("varlen-attention: the QKV tensor must start on a 16-byte boundary");
            }
            let q = qkv.as_cuda_slice::<half::bf16>()?.slice(q_start..q_end);
            let offsets = cu.as_cuda_slice::<u32>()?.slice(c_start..c_end);
            let mut out = dev.alloc_zeros::<half::bf16>(tokens * d)?;
            if cells > 0 && self.longest > 0 {
                launch(&dev, &q, &mut out, &offsets, self.heads, self.longest, cells, self.causal, self.scale)?;
            }
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((tokens, d))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The attention of one cell written out with loops: the oracle of the oracle.
    fn by_hand(qkv: &[f32], n: usize, heads: usize, hd: usize) -> Vec<f32> {
        let d = heads * hd;
        let mut out = vec![0f32; n * d];
        for h in 0..heads {
            for i in 0..n {
                let q = &qkv[i * 3 * d + h * hd..][..hd];
                let s: Vec<f32> = (0..n).map(|j| q.iter().zip(&qkv[j * 3 * d + d + h * hd..][..hd]).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()).collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for j in 0..n {
                    for c in 0..hd {
                        out[i * d + h * hd + c] += e[j] / z * qkv[j * 3 * d + 2 * d + h * hd + c];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn cells_attend_only_to_their_own_tokens() {
        let (heads, hd) = (2, 4);
        let d = heads * hd;
        let cu = [0u32, 3, 3, 8]; // an empty cell in the middle
        let tokens = 8;
        let vals: Vec<f32> = (0..tokens * 3 * d).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let qkv = Tensor::from_vec(vals.clone(), (tokens, 3 * d), &Device::Cpu).unwrap();
        let got = varlen_attention(&qkv, &cu, heads).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got.len(), tokens);
        let first = by_hand(&vals[..3 * 3 * d], 3, heads, hd);
        let second = by_hand(&vals[3 * 3 * d..], 5, heads, hd);
        let want: Vec<f32> = first.into_iter().chain(second).collect();
        for (a, b) in got.iter().flatten().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // one cell of all 8 tokens differs: the offsets matter
        let joint = varlen_attention(&qkv, &[0, 8], heads).unwrap().to_vec2::<f32>().unwrap();
        assert!(joint.iter().flatten().zip(&want).any(|(a, b)| (a - b).abs() > 1e-3));
    }

    #[test]
    fn cells_of_one_length_run_together_with_the_same_answer() {
        let (heads, hd) = (2, 4);
        let d = heads * hd;
        // three cells of 3 tokens (one batched product), an empty one, two of 2, one of 3
        let cu = [0u32, 3, 6, 9, 9, 11, 13, 16];
        let tokens = 16;
        let vals: Vec<f32> = (0..tokens * 3 * d).map(|i| ((i * 41 % 29) as f32 - 14.0) / 9.0).collect();
        let qkv = Tensor::from_vec(vals.clone(), (tokens, 3 * d), &Device::Cpu).unwrap();
        let got: Vec<f32> = varlen_attention(&qkv, &cu, heads).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let mut want = Vec::new();
        for w in cu.windows(2) {
            let (s, n) = (w[0] as usize, (w[1] - w[0]) as usize);
            want.extend(by_hand(&vals[s * 3 * d..(s + n) * 3 * d], n, heads, hd));
        }
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn causal_tokens_see_their_cells_earlier_tokens_only() {
        let (heads, hd) = (2, 4);
        let d = heads * hd;
        let cu = [0u32, 3, 8];
        let vals: Vec<f32> = (0..8 * 3 * d).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let qkv = Tensor::from_vec(vals.clone(), (8, 3 * d), &Device::Cpu).unwrap();
        let got = varlen_attention_with(&qkv, &cu, heads, true).unwrap().to_vec2::<f32>().unwrap();
        // token i of a cell: the non-causal attention of the cell's first i + 1 tokens, at row i
        for w in cu.windows(2) {
            let s = w[0] as usize;
            for i in 0..(w[1] - w[0]) as usize {
                let want = by_hand(&vals[s * 3 * d..(s + i + 1) * 3 * d], i + 1, heads, hd);
                for (a, b) in got[s + i].iter().zip(&want[i * d..(i + 1) * d]) {
                    assert!((a - b).abs() < 1e-5, "token {} : {a} vs {b}", s + i);
                }
            }
        }
        // the first token of a cell is its own value; not so without the mask
        assert!(got[3].iter().zip(&vals[3 * 3 * d + 2 * d..3 * 3 * d + 3 * d]).all(|(a, b)| (a - b).abs() < 1e-6));
        let full = varlen_attention(&qkv, &cu, heads).unwrap().to_vec2::<f32>().unwrap();
        assert!(full[3].iter().zip(&got[3]).any(|(a, b)| (a - b).abs() > 1e-3));
    }

    #[test]
    fn bad_offsets_are_refused() {
        let qkv = Tensor::zeros((4, 12), DType::F32, &Device::Cpu).unwrap();
        assert!(varlen_attention(&qkv, &[0, 3], 2).is_err());
        assert!(varlen_attention(&qkv, &[1, 4], 2).is_err());
        assert!(varlen_attention(&qkv, &[0, 4], 5).is_err());
        assert!(!fused_kernel_applies(&qkv, 64));
    }
}
