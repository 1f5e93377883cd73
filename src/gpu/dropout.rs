//! The CUDA side of counter-based dropout (`nn/dropout.rs`, the rule; `nn/train_ops.rs`, the
//! training ops): grid-stride kernels of `kernels/encoder_ops.cu` that draw the mask of element i
//! and apply it in the same pass: `dropout_f32`, and the residual and feed-forward steps
//! `add_dropped_*`, `dropped_to_*`, `act_dropped_*`, `act_dropped_bwd_*` (f32 or bf16 branch).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};

use super::train_rows::MaskArgs;

fn config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).min(65_535 * 8) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// `out[..n] = x[..n] * scale` where element i's 24-bit draw under `key` is below `threshold`,
/// else 0 (the rule of `nn::dropout::Mask::keeps`).
pub fn launch(dev: &CudaDevice, x: &CudaView<f32>, out: &mut CudaSlice<f32>, n: usize, key: u64, threshold: u32, scale: f32) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = load_kernel!(dev, "dropout_f32", super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
    let n64 = n as u64;
    let mut b = func.builder();
    b.arg(x);
    b.arg(out);
    b.arg(&key);
    b.arg(&threshold);
    b.arg(&scale);
    b.arg(&n64);
    // SAFETY: the arguments match the kernel's signature; x and out hold n values.
    unsafe { b.launch(config(n)) }.w()?;
    Ok(())
}

/// Launches elementwise training kernel `$name` over `$n` values: its leading arguments, then the
/// mask's four (has one, key, threshold, scale) and n, the tail every one of them shares.
macro_rules! launch_masked {
    ($dev:expr, $name:expr, $n:expr, $m:expr, [$($arg:expr),*]) => {{
        let n: usize = $n;
        if n == 0 {
            return Ok(());
        }
        let func = load_kernel!($dev, $name, super::fused_encoder::MODULE, super::fused_encoder::PTX)?;
        let (n64, m): (u64, MaskArgs) = (n as u64, $m);
        let mut b = func.builder();
        $(b.arg($arg);)*
        b.arg(&m.0);
        b.arg(&m.1);
        b.arg(&m.2);
        b.arg(&m.3);
        b.arg(&n64);
        // SAFETY: the arguments match the kernel's signature; every buffer holds n values.
        unsafe { b.launch(config(n)) }.w()?;
        Ok(())
    }};
}

/// `z = x + dropout(y)` over n elements (x, z f32; y of the kernel `suffix`, "f32" or "bf16").
pub fn add_dropped<T: DeviceRepr>(dev: &CudaDevice, suffix: &str, x: &CudaView<f32>, y: &CudaView<T>, z: &mut CudaSlice<f32>, n: usize, m: MaskArgs) -> Result<()> {
    launch_masked!(dev, &format!("add_dropped_{suffix}"), n, m, [x, y, z])
}

/// `dy = dropout(g)` over n elements, into T (`suffix`'s type): add_dropped's gradient of y.
pub fn dropped_to<T: DeviceRepr>(dev: &CudaDevice, suffix: &str, g: &CudaView<f32>, dy: &mut CudaSlice<T>, n: usize, m: MaskArgs) -> Result<()> {
    launch_masked!(dev, &format!("dropped_to_{suffix}"), n, m, [g, dy])
}

/// `out = dropout(a(h))` over n elements of T, `a(v) = v > 0 ? v : slope v`.
#[allow(clippy::too_many_arguments)]
pub fn act_dropped<T: DeviceRepr>(dev: &CudaDevice, suffix: &str, h: &CudaView<T>, out: &mut CudaSlice<T>, n: usize, slope: f32, m: MaskArgs) -> Result<()> {
    launch_masked!(dev, &format!("act_dropped_{suffix}"), n, m, [h, out, &slope])
}

/// act_dropped's gradient from its output `out` and the incoming gradient `g`.
#[allow(clippy::too_many_arguments)]
pub fn act_dropped_bwd<T: DeviceRepr>(dev: &CudaDevice, suffix: &str, out: &CudaView<T>, g: &CudaView<T>, dh: &mut CudaSlice<T>, n: usize, slope: f32, m: MaskArgs) -> Result<()> {
    launch_masked!(dev, &format!("act_dropped_bwd_{suffix}"), n, m, [out, g, dh, &slope])
}
