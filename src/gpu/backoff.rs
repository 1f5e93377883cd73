//! Out-of-memory back-off for batched GPU work: when a batch fails with CUDA out-of-memory,
//! halve the batch and retry the same cells, down to one cell; keep the smaller size for the
//! rest of the run, and tell the user which `--batch-size` to pass next time.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::AllocatorKind;

/// What happened, for the user and the cost report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackoffReport {
    /// The batch size asked for.
    pub requested: usize,
    /// The batch size the run finished with.
    pub final_batch: usize,
    /// Batches that failed with out-of-memory and were retried smaller.
    pub retries: u32,
}

impl BackoffReport {
    /// The note printed after the run.
    /// `batch_flag`: whether the method honours `--batch-size` (else its batch is fixed).
    pub fn message(&self, allocator: AllocatorKind, batch_flag: bool) -> String {
        let mut m = format!(
            "CUDA ran out of memory at batch size {}; the batch was halved {} time(s) and the run finished with batch size {}",
            self.requested, self.retries, self.final_batch
        );
        if batch_flag {
            m.push_str(&format!(". Pass --batch-size {} next time to skip the retries", self.final_batch));
        } else {
            m.push_str(". This method's batch is fixed (as upstream's); the retries cost little");
        }
        m.push_str(&extra_hint(allocator));
        m
    }
}

/// The allocator-specific part of the advice.
pub fn extra_hint(allocator: AllocatorKind) -> String {
    match allocator {
        AllocatorKind::Pool => " (the pool is capped by --maximum-pool-size: a larger pool, --allocator managed for data larger than the card, or a smaller dataset also help)".into(),
        AllocatorKind::ManagedPool => " (or raise --maximum-pool-size)".into(),
        _ => String::new(),
    }
}

/// A batch failed for a reason other than memory, or with one cell.
#[derive(Debug)]
pub enum BackoffError<E> {
    /// Out of memory with a batch of one: nothing smaller to try.
    OutOfMemoryAtOne(E),
    Other(E),
}

/// Run `f` over `0..n` in batches of `batch`, in order. `f` gets a row range and returns its
/// result or an error; `is_oom` says whether an error is out-of-memory. Each successful batch's
/// result goes to `done` in order (an error from `done` stops the run as `Other`). Returns the
/// back-off report when any batch was retried.
pub fn run_batched<T, E>(
    n: usize,
    batch: usize,
    is_oom: impl Fn(&E) -> bool,
    mut f: impl FnMut(Range<usize>) -> Result<T, E>,
    mut done: impl FnMut(Range<usize>, T) -> Result<(), E>,
) -> Result<Option<BackoffReport>, BackoffError<E>> {
    let requested = batch.max(1);
    let mut size = requested;
    let mut retries = 0u32;
    let mut start = 0;
    while start < n {
        let end = (start + size).min(n);
        match f(start..end) {
            Ok(t) => {
                done(start..end, t).map_err(BackoffError::Other)?;
                start = end;
            }
            Err(e) if is_oom(&e) => {
                if end - start <= 1 {
                    return Err(BackoffError::OutOfMemoryAtOne(e));
                }
                // halve what was actually tried (the last batch may have been short)
                size = ((end - start) / 2).max(1);
                retries += 1;
            }
            Err(e) => return Err(BackoffError::Other(e)),
        }
    }
    Ok((retries > 0).then_some(BackoffReport { requested, final_batch: size, retries }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake device that fails any batch over `fits` cells.
    fn device(fits: usize) -> impl FnMut(Range<usize>) -> Result<Vec<usize>, String> {
        move |r: Range<usize>| if r.len() > fits { Err(format!("CUDA_ERROR_OUT_OF_MEMORY at {}", r.len())) } else { Ok(r.collect()) }
    }

    fn oom(e: &String) -> bool {
        e.contains("OUT_OF_MEMORY")
    }

    #[test]
    fn halves_until_it_fits_and_keeps_order() {
        let mut seen = Vec::new();
        let mut sizes = Vec::new();
        let rep = run_batched(100, 64, oom, device(20), |r, v| {
            sizes.push(r.len());
            seen.extend(v);
            Ok(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(seen, (0..100).collect::<Vec<_>>(), "every cell once, in order");
        assert_eq!(rep, BackoffReport { requested: 64, final_batch: 16, retries: 2 });
        assert!(sizes.iter().all(|&s| s <= 16), "{sizes:?}");
        let msg = rep.message(AllocatorKind::Pool, true);
        assert!(msg.contains("batch size 64") && msg.contains("--batch-size 16") && msg.contains("managed"), "{msg}");
        assert!(!rep.message(AllocatorKind::Async, true).contains("managed"));
        assert!(!rep.message(AllocatorKind::Async, false).contains("--batch-size"));
    }

    #[test]
    fn no_report_when_everything_fits() {
        let mut n = 0;
        assert_eq!(run_batched(10, 4, oom, device(4), |r, _| {
            n += r.len();
            Ok(())
        }).unwrap(), None);
        assert_eq!(n, 10);
    }

    #[test]
    fn a_short_last_batch_is_halved_from_its_own_size() {
        // 70 cells at 64: the first batch fails (64 > 40), then 32-cell batches fit.
        let mut sizes = Vec::new();
        let rep = run_batched(70, 64, oom, device(40), |r, _| {
            sizes.push(r.len());
            Ok(())
        }).unwrap().unwrap();
        assert_eq!(sizes, [32, 32, 6]);
        assert_eq!(rep.final_batch, 32);
    }

    #[test]
    fn out_of_memory_at_one_cell_is_an_error() {
        let r = run_batched(5, 8, oom, device(0), |_, _| Ok(()));
        assert!(matches!(r, Err(BackoffError::OutOfMemoryAtOne(_))));
    }

    #[test]
    fn other_errors_stop_at_once() {
        let mut calls = 0;
        let r = run_batched(
            100,
            10,
            oom,
            |_| {
                calls += 1;
                Err::<(), _>("weights are corrupt".to_string())
            },
            |_, _| Ok(()),
        );
        assert!(matches!(r, Err(BackoffError::Other(_))));
        assert_eq!(calls, 1);
    }

    #[test]
    fn an_error_from_done_stops_the_run() {
        let mut calls = 0;
        let r = run_batched(100, 10, oom, device(100), |r, _| {
            calls += 1;
            if r.start == 10 { Err("could not read the batch back".to_string()) } else { Ok(()) }
        });
        assert!(matches!(r, Err(BackoffError::Other(e)) if e.contains("read")));
        assert_eq!(calls, 2);
    }
}
