//! An output computed outside candle's autograd graph, handed to the op that stands for it in
//! the graph (`recompute_attention`, `lean_linear`): the op's forward takes it and returns (a
//! copy of) its storage, so the graph holds one copy until the backward pass; the op's backward
//! forms the gradients by hand. Also [`stacked`], the shape of such ops' two stacked results.

use std::sync::Mutex;

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};

/// The output, until the op's forward takes it.
pub struct Computed {
    out: Mutex<Option<Tensor>>,
    op: &'static str,
}

impl Computed {
    pub fn new(out: Tensor, op: &'static str) -> Computed {
        Computed { out: Mutex::new(Some(out)), op }
    }

    fn take(&self) -> Result<Tensor> {
        let out = self.out.lock().map_err(|_| candle_core::Error::Msg(format!("{}: poisoned", self.op)))?.take();
        out.ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.op)))
    }

    /// For the op's `cpu_fwd`.
    pub fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        let out = self.take()?;
        let (s, l) = out.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(c) => Ok((candle_core::backend::BackendStorage::try_clone(c, l)?, l.shape().clone())),
            _ => candle_core::bail!("{}: the output is not on the CPU", self.op),
        }
    }

    /// For the op's `cuda_fwd`.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = self.take()?;
        let (s, l) = out.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(c) => Ok((candle_core::backend::BackendStorage::try_clone(c, l)?, l.shape().clone())),
            _ => candle_core::bail!("{}: the output is not on the GPU", self.op),
        }
    }
}

/// The shape `(2, ..l's dims)`: an op whose forward returns two results of `l`'s shape stacked
/// (layer norm's backward: dx and dy x̂; attention's row pass: the dropped probabilities and dS).
pub fn stacked(l: &Layout) -> Shape {
    let mut d = vec![2];
    d.extend_from_slice(l.dims());
    Shape::from(d)
}
