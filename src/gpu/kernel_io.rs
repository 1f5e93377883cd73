//! What the GPU kernels outside candle share when they take tensors and give one back: the
//! device a tensor is on, tensors made contiguous and held on the GPU while a kernel reads them
//! (`Held`), and a kernel's output buffer wrapped as a tensor. Built with the `cuda` feature only.

use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::{CudaDevice, CudaStorage, Result, Shape, Storage, Tensor};
use half::bf16;

/// A tensor's elements on the GPU (bf16 by `view`, any dtype by `view_as`), with the read
/// guard that keeps them there.
pub(crate) struct Held<'t> {
    guard: candle_core::StorageRef<'t>,
    start: usize,
    len: usize,
}

impl<'t> Held<'t> {
    pub(crate) fn new(t: &'t Tensor) -> Result<Held<'t>> {
        let (guard, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("a kernel input is not contiguous") };
        Ok(Held { guard, start, len: end - start })
    }

    pub(crate) fn view(&self) -> Result<CudaView<'_, bf16>> {
        self.view_as::<bf16>()
    }

    /// The elements as `T` (the tensor's dtype).
    pub(crate) fn view_as<T: candle_core::cuda_backend::CudaDType>(&self) -> Result<CudaView<'_, T>> {
        match &*self.guard {
            Storage::Cuda(s) => Ok(s.as_cuda_slice::<T>()?.slice(self.start..self.start + self.len)),
            _ => candle_core::bail!("a kernel input is not on the GPU"),
        }
    }
}

/// The CUDA device `t` lives on (`op` names the caller in the error).
pub(crate) fn cuda_device(t: &Tensor, op: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        _ => candle_core::bail!("{op}: not on a GPU"),
    }
}

/// The tensors made contiguous, to be [`Held`] while a kernel reads them.
pub(crate) fn contiguous(ts: &[&Tensor]) -> Result<Vec<Tensor>> {
    ts.iter().map(|t| t.contiguous()).collect()
}

/// A kernel's output buffer as a tensor of `shape` (no gradient).
pub(crate) fn output(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false)
}
