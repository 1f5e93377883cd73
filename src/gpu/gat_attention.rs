//! GATv2's message passing in one kernel a layer (`kernels/encoder_ops.cu`
//! `gatv2_attention_f32`): the scores of each node's padded neighbour slots, their softmax and
//! the weighted sum of the neighbours' `lin_l` rows, for Novae's graph encoder on a GPU. candle's
//! ops take a dozen kernels over `nodes x degree x heads x channels` tensors for the same
//! (`methods/novae.rs` keeps them: its CPU path and this op's reference; a GPU takes this op). On
//! the CPU the op runs the kernel's loop on the host (what `methods/novae.rs`'s unit test checks
//! against candle's ops); on a GPU, `__bench-encoder --arch novae` compares the kernel with them
//! on the first batch (`--unfused` times candle's ops). f32 throughout, as upstream.

use candle_core::{DType, Result, Tensor};

/// Whether the op takes a layer: f32 rows; on a GPU (a CUDA build) at most 1,024 channels (a
/// thread each) and the scores of `degree` slots within 48 KiB of shared memory.
pub fn applies(xl: &Tensor, degree: usize, heads: usize, channels: usize) -> bool {
    let hc = heads * channels;
    let fits = hc > 0 && hc <= 1024 && (degree * heads + hc) * 4 <= 48 * 1024;
    xl.dtype() == DType::F32 && (xl.device().is_cpu() || (cfg!(feature = "cuda") && xl.device().is_cuda() && fits))
}

/// `out[i] = sum_j softmax_j(s_ij) xl[nbr_ij]` with `s_ij = att . leaky_relu(xl[nbr_ij] + xr[i]
/// + attr_ij lin_edge, 0.2) + mask_ij`, per head, as `[n, heads * channels]` (heads concatenated).
/// `xl`, `xr`: `[n, heads * channels]`; `nbr` (u32), `attr`, `mask`: `[n, degree]`, a slot whose
/// `nbr` is `n` or more being padding (zero row); `lin_edge`, `att`: `heads * channels` values.
#[allow(clippy::too_many_arguments)]
pub fn gatv2_attention(xl: &Tensor, xr: &Tensor, nbr: &Tensor, attr: &Tensor, mask: &Tensor, lin_edge: &Tensor, att: &Tensor, heads: usize, channels: usize) -> Result<Tensor> {
    let (n, hc) = xl.dims2()?;
    let degree = nbr.elem_count() / n.max(1);
    if hc != heads * channels || xr.dims2()? != (n, hc) || nbr.elem_count() != n * degree || attr.elem_count() != n * degree || mask.elem_count() != n * degree || lin_edge.elem_count() != hc || att.elem_count() != hc {
        candle_core::bail!("gatv2-attention: shapes do not agree ({n} nodes x {hc} channels, {heads} heads of {channels}, {} slots)", nbr.elem_count());
    }
    if !applies(xl, degree, heads, channels) {
        candle_core::bail!("gatv2-attention takes f32 rows, and on a GPU at most 1,024 channels; methods/novae.rs has the candle ops");
    }
    if xl.device().is_cpu() {
        return host(xl, xr, nbr, attr, mask, lin_edge, att, n, degree, heads, channels);
    }
    #[cfg(feature = "cuda")]
    {
        cuda::launch(xl, xr, nbr, attr, mask, lin_edge, att, n, degree, heads, channels)
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("applies() is false on a GPU without the cuda feature")
}

/// The kernel's loop on the host, line for line (its test stands for the kernel's on the CPU).
#[allow(clippy::too_many_arguments)]
fn host(xl: &Tensor, xr: &Tensor, nbr: &Tensor, attr: &Tensor, mask: &Tensor, lin_edge: &Tensor, att: &Tensor, n: usize, d: usize, heads: usize, c: usize) -> Result<Tensor> {
    let v = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    let (xl_v, xr_v, attr, mask, we, wa) = (v(xl)?, v(xr)?, v(attr)?, v(mask)?, v(lin_edge)?, v(att)?);
    let nbr = nbr.flatten_all()?.to_vec1::<u32>()?;
    let hc = heads * c;
    let mut out = vec![0f32; n * hc];
    let mut score = vec![0f32; d * heads];
    let mut part = vec![0f32; hc];
    for i in 0..n {
        for j in 0..d {
            let src = nbr[i * d + j] as usize;
            for t in 0..hc {
                let xj = if src < n { xl_v[src * hc + t] } else { 0.0 };
                let mut e = xj + xr_v[i * hc + t] + attr[i * d + j] * we[t];
                e = e.max(0.2 * e);
                part[t] = e * wa[t];
            }
            for h in 0..heads {
                score[j * heads + h] = part[h * c..(h + 1) * c].iter().sum::<f32>() + mask[i * d + j];
            }
        }
        for t in 0..hc {
            let h = t / c;
            let m = (0..d).map(|j| score[j * heads + h]).fold(f32::NEG_INFINITY, f32::max);
            let z = (0..d).map(|j| (score[j * heads + h] - m).exp()).sum::<f32>() + 1e-16;
            let mut acc = 0f32;
            for j in 0..d {
                let src = nbr[i * d + j] as usize;
                if src < n {
                    acc += xl_v[src * hc + t] * ((score[j * heads + h] - m).exp() / z);
                }
            }
            out[i * hc + t] = acc;
        }
    }
    Tensor::from_vec(out, (n, hc), xl.device())
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Result, Tensor};

    use crate::gpu::kernel_io::{contiguous, cuda_device, output, Held};

    #[allow(clippy::too_many_arguments)]
    pub fn launch(xl: &Tensor, xr: &Tensor, nbr: &Tensor, attr: &Tensor, mask: &Tensor, lin_edge: &Tensor, att: &Tensor, n: usize, degree: usize, heads: usize, channels: usize) -> Result<Tensor> {
        let dev = cuda_device(xl, "gatv2-attention")?;
        let hc = heads * channels;
        let mut out = unsafe { dev.alloc::<f32>(n * hc)? };
        if n > 0 {
            let func = load_kernel!(dev, "gatv2_attention_f32", crate::gpu::fused_encoder::MODULE, crate::gpu::fused_encoder::PTX)?;
            let (n32, d32, h32, c32) = (n as i32, degree as i32, heads as i32, channels as i32);
            let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (hc as u32, 1, 1), shared_mem_bytes: ((degree * heads + hc) * 4) as u32 };
            // the inputs contiguous, held on the GPU while the kernel reads them
            let ts = contiguous(&[xl, xr, nbr, attr, mask, lin_edge, att])?;
            let held = ts.iter().map(Held::new).collect::<Result<Vec<Held>>>()?;
            let (xl, xr, nbr) = (held[0].view_as::<f32>()?, held[1].view_as::<f32>()?, held[2].view_as::<u32>()?);
            let (attr, mask, we, wa) = (held[3].view_as::<f32>()?, held[4].view_as::<f32>()?, held[5].view_as::<f32>()?, held[6].view_as::<f32>()?);
            let mut b = func.builder();
            b.arg(&xl);
            b.arg(&xr);
            b.arg(&nbr);
            b.arg(&attr);
            b.arg(&mask);
            b.arg(&we);
            b.arg(&wa);
            b.arg(&mut out);
            b.arg(&n32);
            b.arg(&d32);
            b.arg(&h32);
            b.arg(&c32);
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(output(CudaStorage::wrap_cuda_slice(out, dev), (n, hc)))
    }
}
