//! The adaptors every resource is wrapped in, after RMM's: statistics (current and peak bytes,
//! allocation counts), a limit, and an optional CSV log. Pure bookkeeping on pointers and sizes,
//! so it is tested without a GPU; `cuda.rs` calls it around each driver call.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Counters of a resource, as the cost report records them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Bytes live now.
    pub current_bytes: u64,
    /// Most bytes live at once.
    pub peak_bytes: u64,
    /// Allocations made (successful).
    pub allocations: u64,
    /// Allocations freed.
    pub frees: u64,
    /// Allocations refused: by the limit or by the device (out of memory).
    pub failed: u64,
    /// Most allocations live at once.
    pub peak_live: u64,
    /// Nanoseconds spent inside the upstream allocation calls (successful or not).
    #[serde(default)]
    pub alloc_ns: u64,
    /// Nanoseconds spent inside the upstream free calls.
    #[serde(default)]
    pub free_ns: u64,
}

impl MemoryStats {
    /// Milliseconds spent allocating and freeing.
    pub fn alloc_ms(&self) -> f64 {
        (self.alloc_ns + self.free_ns) as f64 / 1e6
    }
}

/// Why an allocation was refused by the accounting itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverLimit {
    pub requested: u64,
    pub current: u64,
    pub limit: u64,
}

#[derive(Default)]
struct State {
    live: HashMap<u64, u64>,
    stats: MemoryStats,
    /// Bytes promised to allocations in flight (counted against the limit).
    reserved: u64,
}

/// Statistics + limit + log for one resource. Thread-safe.
pub struct Accounting {
    state: Mutex<State>,
    limit: Option<u64>,
    log: Option<Mutex<BufWriter<File>>>,
    log_path: Option<PathBuf>,
    started: Instant,
}

impl Accounting {
    /// `log`: a CSV file to create (header: time_us,action,pointer,bytes,stream,current_bytes).
    pub fn new(limit: Option<u64>, log: Option<&Path>) -> std::io::Result<Accounting> {
        let log_file = match log {
            Some(p) => {
                let mut w = BufWriter::new(File::create(p)?);
                writeln!(w, "time_us,action,pointer,bytes,stream,current_bytes")?;
                Some(Mutex::new(w))
            }
            None => None,
        };
        Ok(Accounting { state: Mutex::new(State::default()), limit, log: log_file, log_path: log.map(Path::to_path_buf), started: Instant::now() })
    }

    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    pub fn log_path(&self) -> Option<&Path> {
        self.log_path.as_deref()
    }

    /// Allocate `bytes` with `upstream` under the limit: the bytes are counted before the call
    /// (so concurrent callers cannot pass the limit together) and recorded with the pointer
    /// after it. A refusal by the limit never calls `upstream`.
    pub fn allocate<E>(&self, bytes: u64, stream: u64, upstream: impl FnOnce() -> Result<u64, E>) -> Result<u64, AllocFailure<E>> {
        {
            let mut s = self.state.lock().unwrap();
            let committed = s.stats.current_bytes + s.reserved;
            if let Some(limit) = self.limit {
                if committed.saturating_add(bytes) > limit {
                    s.stats.failed += 1;
                    drop(s);
                    self.write_log("refuse", 0, bytes, stream);
                    return Err(AllocFailure::OverLimit(OverLimit { requested: bytes, current: committed, limit }));
                }
            }
            s.reserved += bytes;
        }
        let t0 = Instant::now();
        let got = upstream();
        let spent = t0.elapsed().as_nanos() as u64;
        let mut s = self.state.lock().unwrap();
        s.stats.alloc_ns += spent;
        s.reserved -= bytes;
        match got {
            Ok(ptr) => {
                s.stats.current_bytes += bytes;
                s.stats.peak_bytes = s.stats.peak_bytes.max(s.stats.current_bytes);
                s.stats.allocations += 1;
                if let Some(old) = s.live.insert(ptr, bytes) {
                    // the upstream handed out a pointer we think is live: keep the books straight
                    s.stats.current_bytes -= old;
                }
                s.stats.peak_live = s.stats.peak_live.max(s.live.len() as u64);
                drop(s);
                self.write_log("allocate", ptr, bytes, stream);
                Ok(ptr)
            }
            Err(e) => {
                s.stats.failed += 1;
                drop(s);
                self.write_log("fail", 0, bytes, stream);
                Err(AllocFailure::Upstream(e))
            }
        }
    }

    /// Forget a pointer being freed; its size, or `None` when it is not ours.
    pub fn release(&self, ptr: u64, stream: u64) -> Option<u64> {
        let mut s = self.state.lock().unwrap();
        let bytes = s.live.remove(&ptr)?;
        s.stats.current_bytes -= bytes;
        s.stats.frees += 1;
        drop(s);
        self.write_log("free", ptr, bytes, stream);
        Some(bytes)
    }

    /// Free `ptr` with `upstream` (given its size) if it is ours, timing the upstream call:
    /// `Ok(None)` without calling it when the pointer is not ours.
    pub fn free<E>(&self, ptr: u64, stream: u64, upstream: impl FnOnce(u64) -> Result<(), E>) -> Result<Option<u64>, E> {
        let Some(bytes) = self.release(ptr, stream) else { return Ok(None) };
        let t0 = Instant::now();
        let got = upstream(bytes);
        let spent = t0.elapsed().as_nanos() as u64;
        self.state.lock().unwrap().stats.free_ns += spent;
        got.map(|()| Some(bytes))
    }

    /// Whether a pointer is live here.
    pub fn owns(&self, ptr: u64) -> bool {
        self.state.lock().unwrap().live.contains_key(&ptr)
    }

    pub fn stats(&self) -> MemoryStats {
        self.state.lock().unwrap().stats
    }

    /// Start a new peak from the current level (per batch, per phase).
    pub fn reset_peak(&self) {
        let mut s = self.state.lock().unwrap();
        s.stats.peak_bytes = s.stats.current_bytes;
        s.stats.peak_live = s.live.len() as u64;
    }

    pub fn flush_log(&self) -> std::io::Result<()> {
        if let Some(l) = &self.log {
            l.lock().unwrap().flush()?;
        }
        Ok(())
    }

    fn write_log(&self, action: &str, ptr: u64, bytes: u64, stream: u64) {
        if let Some(l) = &self.log {
            let current = self.state.lock().unwrap().stats.current_bytes;
            let t = self.started.elapsed().as_micros();
            let _ = writeln!(l.lock().unwrap(), "{t},{action},0x{ptr:x},{bytes},0x{stream:x},{current}");
        }
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        let _ = self.flush_log();
    }
}

/// An allocation refused by the limit or failed upstream.
#[derive(Debug)]
pub enum AllocFailure<E> {
    OverLimit(OverLimit),
    Upstream(E),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A fake upstream handing out increasing addresses.
    fn bump(next: &AtomicU64, bytes: u64) -> Result<u64, &'static str> {
        Ok(next.fetch_add(bytes.max(1).next_multiple_of(256), Ordering::Relaxed))
    }

    #[test]
    fn counts_current_peak_and_frees() {
        let a = Accounting::new(None, None).unwrap();
        let next = AtomicU64::new(0x1000);
        let p1 = a.allocate(100, 0, || bump(&next, 100)).unwrap();
        let p2 = a.allocate(300, 0, || bump(&next, 300)).unwrap();
        assert_eq!(a.stats().current_bytes, 400);
        assert_eq!(a.release(p1, 0), Some(100));
        let _p3 = a.allocate(50, 0, || bump(&next, 50)).unwrap();
        let s = a.stats();
        assert_eq!((s.current_bytes, s.peak_bytes, s.allocations, s.frees, s.peak_live), (350, 400, 3, 1, 2));
        assert_eq!(a.release(p1, 0), None, "a double free is not counted twice");
        assert_eq!(a.release(0xdead, 0), None, "foreign pointers are not ours");
        assert!(a.owns(p2));
        a.reset_peak();
        assert_eq!(a.stats().peak_bytes, 350);
    }

    #[test]
    fn the_limit_refuses_without_calling_upstream() {
        let a = Accounting::new(Some(1000), None).unwrap();
        let next = AtomicU64::new(0x1000);
        let p = a.allocate(600, 0, || bump(&next, 600)).unwrap();
        let called = std::cell::Cell::new(false);
        let e = a
            .allocate(500, 0, || {
                called.set(true);
                bump(&next, 500)
            })
            .unwrap_err();
        assert!(!called.get());
        match e {
            AllocFailure::OverLimit(o) => assert_eq!(o, OverLimit { requested: 500, current: 600, limit: 1000 }),
            _ => panic!("expected the limit"),
        }
        assert_eq!(a.stats().failed, 1);
        a.release(p, 0);
        assert!(a.allocate(1000, 0, || bump(&next, 1000)).is_ok(), "exactly the limit fits");
    }

    #[test]
    fn upstream_failures_are_counted_and_release_the_reservation() {
        let a = Accounting::new(Some(1000), None).unwrap();
        let e = a.allocate(800, 0, || Err::<u64, _>("out of memory")).unwrap_err();
        assert!(matches!(e, AllocFailure::Upstream("out of memory")));
        let next = AtomicU64::new(0x1000);
        assert!(a.allocate(800, 0, || bump(&next, 800)).is_ok(), "the failed attempt's bytes were given back");
        let s = a.stats();
        assert_eq!((s.failed, s.allocations, s.current_bytes), (1, 1, 800));
    }

    #[test]
    fn concurrent_callers_never_pass_the_limit() {
        let a = Arc::new(Accounting::new(Some(4_000), None).unwrap());
        let next = Arc::new(AtomicU64::new(0x10_0000));
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (a, next) = (a.clone(), next.clone());
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..2000u64 {
                        let bytes = 100 + (i * 37 + t * 11) % 900;
                        if let Ok(p) = a.allocate(bytes, t, || bump(&next, bytes)) {
                            mine.push(p);
                        }
                        if mine.len() > 8 || (i % 7 == 0 && !mine.is_empty()) {
                            if let Some(p) = mine.pop() {
                                a.release(p, t);
                            }
                        }
                    }
                    for p in mine {
                        a.release(p, t);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let s = a.stats();
        assert_eq!(s.current_bytes, 0);
        assert_eq!(s.allocations, s.frees);
        assert!(s.peak_bytes <= 4_000, "peak {} over the limit", s.peak_bytes);
        assert!(s.peak_bytes > 3_000, "the test did not press the limit (peak {})", s.peak_bytes);
    }

    #[test]
    fn time_inside_the_upstream_calls_is_summed() {
        let a = Accounting::new(Some(1000), None).unwrap();
        let next = AtomicU64::new(0x1000);
        let nap = std::time::Duration::from_millis(3);
        let slow = |bytes| {
            std::thread::sleep(nap);
            bump(&next, bytes)
        };
        let p = a.allocate(100, 0, || slow(100)).unwrap();
        let _ = a.allocate(100, 0, || slow(100)).unwrap();
        let after_two = a.stats().alloc_ns;
        assert!(after_two >= 2 * nap.as_nanos() as u64, "two 3 ms allocations counted {after_two} ns");
        assert!(a.allocate(5000, 0, || slow(5000)).is_err());
        assert_eq!(a.stats().alloc_ns, after_two, "a refusal by the limit never calls upstream, so costs nothing");
        assert_eq!(a.stats().free_ns, 0);
        let freed = a.free(p, 0, |bytes| {
            assert_eq!(bytes, 100);
            std::thread::sleep(nap);
            Ok::<(), &str>(())
        });
        assert_eq!(freed, Ok(Some(100)));
        let called = std::cell::Cell::new(false);
        let foreign = a.free(0xdead, 0, |_| {
            called.set(true);
            Ok::<(), &str>(())
        });
        assert_eq!(foreign, Ok(None));
        assert!(!called.get(), "a pointer that is not ours is not freed upstream");
        let s = a.stats();
        assert!(s.free_ns >= nap.as_nanos() as u64, "the free counted {} ns", s.free_ns);
        assert_eq!((s.frees, s.current_bytes), (1, 100));
        assert!((s.alloc_ms() - (s.alloc_ns + s.free_ns) as f64 / 1e6).abs() < 1e-9);
        assert!(s.alloc_ms() >= 9.0, "{} ms", s.alloc_ms());
    }

    #[test]
    fn the_log_has_one_row_per_event() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alloc.csv");
        let a = Accounting::new(Some(1000), Some(&path)).unwrap();
        let next = AtomicU64::new(0x1000);
        let p = a.allocate(512, 7, || bump(&next, 512)).unwrap();
        let _ = a.allocate(900, 7, || bump(&next, 900));
        a.release(p, 7);
        a.flush_log().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
        assert_eq!(rows[0], ["time_us", "action", "pointer", "bytes", "stream", "current_bytes"]);
        let actions: Vec<(&str, &str, &str)> = rows[1..].iter().map(|r| (r[1], r[3], r[5])).collect();
        assert_eq!(actions, [("allocate", "512", "512"), ("refuse", "900", "512"), ("free", "512", "0")]);
        assert_eq!(rows[1][2], "0x1000");
        assert_eq!(rows[1][4], "0x7");
    }
}
