//! Row kernels of training: `nn/recompute_attention.rs`' row passes (`kernels/encoder_ops.cu`
//! `attn_probs_*`, `attn_ds_*`): one warp a row of scores, f32 or bf16 storage, f32 arithmetic,
//! the counter-based dropout mask drawn in the same pass; and `nn/layer_norm.rs`' forward and
//! backward (`ln_fwd_f32`, `ln_bwd_f32`), one warp a row.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

/// The dropout of the probabilities: (has one, key, threshold, scale).
pub type MaskArgs = (i32, u64, u32, f32);

fn config(rows: usize) -> LaunchConfig {
    // 8 warps a block, a warp a row
    LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// `pd = dropout(softmax(c s))` over `rows` rows of `l`; `suffix` is "f32" or "bf16" (T's kernel).
#[allow(clippy::too_many_arguments)]
pub fn probs<T: DeviceRepr>(dev: &CudaDevice, suffix: &str, s: &CudaView<T>, pd: &mut CudaSlice<T>, rows: usize, l: usize, c: f32, m: MaskArgs) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, &format!("attn_probs_{suffix}"), super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
    let (rows64, l32) = (rows as u64, l as i32);
    let mut b = func.builder();
    b.arg(s);
    b.arg(pd);
    b.arg(&rows64);
    b.arg(&l32);
    b.arg(&c);
    b.arg(&m.0);
    b.arg(&m.1);
    b.arg(&m.2);
    b.arg(&m.3);
    // SAFETY: the arguments match the kernel's signature; s and pd hold rows x l values.
    unsafe { b.launch(config(rows)) }.w()?;
    Ok(())
}

/// From scores `s` and `dpd = dO v^T`: `pd = dropout(P)`, `ds = c P * (dP - rowsum(dP * P))`.
#[allow(clippy::too_many_arguments)]
pub fn grads<T: DeviceRepr>(dev: &CudaDevice, suffix: &str, s: &CudaView<T>, dpd: &CudaView<T>, pd: &mut CudaViewMut<T>, ds: &mut CudaViewMut<T>, rows: usize, l: usize, c: f32, m: MaskArgs) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, &format!("attn_ds_{suffix}"), super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
    let (rows64, l32) = (rows as u64, l as i32);
    let mut b = func.builder();
    b.arg(s);
    b.arg(dpd);
    b.arg(pd);
    b.arg(ds);
    b.arg(&rows64);
    b.arg(&l32);
    b.arg(&c);
    b.arg(&m.0);
    b.arg(&m.1);
    b.arg(&m.2);
    b.arg(&m.3);
    // SAFETY: the arguments match the kernel's signature; every buffer holds rows x l values.
    unsafe { b.launch(config(rows)) }.w()?;
    Ok(())
}

/// Layer norm's forward over `rows` rows of `d` (f32).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward(dev: &CudaDevice, x: &CudaView<f32>, w: &CudaView<f32>, b: &CudaView<f32>, y: &mut CudaSlice<f32>, rows: usize, d: usize, eps: f32) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "ln_fwd_f32", super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
    let (rows64, d32) = (rows as u64, d as i32);
    let mut a = func.builder();
    a.arg(x);
    a.arg(w);
    a.arg(b);
    a.arg(y);
    a.arg(&rows64);
    a.arg(&d32);
    a.arg(&eps);
    // SAFETY: the arguments match the kernel's signature; x and y hold rows x d values, w and b d.
    unsafe { a.launch(config(rows)) }.w()?;
    Ok(())
}

/// Layer norm's backward: `dx`, and `gx = dy xh` (its sum over rows is the weight's gradient).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(dev: &CudaDevice, x: &CudaView<f32>, w: &CudaView<f32>, dy: &CudaView<f32>, dx: &mut CudaViewMut<f32>, gx: &mut CudaViewMut<f32>, rows: usize, d: usize, eps: f32) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "ln_bwd_f32", super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
    let (rows64, d32) = (rows as u64, d as i32);
    let mut a = func.builder();
    a.arg(x);
    a.arg(w);
    a.arg(dy);
    a.arg(dx);
    a.arg(gx);
    a.arg(&rows64);
    a.arg(&d32);
    a.arg(&eps);
    // SAFETY: the arguments match the kernel's signature; x, dy, dx and gx hold rows x d values.
    unsafe { a.launch(config(rows)) }.w()?;
    Ok(())
}
