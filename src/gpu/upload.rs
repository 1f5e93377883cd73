//! Host-to-device uploads through page-locked memory, so that queueing a batch does not wait for
//! the GPU. A copy from ordinary (pageable) host memory goes through the driver's own staging
//! buffers, and the driver may wait for the stream's earlier work before it takes the values
//! (CUDA's "API synchronization behavior"): the host, uploading batch i + 1's token ids, would
//! then wait for batch i to finish, and the GPU would sit idle while the host queues the rest of
//! batch i + 1. Here the values are copied into one of eight page-locked buffers (`pinned.rs`,
//! each reused once the copy made from it eight uploads before is done; a batch makes 2-4: its
//! ids, its cells' offsets for the encoder, the rows to read out) and from there on the stream.
//! u32 values and f32 values (SCimilarity's sparse counts) each have their ring.

use candle_core::{Device, Result, Tensor};

/// `data` as a 1-D u32 tensor on `device` (on a GPU, queued on its stream from page-locked
/// memory: the host does not wait for the GPU).
pub fn upload_u32(data: &[u32], device: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        if !data.is_empty() {
            return cuda::upload(data, dev);
        }
    }
    Tensor::new(data, device)
}

/// [`upload_u32`] for f32 values (a batch's sparse counts): its own ring of page-locked buffers.
pub fn upload_f32(data: &[f32], device: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        if !data.is_empty() {
            return cuda::upload(data, dev);
        }
    }
    Tensor::new(data, device)
}

#[cfg(feature = "cuda")]
pub(crate) use cuda::{upload_parts, upload_slice};

#[cfg(feature = "cuda")]
mod cuda {
    use super::super::pinned::PinnedRing;
    use candle_core::cuda_backend::cudarc::driver::{result, CudaSlice, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaDevice, CudaStorage, Result, Tensor};
    use std::cell::RefCell;
    use std::thread::LocalKey;

    /// The page-locked buffers for one stream (a thread's uploads of one type go to one).
    pub struct Ring<T> {
        stream: usize,
        buffers: PinnedRing<T, 8>,
    }

    impl<T> Default for Ring<T> {
        fn default() -> Ring<T> {
            Ring { stream: 0, buffers: PinnedRing::default() }
        }
    }

    thread_local! {
        static RING_U32: RefCell<Ring<u32>> = RefCell::new(Ring::default());
        static RING_F32: RefCell<Ring<f32>> = RefCell::new(Ring::default());
    }

    /// The values a thread uploads, each type with its ring.
    pub trait Staged: DeviceRepr + ValidAsZeroBits + CudaDType + Copy + Send + Sync + 'static {
        fn ring() -> &'static LocalKey<RefCell<Ring<Self>>>;
    }
    impl Staged for u32 {
        fn ring() -> &'static LocalKey<RefCell<Ring<u32>>> {
            &RING_U32
        }
    }
    impl Staged for f32 {
        fn ring() -> &'static LocalKey<RefCell<Ring<f32>>> {
            &RING_F32
        }
    }

    pub fn upload<T: Staged>(data: &[T], dev: &CudaDevice) -> Result<Tensor> {
        let dst = upload_slice(data, dev)?;
        let n = dst.len();
        Ok(crate::gpu::kernel_io::output(CudaStorage::wrap_cuda_slice(dst, dev.clone()), n))
    }

    /// `data` on the device's stream as a raw slice (for kernels that take their indices
    /// inside a custom op), through page-locked memory.
    pub fn upload_slice<T: Staged>(data: &[T], dev: &CudaDevice) -> Result<CudaSlice<T>> {
        upload_parts(&[data], dev)
    }

    /// `parts` one after another on the device's stream as one raw slice, copied into the
    /// page-locked buffer on all cores (a batch built a chunk per core is never joined on the
    /// host: joining and staging it on one core took longer than its copy to the GPU).
    pub fn upload_parts<T: Staged>(parts: &[&[T]], dev: &CudaDevice) -> Result<CudaSlice<T>> {
        use rayon::prelude::*;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len == 0 {
            return dev.clone_htod(&[] as &[T]);
        }
        let err = |e| candle_core::Error::Msg(format!("uploading a batch to the GPU: {e:?}"));
        let stream = dev.cuda_stream();
        T::ring().with_borrow_mut(|ring| -> Result<_> {
            let key = stream.cu_stream() as usize;
            if ring.stream != key {
                // another stream (another device): its buffers go once their copies are done
                ring.buffers.wait_all().map_err(err)?;
                *ring = Ring { stream: key, ..Ring::default() };
            }
            // the copy made from this buffer eight uploads ago is done before it is handed out
            let (slot, src) = ring.buffers.take(&stream, len).map_err(err)?;
            {
                let mut pieces: Vec<(&mut [T], &[T])> = Vec::new();
                let mut rest = &mut *src;
                // pieces of at most 64 Ki values, so that one long part is copied on all cores too
                for p in parts.iter().flat_map(|p| p.chunks(1 << 16)) {
                    let (head, tail) = rest.split_at_mut(p.len());
                    pieces.push((head, p));
                    rest = tail;
                }
                if len >= 1 << 16 {
                    pieces.into_par_iter().for_each(|(d, p)| d.copy_from_slice(p));
                } else {
                    pieces.into_iter().for_each(|(d, p)| d.copy_from_slice(p));
                }
            }
            let mut dst = unsafe { stream.alloc::<T>(len) }.map_err(err)?;
            {
                let (ptr, _synced) = dst.device_ptr_mut(&stream);
                unsafe { result::memcpy_htod_async(ptr, &*src, stream.cu_stream()) }.map_err(err)?;
            }
            ring.buffers.copied(slot, &stream).map_err(err)?;
            Ok(dst)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_the_values_on_the_cpu_too() {
        let t = upload_u32(&[3, 1, 4, 1, 5], &Device::Cpu).unwrap();
        assert_eq!(t.to_vec1::<u32>().unwrap(), vec![3, 1, 4, 1, 5]);
        assert_eq!(upload_u32(&[], &Device::Cpu).unwrap().elem_count(), 0);
        assert_eq!(upload_f32(&[0.5, -2.0], &Device::Cpu).unwrap().to_vec1::<f32>().unwrap(), vec![0.5, -2.0]);
    }
}
