//! The CUDA side of `nn/dropout.rs`'s counter-based dropout: one grid-stride kernel
//! (`kernels/encoder_ops.cu` `dropout_f32`) draws the mask and applies it in one pass.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

/// `out[..n] = x[..n] * scale` where element i's 24-bit draw under `key` is below `threshold`,
/// else 0 (the rule of `nn::dropout::Mask::keeps`).
pub fn launch(dev: &CudaDevice, x: &CudaView<f32>, out: &mut CudaSlice<f32>, n: usize, key: u64, threshold: u32, scale: f32) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "dropout_f32", super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
    let blocks = n.div_ceil(256).min(65_535 * 8) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let n64 = n as u64;
    let mut b = func.builder();
    b.arg(x);
    b.arg(out);
    b.arg(&key);
    b.arg(&threshold);
    b.arg(&scale);
    b.arg(&n64);
    // SAFETY: the arguments match the kernel's signature; x and out hold n values.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
