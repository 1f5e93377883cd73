//! Batches for GPU work and their out-of-memory back-off: when a batch fails with CUDA
//! out-of-memory, halve the batch and retry the same cells, down to one cell; keep the smaller
//! size for the rest of the run, and tell the user which `--batch-size` to pass next time.
//! Cells that run longest first can be batched by tokens ([`TokenBudget`]): `--batch-size` cells
//! of the longest length, and more of the shorter ones.

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

/// Most cells a batch by tokens holds, as a multiple of `--batch-size` (docs/gpu.md, "Out of
/// memory", gives the gains measured on the H200).
pub const BATCH_GROWTH: usize = 8;

/// Batches by tokens: `batch` cells of the longest cell's length (`cost(0)`; the cells run
/// longest first) make a batch's token budget, and the batch that starts at cell `start` takes as
/// many cells as fit it at that cell's length, at least one and at most `growth` x `batch`. Every
/// batch then holds about as many tokens as the first, so short cells do not run in small
/// batches whose kernels are too short to fill the GPU, and memory stays at the first batch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBudget {
    /// Tokens a batch may hold.
    pub tokens: usize,
    /// Most cells a batch may hold.
    pub max_cells: usize,
}

impl TokenBudget {
    pub fn new(batch: usize, growth: usize, longest: usize) -> TokenBudget {
        let batch = batch.max(1);
        TokenBudget { tokens: batch * longest.max(1), max_cells: batch * growth.max(1) }
    }

    /// `batch` cells a batch whatever their lengths (give each cell a cost of 1).
    pub fn per_cell(batch: usize) -> TokenBudget {
        TokenBudget::new(batch, 1, 1)
    }

    /// Cells in the batch that starts with a cell of `cost` tokens.
    pub fn batch_at(&self, cost: usize) -> usize {
        (self.tokens / cost.max(1)).clamp(1, self.max_cells)
    }

    /// The batches of `n` cells (in run order, `cost(i)` tokens each) when nothing runs out of
    /// memory.
    pub fn plan(&self, n: usize, cost: impl Fn(usize) -> usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        while start < n {
            let end = (start + self.batch_at(cost(start))).min(n);
            out.push(start..end);
            start = end;
        }
        out
    }
}

/// A batch failed for a reason other than memory, or with one cell.
#[derive(Debug)]
pub enum BackoffError<E> {
    /// Out of memory with a batch of one: nothing smaller to try.
    OutOfMemoryAtOne(E),
    Other(E),
}

/// Run `f` over `0..n` in batches of `budget` (with `TokenBudget::per_cell(b)` and a cost of 1
/// a cell, batches of `b`; else cell `i` costs `cost(i)` tokens), in order. `f` gets a row range
/// and returns its result or an error; `is_oom` says whether an error is out-of-memory: the
/// budget is then halved (to half the cells that failed, at their length) and the same cells
/// retried. Each successful batch's result goes to `done` in order (an error from `done` stops
/// the run as `Other`). Returns the back-off report when any batch was retried; its batch sizes
/// count cells of the first cell's length.
pub fn run_batched<T, E>(
    n: usize,
    budget: TokenBudget,
    cost: impl Fn(usize) -> usize,
    is_oom: impl Fn(&E) -> bool,
    mut f: impl FnMut(Range<usize>) -> Result<T, E>,
    mut done: impl FnMut(Range<usize>, T) -> Result<(), E>,
) -> Result<Option<BackoffReport>, BackoffError<E>> {
    let in_cells = |b: &TokenBudget| if n == 0 { b.tokens } else { (b.tokens / cost(0).max(1)).max(1) };
    let requested = in_cells(&budget);
    let mut budget = budget;
    let mut retries = 0u32;
    let mut start = 0;
    while start < n {
        let end = (start + budget.batch_at(cost(start))).min(n);
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
                budget.tokens = ((end - start) / 2).max(1) * cost(start).max(1);
                retries += 1;
            }
            Err(e) => return Err(BackoffError::Other(e)),
        }
    }
    Ok((retries > 0).then_some(BackoffReport { requested, final_batch: in_cells(&budget), retries }))
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
        let rep = run_batched(100, TokenBudget::per_cell(64), |_| 1, oom, device(20), |r, v| {
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
        assert_eq!(run_batched(10, TokenBudget::per_cell(4), |_| 1, oom, device(4), |r, _| {
            n += r.len();
            Ok(())
        }).unwrap(), None);
        assert_eq!(n, 10);
    }

    #[test]
    fn a_short_last_batch_is_halved_from_its_own_size() {
        // 70 cells at 64: the first batch fails (64 > 40), then 32-cell batches fit.
        let mut sizes = Vec::new();
        let rep = run_batched(70, TokenBudget::per_cell(64), |_| 1, oom, device(40), |r, _| {
            sizes.push(r.len());
            Ok(())
        }).unwrap().unwrap();
        assert_eq!(sizes, [32, 32, 6]);
        assert_eq!(rep.final_batch, 32);
    }

    #[test]
    fn by_tokens_the_back_off_halves_the_budget_at_the_failing_cells_length() {
        // longest first; the fake device holds 100 tokens
        let costs: Vec<usize> = [100, 100, 50, 50, 50, 50].into_iter().chain([10; 20]).collect();
        let fits = |r: Range<usize>| -> Result<usize, String> {
            let t: usize = costs[r].iter().sum();
            if t > 100 { Err(format!("CUDA_ERROR_OUT_OF_MEMORY at {t} tokens")) } else { Ok(t) }
        };
        let mut batches = Vec::new();
        let rep = run_batched(costs.len(), TokenBudget::new(2, 8, costs[0]), |i| costs[i], oom, fits, |r, t| {
            batches.push((r, t));
            Ok(())
        })
        .unwrap()
        .unwrap();
        let ranges: Vec<_> = batches.iter().map(|b| b.0.clone()).collect();
        assert_eq!(ranges, [0..1, 1..2, 2..4, 4..6, 6..16, 16..26], "{batches:?}");
        assert!(batches.iter().all(|b| b.1 == 100));
        // in cells of the longest length: 2 asked, 1 in the end
        assert_eq!(rep, BackoffReport { requested: 2, final_batch: 1, retries: 1 });
    }

    #[test]
    fn out_of_memory_at_one_cell_is_an_error() {
        let r = run_batched(5, TokenBudget::per_cell(8), |_| 1, oom, device(0), |_, _| Ok(()));
        assert!(matches!(r, Err(BackoffError::OutOfMemoryAtOne(_))));
    }

    #[test]
    fn token_budget_grows_batches_of_short_cells_up_to_the_cap() {
        // longest first: 2,000, 1,000, 500 and 100 tokens
        let costs = [2000, 2000, 1000, 1000, 1000, 1000, 500, 500, 500, 500, 500, 500, 500, 500, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100];
        let b = TokenBudget::new(2, 4, costs[0]);
        assert_eq!(b.tokens, 4000);
        let plan = b.plan(costs.len(), |i| costs[i]);
        assert_eq!(plan, [0..2, 2..6, 6..14, 14..22, 22..24], "{plan:?}");
        for r in &plan {
            let tokens: usize = costs[r.clone()].iter().sum();
            assert!(tokens <= 4000, "{r:?} holds {tokens} tokens");
        }
        // a cell longer than the budget still runs, alone
        assert_eq!(TokenBudget::new(1, 4, 10).batch_at(50), 1);
        // equal lengths: batches of `batch` cells, as before
        assert_eq!(TokenBudget::new(3, 8, 7).plan(8, |_| 7), [0..3, 3..6, 6..8]);
    }

    #[test]
    fn other_errors_stop_at_once() {
        let mut calls = 0;
        let r = run_batched(
            100,
            TokenBudget::per_cell(10),
            |_| 1,
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
        let r = run_batched(100, TokenBudget::per_cell(10), |_| 1, oom, device(100), |r, _| {
            calls += 1;
            if r.start == 10 { Err("could not read the batch back".to_string()) } else { Ok(()) }
        });
        assert!(matches!(r, Err(BackoffError::Other(e)) if e.contains("read")));
        assert_eq!(calls, 2);
    }
}
