//! CellFM's retention around its two small products, in two kernels (`kernels/encoder_ops.cu`
//! `retention_split_*`, `retention_merge_*`): `split` takes the one product of the q, k, v and u
//! projections (token rows of `4 d`) into heads with relu and the `1 / sqrt(hd)` scale (q, k), the
//! key mask (k), each cell's value scale (v) and silu (u) applied as it copies; `merge` takes each
//! head's output through SRMSNorm, times u, back into token rows. candle's ops take about twenty
//! passes for the same (`methods/cellfm.rs` keeps them: its CPU path and these ops' reference; a
//! GPU takes these ops). f32 and bf16, math in f32 with one rounding. On the CPU the ops run the
//! kernels' loops on the host in f32 (what `methods/cellfm.rs`'s unit test checks against
//! candle's ops); on a GPU, `__bench-encoder --arch cellfm` compares the kernels with them on the
//! first batch (`--unfused` times candle's ops).

use candle_core::{DType, Result, Tensor};

/// Whether the ops take these rows: f32 on the CPU; f32 or bf16 on a GPU (a CUDA build).
pub fn applies(qkvu: &Tensor) -> bool {
    match qkvu.dtype() {
        DType::F32 => qkvu.device().is_cpu() || (cfg!(feature = "cuda") && qkvu.device().is_cuda()),
        DType::BF16 => cfg!(feature = "cuda") && qkvu.device().is_cuda(),
        _ => false,
    }
}

/// `qkvu`: `[cells * l, 4 * heads * hd]` (q, k, v, u); `mask`: `cells * l` f32 (1 at a token, 0
/// at padding); `vscale`: `cells` f32. Returns `[4, cells, heads, l, hd]`: relu(q) * inv_scale,
/// relu(k) * inv_scale * mask, v * vscale, silu(u).
pub fn split(qkvu: &Tensor, mask: &Tensor, vscale: &Tensor, cells: usize, l: usize, heads: usize, hd: usize, inv_scale: f64) -> Result<Tensor> {
    let d = heads * hd;
    if qkvu.dims2()? != (cells * l, 4 * d) || mask.elem_count() != cells * l || vscale.elem_count() != cells || mask.dtype() != DType::F32 || vscale.dtype() != DType::F32 {
        candle_core::bail!("retention-split: {:?} rows for {cells} cells of {l} tokens, {heads} heads of {hd}; {} mask and {} scale values (f32)", qkvu.dims(), mask.elem_count(), vscale.elem_count());
    }
    if !applies(qkvu) {
        candle_core::bail!("retention-split takes f32 rows (or bf16 on a GPU); methods/cellfm.rs has the candle ops");
    }
    if qkvu.device().is_cpu() {
        let (x, mk, vs) = (qkvu.flatten_all()?.to_vec1::<f32>()?, mask.flatten_all()?.to_vec1::<f32>()?, vscale.flatten_all()?.to_vec1::<f32>()?);
        let inv = inv_scale as f32;
        let mut out = vec![0f32; x.len()];
        for row in 0..cells * l {
            let (cell, pos) = (row / l, row % l);
            for e in 0..4 * d {
                let (part, rem) = (e / d, e % d);
                let (head, c) = (rem / hd, rem % hd);
                let v = x[row * 4 * d + e];
                let y = match part {
                    0 => v.max(0.0) * inv,
                    1 => v.max(0.0) * inv * mk[row],
                    2 => v * vs[cell],
                    _ => v / (1.0 + (-v).exp()),
                };
                out[(((part * cells + cell) * heads + head) * l + pos) * hd + c] = y;
            }
        }
        return Tensor::from_vec(out, (4, cells, heads, l, hd), qkvu.device());
    }
    #[cfg(feature = "cuda")]
    {
        cuda::split(qkvu, mask, vscale, cells, l, heads, hd, inv_scale as f32)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("applies() is false on a GPU without the cuda feature")
}

/// `o`, `u`: `[cells, heads, l, hd]` (u: `split`'s fourth part). Returns `[cells, l, heads * hd]`:
/// `o / max(|o / sqrt(hd)|_2, 1e-12) * u` per head row.
pub fn merge(o: &Tensor, u: &Tensor) -> Result<Tensor> {
    let (cells, heads, l, hd) = o.dims4()?;
    if u.dims4()? != (cells, heads, l, hd) || u.dtype() != o.dtype() || !applies(o) {
        candle_core::bail!("retention-merge: o {:?} {:?} and u {:?} {:?} must agree, f32 (or bf16 on a GPU)", o.dims(), o.dtype(), u.dims(), u.dtype());
    }
    if o.device().is_cpu() {
        let (ov, uv) = (o.flatten_all()?.to_vec1::<f32>()?, u.flatten_all()?.to_vec1::<f32>()?);
        let mut out = vec![0f32; ov.len()];
        let inv_sqrt = 1.0 / (hd as f32).sqrt();
        for r in 0..cells * heads * l {
            let x = &ov[r * hd..(r + 1) * hd];
            let ss: f32 = x.iter().map(|&v| (v * inv_sqrt) * (v * inv_sqrt)).sum();
            let inv = 1.0 / ss.sqrt().max(1e-12);
            let (cell, head, pos) = (r / (heads * l), (r / l) % heads, r % l);
            let dst = ((cell * l + pos) * heads + head) * hd;
            for c in 0..hd {
                out[dst + c] = x[c] * inv * uv[r * hd + c];
            }
        }
        return Tensor::from_vec(out, (cells, l, heads * hd), o.device());
    }
    #[cfg(feature = "cuda")]
    {
        cuda::merge(o, u, cells, heads, l, hd)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("applies() is false on a GPU without the cuda feature")
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Result, Tensor};
    use half::bf16;

    use crate::gpu::fused_encoder::{MODULE, PTX};
    use crate::gpu::kernel_io::{contiguous, cuda_device, output, Held};

    #[allow(clippy::too_many_arguments)]
    pub(super) fn split(qkvu: &Tensor, mask: &Tensor, vscale: &Tensor, cells: usize, l: usize, heads: usize, hd: usize, inv_scale: f32) -> Result<Tensor> {
        let dev = cuda_device(qkvu, "retention")?;
        let n = qkvu.elem_count();
        let ts = contiguous(&[qkvu, mask, vscale])?;
        let held = ts.iter().map(Held::new).collect::<Result<Vec<Held>>>()?;
        let (mk, vs) = (held[1].view_as::<f32>()?, held[2].view_as::<f32>()?);
        let (c32, l32, h32, d32) = (cells as i32, l as i32, heads as i32, hd as i32);
        let cfg = LaunchConfig { grid_dim: ((cells * l) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        macro_rules! run {
            ($t:ty, $name:literal) => {{
                let mut out = unsafe { dev.alloc::<$t>(n)? };
                if n > 0 {
                    let func = load_kernel!(dev, $name, MODULE, PTX)?;
                    let x = held[0].view_as::<$t>()?;
                    let mut b = func.builder();
                    b.arg(&x);
                    b.arg(&mk);
                    b.arg(&vs);
                    b.arg(&mut out);
                    b.arg(&c32);
                    b.arg(&l32);
                    b.arg(&h32);
                    b.arg(&d32);
                    b.arg(&inv_scale);
                    unsafe { b.launch(cfg) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let storage = if qkvu.dtype() == DType::BF16 { run!(bf16, "retention_split_bf16") } else { run!(f32, "retention_split_f32") };
        Ok(output(storage, (4, cells, heads, l, hd)))
    }

    pub(super) fn merge(o: &Tensor, u: &Tensor, cells: usize, heads: usize, l: usize, hd: usize) -> Result<Tensor> {
        let dev = cuda_device(o, "retention")?;
        let n = o.elem_count();
        let ts = contiguous(&[o, u])?;
        let held = ts.iter().map(Held::new).collect::<Result<Vec<Held>>>()?;
        let rows = (cells * heads * l) as i64;
        let (l32, h32, d32) = (l as i32, heads as i32, hd as i32);
        // a warp a row, 8 rows a block
        let cfg = LaunchConfig { grid_dim: ((rows as u64).div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        macro_rules! run {
            ($t:ty, $name:literal) => {{
                let mut out = unsafe { dev.alloc::<$t>(n)? };
                if n > 0 {
                    let func = load_kernel!(dev, $name, MODULE, PTX)?;
                    let (ov, uv) = (held[0].view_as::<$t>()?, held[1].view_as::<$t>()?);
                    let mut b = func.builder();
                    b.arg(&ov);
                    b.arg(&uv);
                    b.arg(&mut out);
                    b.arg(&rows);
                    b.arg(&l32);
                    b.arg(&h32);
                    b.arg(&d32);
                    unsafe { b.launch(cfg) }.w()?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let storage = if o.dtype() == DType::BF16 { run!(bf16, "retention_merge_bf16") } else { run!(f32, "retention_merge_f32") };
        Ok(output(storage, (cells, l, heads * hd)))
    }
}
