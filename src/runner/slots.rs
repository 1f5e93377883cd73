//! GPU slots: one task per GPU at a time across all runs of a workspace.
//!
//! Each device has a lock file `<workspace>/.locks/gpu<N>.lock`; the runner holds an exclusive
//! `flock` on it while a task pinned to that GPU runs. Locks belong to the open file, so they
//! are released when the runner exits, however it exits, and another run's runner waiting for
//! the same GPU goes on. The task process does not inherit the descriptor (close-on-exec).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A held GPU slot; dropping it releases the GPU.
#[derive(Debug)]
pub struct GpuSlot {
    pub device: u32,
    pub path: PathBuf,
    _file: File,
}

pub fn lock_path(locks_dir: &Path, device: u32) -> PathBuf {
    locks_dir.join(format!("gpu{device}.lock"))
}

fn open(locks_dir: &Path, device: u32) -> Result<(File, PathBuf)> {
    std::fs::create_dir_all(locks_dir).map_err(|e| Error::Io { path: locks_dir.into(), source: e })?;
    let path = lock_path(locks_dir, device);
    let f = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    Ok((f, path))
}

fn flock(f: &File, op: i32) -> std::io::Result<bool> {
    loop {
        let rc = unsafe { libc::flock(f.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Take the slot for `device` if it is free now.
pub fn try_acquire(locks_dir: &Path, device: u32) -> Result<Option<GpuSlot>> {
    let (f, path) = open(locks_dir, device)?;
    if flock(&f, libc::LOCK_EX | libc::LOCK_NB).map_err(|e| Error::Io { path: path.clone(), source: e })? {
        Ok(Some(GpuSlot { device, path, _file: f }))
    } else {
        Ok(None)
    }
}

/// Take the slot for `device`, waiting while another task holds it; `on_wait` is called once
/// before waiting.
pub fn acquire(locks_dir: &Path, device: u32, on_wait: impl FnOnce()) -> Result<GpuSlot> {
    if let Some(s) = try_acquire(locks_dir, device)? {
        return Ok(s);
    }
    on_wait();
    let (f, path) = open(locks_dir, device)?;
    flock(&f, libc::LOCK_EX).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    Ok(GpuSlot { device, path, _file: f })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_waits_until_the_first_releases() {
        let dir = tempfile::tempdir().unwrap();
        let a = try_acquire(dir.path(), 1).unwrap().expect("free slot");
        assert!(try_acquire(dir.path(), 1).unwrap().is_none(), "the same GPU is busy");
        assert!(try_acquire(dir.path(), 0).unwrap().is_some(), "another GPU is free");
        let d = dir.path().to_path_buf();
        let waited = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let w2 = waited.clone();
        let t = std::thread::spawn(move || {
            let s = acquire(&d, 1, || w2.store(true, std::sync::atomic::Ordering::SeqCst)).unwrap();
            s.device
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!t.is_finished(), "the second task waits");
        drop(a);
        assert_eq!(t.join().unwrap(), 1);
        assert!(waited.load(std::sync::atomic::Ordering::SeqCst));
    }
}
