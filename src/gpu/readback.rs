//! Batch results read back one batch behind, so the GPU never waits for the host between
//! batches. A plain `to_vec` after each batch makes the host wait for the GPU to finish, and the
//! GPU then waits while the host packs and queues the next batch (Nsight Compute's kernel times
//! against the wall time, BENCHMARKS.md: 14% of Geneformer V1's pass and 5% of scGPT's were such
//! gaps). With [`Lagged`], batch i's result is copied into page-locked host memory behind batch
//! i's work, batch i + 1 is queued, and only then does the host wait, for batch i's copy, while
//! the GPU runs batch i + 1. Two page-locked buffers alternate (`pinned.rs`); on the CPU the values
//! are read at once.

use candle_core::{DType, Result, Tensor};

/// Tensors' values read back one `push` late (see the module's comment), each with the tag it
/// was pushed with (what the caller needs to place it: a batch's cells, a row range).
pub struct Lagged<T = ()> {
    pending: Option<(T, Pending)>,
    #[cfg(feature = "cuda")]
    buffers: super::pinned::PinnedPair<f32>,
}

enum Pending {
    Ready(Vec<f32>),
    #[cfg(feature = "cuda")]
    Copying {
        slot: usize,
        len: usize,
        // the source stays alive until its copy is read
        _source: Tensor,
    },
}

impl<T> Default for Lagged<T> {
    fn default() -> Lagged<T> {
        Lagged {
            pending: None,
            #[cfg(feature = "cuda")]
            buffers: Default::default(),
        }
    }
}

impl<T> Lagged<T> {
    pub fn new() -> Lagged<T> {
        Lagged::default()
    }

    /// Queue the read of `t` (any shape and dtype, read as f32 in row-major order) and return the
    /// tag and values of the tensor pushed before it, if any: on a GPU those are complete once
    /// the work queued before that tensor's push is, so the GPU keeps running what was queued
    /// after it.
    pub fn push(&mut self, tag: T, t: &Tensor) -> Result<Option<(T, Vec<f32>)>> {
        let t = t.flatten_all()?.to_dtype(DType::F32)?.contiguous()?;
        let next = self.start(t)?;
        let previous = self.pending.replace((tag, next));
        previous.map(|(tag, p)| Ok((tag, self.read(p)?))).transpose()
    }

    /// The tag and values of the last tensor pushed (none if nothing is pending).
    pub fn finish(&mut self) -> Result<Option<(T, Vec<f32>)>> {
        self.pending.take().map(|(tag, p)| Ok((tag, self.read(p)?))).transpose()
    }

    fn start(&mut self, t: Tensor) -> Result<Pending> {
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() && t.elem_count() > 0 {
            return self.start_cuda(t);
        }
        Ok(Pending::Ready(t.to_vec1::<f32>()?))
    }

    fn read(&mut self, p: Pending) -> Result<Vec<f32>> {
        match p {
            Pending::Ready(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Pending::Copying { slot, len, .. } => {
                let err = |e| candle_core::Error::Msg(format!("reading a batch back: {e:?}"));
                // waits for this copy, not for the work queued after it
                Ok(self.buffers.read(slot, len).map_err(err)?.to_vec())
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn start_cuda(&mut self, t: Tensor) -> Result<Pending> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        use candle_core::Storage;
        let err = |e| candle_core::Error::Msg(format!("reading a batch back: {e:?}"));
        let len = t.elem_count();
        let slot = {
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(s) = &*storage else { candle_core::bail!("read-back: not a GPU tensor") };
            let Some((o0, o1)) = layout.contiguous_offsets() else { candle_core::bail!("read-back: not contiguous") };
            let stream = s.device().cuda_stream();
            // this buffer's previous copy was read (and waited for) before this push
            let (slot, dst) = self.buffers.take(&stream, len).map_err(err)?;
            let src = s.as_cuda_slice::<f32>()?.slice(o0..o1);
            stream.context().bind_to_thread().map_err(err)?;
            let (src_ptr, _synced) = src.device_ptr(&stream);
            unsafe { candle_core::cuda_backend::cudarc::driver::result::memcpy_dtoh_async(dst, src_ptr, stream.cu_stream()) }.map_err(err)?;
            self.buffers.copied(slot, &stream).map_err(err)?;
            slot
        };
        Ok(Pending::Copying { slot, len, _source: t })
    }
}

/// `v`'s rows (`cells.len() x dim`) into `rows` (`n x dim`) at the rows `cells` name.
pub fn place_rows(rows: &mut [f32], dim: usize, cells: &[usize], v: &[f32]) {
    for (k, &i) in cells.iter().enumerate() {
        rows[i * dim..(i + 1) * dim].copy_from_slice(&v[k * dim..(k + 1) * dim]);
    }
}

/// The cells of `order` through `batch` in chunks of `batch_size` (`batch` queues a chunk's work
/// and returns its `cells x dim` result on the device), each result read back one chunk behind
/// and written into `out` (`n x dim`) at its cells' rows; `progress` hears of each chunk placed.
/// Errors from candle's side of the read-back go through `err`.
#[allow(clippy::too_many_arguments)]
pub fn embed_in_order<E>(
    out: &mut [f32],
    dim: usize,
    order: &[usize],
    batch_size: usize,
    mut batch: impl FnMut(&[usize]) -> std::result::Result<Tensor, E>,
    mut progress: impl FnMut(usize),
    err: impl Fn(candle_core::Error) -> E,
) -> std::result::Result<(), E> {
    let mut lagged = Lagged::new();
    let mut place = |cells: &[usize], v: Vec<f32>| {
        place_rows(out, dim, cells, &v);
        progress(cells.len());
    };
    for chunk in order.chunks(batch_size.max(1)) {
        let t = batch(chunk)?;
        if let Some((done, v)) = lagged.push(chunk, &t).map_err(&err)? {
            place(done, v);
        }
    }
    if let Some((done, v)) = lagged.finish().map_err(&err)? {
        place(done, v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn values_come_back_one_push_late_and_in_order() {
        let mut l = Lagged::new();
        let a = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[5f32, 6.0, 7.0], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        assert_eq!(l.push("a", &a).unwrap(), None);
        assert_eq!(l.push("b", &b).unwrap(), Some(("a", vec![1.0, 2.0, 3.0, 4.0])));
        assert_eq!(l.finish().unwrap(), Some(("b", vec![5.0, 6.0, 7.0])));
        assert_eq!(l.finish().unwrap(), None);
    }

    #[test]
    fn embed_in_order_places_every_chunk_once_at_its_cells() {
        // cells 3, 0 | 2, 1 | 4 in chunks of 2; each cell's row is (cell, cell) times 10
        let mut out = vec![f32::NAN; 5 * 2];
        let mut seen = Vec::new();
        let batch = |cells: &[usize]| Tensor::new(cells.iter().flat_map(|&c| [c as f32 * 10.0; 2]).collect::<Vec<_>>(), &Device::Cpu)?.reshape((cells.len(), 2));
        embed_in_order(&mut out, 2, &[3, 0, 2, 1, 4], 2, batch, |k| seen.push(k), |e| e).unwrap();
        assert_eq!(out, vec![0.0, 0.0, 10.0, 10.0, 20.0, 20.0, 30.0, 30.0, 40.0, 40.0]);
        assert_eq!(seen, vec![2, 2, 1]);
        let mut none = 0;
        embed_in_order(&mut [], 2, &[], 2, |_| Tensor::new(&[0f32], &Device::Cpu), |_| none += 1, |e| e).unwrap();
        assert_eq!(none, 0);
    }
}
