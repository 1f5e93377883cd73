//! Page-locked host buffers used in turn (a ring of N) for copies queued on one CUDA stream:
//! what `upload.rs` (host to device, N = 8) and `readback.rs` (device to host, N = 2) both stand on.
//!
//! A copy between the GPU and page-locked memory is queued on the stream and the host goes on;
//! with several buffers the host fills (or reads) one while the copies from (or into) the others
//! run. A buffer is handed out again once the copy last queued with it is done: with N buffers
//! that is the copy N takes before, so N must cover the copies of a batch and more (a batch
//! uploads 2-4 times) or the host waits for the batch before it.
//! Each buffer grows to the power of two at or above the largest copy asked of it (growing is a
//! page-locked allocation and a free, which waits for the whole device: grown to each new largest
//! size exactly, batches a few tokens longer than the last regrew buffers again and again; on the
//! H200 the embedding's part of a 72-76 ms Geneformer V1 pass took 22-24 ms of host time before,
//! 15.5-16.2 after, the warm-up batch's share included) and a copy uses its first
//! `len` values:
//! cudarc's own copies take the host slice's whole length, which reads or writes past a smaller
//! batch (CUDA_ERROR_INVALID_VALUE on a run's last, short batch), so the copies go through
//! cudarc's result-level calls on a prefix. Each buffer carries the event recorded right after
//! its last copy: a `PinnedHostSlice`'s own event is recorded by cudarc only when it manages
//! several streams (candle runs one), so waiting on that would not cover our copies.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaStream, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits};

struct Slot<T> {
    buf: PinnedHostSlice<T>,
    // recorded right after the last copy from or into `buf`
    copied: Option<CudaEvent>,
}

/// The ring (see the module's comment). `take` hands out the next buffer once its last copy is
/// done; `copied` records the copy just queued with it; `read` waits for that copy.
pub struct PinnedRing<T, const N: usize> {
    slots: [Option<Slot<T>>; N],
    next: usize,
}

/// Two buffers in turn (the read-back's: one batch's results in flight while the other's are read).
pub type PinnedPair<T> = PinnedRing<T, 2>;

impl<T, const N: usize> Default for PinnedRing<T, N> {
    fn default() -> PinnedRing<T, N> {
        PinnedRing { slots: std::array::from_fn(|_| None), next: 0 }
    }
}

impl<T, const N: usize> PinnedRing<T, N> {
    /// Wait for the copies last queued with every buffer (before they are dropped or the ring
    /// moves to another stream).
    pub fn wait_all(&self) -> Result<(), DriverError> {
        (0..N).try_for_each(|i| self.wait(i))
    }

    fn wait(&self, i: usize) -> Result<(), DriverError> {
        match self.slots[i].as_ref().and_then(|s| s.copied.as_ref()) {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }
}

impl<T, const N: usize> Drop for PinnedRing<T, N> {
    /// A buffer is not freed under a copy still queued with it (cudarc's own drop waits on the
    /// buffer's event, which is never recorded here).
    fn drop(&mut self) {
        let _ = self.wait_all();
    }
}

impl<T: DeviceRepr + ValidAsZeroBits, const N: usize> PinnedRing<T, N> {
    /// The next buffer's slot and its first `len` values, to fill before an upload or to copy
    /// into: waits for the copy last queued with it, grows it (page-locked, not write-combined:
    /// the host reads and writes it) to `len`'s power of two when it is shorter than `len`.
    pub fn take(&mut self, stream: &CudaStream, len: usize) -> Result<(usize, &mut [T]), DriverError> {
        let i = self.next;
        self.next = (i + 1) % N;
        self.wait(i)?;
        if self.slots[i].as_ref().is_none_or(|s| s.buf.len() < len) {
            self.slots[i] = None;
            let buf = unsafe { stream.context().alloc_pinned_with_flags::<T>(len.next_power_of_two(), 0) }?;
            self.slots[i] = Some(Slot { buf, copied: None });
        }
        let slot = self.slots[i].as_mut().expect("allocated above");
        // (`as_mut_slice` waits on the buffer's own event, which is never recorded here: `wait`
        // above is what covers the last copy)
        Ok((i, &mut slot.buf.as_mut_slice()?[..len]))
    }

    /// Record, on `stream`, that the copy with slot `i`'s buffer has been queued.
    pub fn copied(&mut self, i: usize, stream: &CudaStream) -> Result<(), DriverError> {
        let event = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        if let Some(s) = self.slots[i].as_mut() {
            s.copied = Some(event);
        }
        Ok(())
    }

    /// The first `len` values of slot `i`'s buffer once its last copy is done (waits for that
    /// copy only, not for the work queued after it).
    pub fn read(&self, i: usize, len: usize) -> Result<&[T], DriverError> {
        self.wait(i)?;
        let slot = self.slots[i].as_ref().expect("read of a slot never taken");
        Ok(&slot.buf.as_slice()?[..len])
    }

}
