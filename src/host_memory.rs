//! How the process uses host memory, set once at start by each binary's `main`.

/// Keep freed memory in the process instead of handing it back to the kernel: glibc's malloc
/// maps every block above 32 MiB (its adaptive limit) afresh and unmaps it when freed, so a task
/// that allocates a batch's buffers again and again takes a page fault on every 4 KiB of every
/// batch (on an H200 machine, SCimilarity's embed of 200,000 cells spent a third of its time in
/// the kernel this way). Blocks up to 1 GiB come from the heap instead, and the heap is trimmed
/// only past 1 GiB free; the peak resident memory is unchanged (the peak was mapped anyway).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        // M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3 (malloc.h)
        libc::mallopt(-3, 1 << 30);
        libc::mallopt(-1, 1 << 30);
    }
}
