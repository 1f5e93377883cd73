//! The row-block pipeline of the transformer `embed` tasks: while the device runs block k, a
//! producer thread reads block k + 1 (HDF5 read and decompression) and tokenises its cells on
//! all cores, at most [`DEFAULT_AHEAD`] blocks ahead of the device so that memory stays
//! bounded; the device's results are written in input order on the calling thread. Each stage's
//! seconds are summed ([`StageClock`]) into the task's phases: with the stages overlapped their
//! sum exceeds the wall time.
//!
//! The producer and the consumer see the same blocks in the same order as a loop that reads,
//! tokenises, runs and writes one block at a time, so the output, the notes and the counters
//! are the same; only the time they take differs.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use crate::env::EnvVars;
use crate::error::{Error, Result};

/// Blocks produced ahead of the block on the device, unless `$SCFOUNDRY_BLOCKS_AHEAD` says
/// otherwise (0: each block read, tokenised, run and written before the next is read).
pub const DEFAULT_AHEAD: usize = 2;

/// The stages of a block, in the order a block goes through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Reading the block's rows from the file (decompression included).
    Read,
    /// Ranking, binning or sampling each cell's genes into its tokens.
    Tokenise,
    /// Packing batches, running them and reading their rows back.
    Device,
    /// Writing the block's rows to the output.
    Write,
}

impl Stage {
    const ALL: [Stage; 4] = [Stage::Read, Stage::Tokenise, Stage::Device, Stage::Write];

    fn name(self) -> &'static str {
        match self {
            Stage::Read => "read",
            Stage::Tokenise => "tokenise",
            Stage::Device => "device",
            Stage::Write => "write",
        }
    }
}

/// Seconds spent in each [`Stage`], summed over blocks and threads, and the wall time since
/// the clock started.
pub struct StageClock {
    nanos: [AtomicU64; 4],
    started: Instant,
}

impl Default for StageClock {
    fn default() -> StageClock {
        StageClock::new()
    }
}

impl StageClock {
    pub fn new() -> StageClock {
        StageClock { nanos: Default::default(), started: Instant::now() }
    }

    /// `f`, its time added to `stage`.
    pub fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.nanos[stage as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Seconds since the clock started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    pub fn seconds(&self, stage: Stage) -> f64 {
        self.nanos[stage as usize].load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// The task's phases: `setup` (what ran before the first block: opening the data, loading
    /// the model, creating the output), each stage, `blocks wall` (the first block's read to
    /// the last block's write), and the wall time of the whole task so far.
    pub fn phases(&self, setup: f64, blocks_wall: f64) -> Vec<(String, f64)> {
        let mut out = vec![("setup".to_string(), setup)];
        out.extend(Stage::ALL.iter().map(|&s| (s.name().to_string(), self.seconds(s))));
        out.push(("blocks wall".into(), blocks_wall));
        out.push(("wall".into(), self.started.elapsed().as_secs_f64()));
        out
    }
}

/// A producer's usual work: read rows `block.0..block.1` of `x` ([`Stage::Read`]) and map each
/// row, given its row number in the file and its (genes, values), on all of the pool's threads
/// in chunks of at least `min_len` rows ([`Stage::Tokenise`]); the results in row order.
pub fn read_and_map<T: Send>(clock: &StageClock, x: &crate::anndata::Matrix, block: (usize, usize), min_len: usize, f: impl Fn(usize, &[u32], &[f32]) -> T + Sync) -> Result<Vec<T>> {
    use rayon::prelude::*;
    let (s, e) = block;
    let b = clock.time(Stage::Read, || x.read_rows(s, e))?;
    Ok(clock.time(Stage::Tokenise, || {
        (0..b.n_rows())
            .into_par_iter()
            .with_min_len(min_len)
            .map(|i| {
                let (idx, vals) = b.row(i);
                f(s + i, idx, vals)
            })
            .collect()
    }))
}

/// How far the producer may run ahead and how many threads tokenise.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Blocks produced and not yet on the device; 0 runs the stages one after another.
    pub ahead: usize,
    /// Threads of the tokenising pool.
    pub workers: usize,
}

impl Plan {
    /// `$SCFOUNDRY_BLOCKS_AHEAD` blocks ahead (default [`DEFAULT_AHEAD`]) and
    /// `$RAYON_NUM_THREADS` workers, or one fewer than the available cores (one is left to the
    /// thread that drives the device), at least one.
    pub fn from_env() -> Plan {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<usize>().ok());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let workers = var("RAYON_NUM_THREADS").filter(|&n| n > 0).unwrap_or(cores.saturating_sub(1)).max(1);
        Plan { ahead: var(EnvVars::BLOCKS_AHEAD).unwrap_or(DEFAULT_AHEAD), workers }
    }
}

/// What a run of the pipeline saw: the most blocks produced and not yet consumed at once
/// (the block being consumed included), for the memory bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flow {
    pub peak_in_flight: usize,
}

/// Blocks `0..n`: `produce(k)` on a producer thread inside a pool of `plan.workers` threads
/// (rayon's parallel iterators in `produce` spread over them), `consume(k, block)` on the
/// calling thread in order `0, 1, ..`; the producer waits while `plan.ahead` blocks wait for
/// the consumer. The first error in block order is returned, as a loop of `produce(k)` then
/// `consume(k)` would return it (the producer stops once the consumer has stopped).
pub fn run<B: Send>(n: usize, plan: Plan, mut produce: impl FnMut(usize) -> Result<B> + Send, mut consume: impl FnMut(usize, B) -> Result<()>) -> Result<Flow> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(plan.workers.max(1))
        .thread_name(|i| format!("scfoundry-tokenise-{i}"))
        .build()
        .map_err(|e| Error::Model { context: "starting the tokenising threads".into(), detail: e.to_string() })?;
    let in_flight = AtomicUsize::new(0);
    let peak = AtomicUsize::new(0);
    let enter = || {
        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        peak.fetch_max(now, Ordering::SeqCst);
    };
    let leave = || {
        in_flight.fetch_sub(1, Ordering::SeqCst);
    };
    if plan.ahead == 0 || n <= 1 {
        for k in 0..n {
            enter();
            let block = pool.install(|| produce(k))?;
            consume(k, block)?;
            leave();
        }
        return Ok(Flow { peak_in_flight: peak.load(Ordering::SeqCst) });
    }
    std::thread::scope(|scope| {
        let (tx, rx) = sync_channel::<Result<B>>(plan.ahead - 1);
        let (pool, enter) = (&pool, &enter);
        let producer = scope.spawn(move || {
            for k in 0..n {
                enter();
                let block = pool.install(|| produce(k));
                let failed = block.is_err();
                // the consumer has stopped (its error is the run's): nothing more to produce
                if tx.send(block).is_err() || failed {
                    break;
                }
            }
        });
        let consumed = (|| {
            for k in 0..n {
                let block = rx.recv().map_err(|_| Error::Model { context: "reading the next block of rows".into(), detail: "the producer thread stopped without a result".into() })??;
                consume(k, block)?;
                leave();
            }
            Ok(())
        })();
        drop(rx);
        if producer.join().is_err() {
            return Err(Error::Model { context: "reading and tokenising blocks of rows".into(), detail: "the producer thread panicked".into() });
        }
        consumed
    })?;
    Ok(Flow { peak_in_flight: peak.load(Ordering::SeqCst) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn plan(ahead: usize) -> Plan {
        Plan { ahead, workers: 2 }
    }

    /// A slow consumer: the producer runs ahead until `ahead` blocks wait, never further; the
    /// blocks arrive in order.
    #[test]
    fn blocks_in_order_and_in_flight_bounded() {
        for ahead in [0, 1, 2, 3] {
            let made = AtomicUsize::new(0);
            let mut seen = Vec::new();
            let flow = run(
                12,
                plan(ahead),
                |k| {
                    made.fetch_add(1, Ordering::SeqCst);
                    Ok(vec![k; 3])
                },
                |k, b| {
                    std::thread::sleep(Duration::from_millis(15));
                    assert_eq!(b, vec![k; 3]);
                    seen.push(k);
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(seen, (0..12).collect::<Vec<_>>());
            assert_eq!(made.load(Ordering::SeqCst), 12);
            assert!(flow.peak_in_flight <= ahead + 1, "ahead {ahead}: peak {}", flow.peak_in_flight);
            // the producer is fast: with room ahead it fills it
            assert_eq!(flow.peak_in_flight, ahead + 1, "ahead {ahead}");
        }
    }

    /// Producing and consuming overlap: 8 blocks of 40 ms + 40 ms take about 8 x 40 ms
    /// pipelined, 8 x 80 ms one after another.
    #[test]
    fn stages_overlap() {
        let time = |ahead| {
            let t = Instant::now();
            let clock = StageClock::new();
            run(
                8,
                plan(ahead),
                |_| {
                    clock.time(Stage::Tokenise, || std::thread::sleep(Duration::from_millis(40)));
                    Ok(())
                },
                |_, ()| {
                    clock.time(Stage::Device, || std::thread::sleep(Duration::from_millis(40)));
                    Ok(())
                },
            )
            .unwrap();
            let wall = t.elapsed().as_secs_f64();
            assert!(clock.seconds(Stage::Tokenise) >= 0.32 && clock.seconds(Stage::Device) >= 0.32);
            wall
        };
        let (serial, piped) = (time(0), time(2));
        assert!(serial >= 0.64, "serial {serial}");
        assert!(piped < 0.55, "pipelined {piped} (serial {serial})");
    }

    /// The first error in block order is the run's, from either side, and the producer stops.
    #[test]
    fn first_error_in_block_order() {
        let err = |k: usize| Error::Model { context: format!("block {k}"), detail: String::new() };
        let made = AtomicUsize::new(0);
        let r = run(
            50,
            plan(2),
            |k| {
                made.fetch_add(1, Ordering::SeqCst);
                if k == 5 {
                    Err(err(k))
                } else {
                    Ok(k)
                }
            },
            |k, _| if k == 3 { Err(err(k)) } else { Ok(()) },
        );
        assert!(r.unwrap_err().to_string().contains("block 3"));
        assert!(made.load(Ordering::SeqCst) <= 7, "made {}", made.load(Ordering::SeqCst));
        let r = run(50, plan(2), |k| if k == 5 { Err(err(k)) } else { Ok(k) }, |_, _| Ok(()));
        assert!(r.unwrap_err().to_string().contains("block 5"));
    }

    /// Parallel iterators in `produce` run on the plan's workers.
    #[test]
    fn produce_runs_in_the_pool() {
        use rayon::prelude::*;
        let r = run(3, Plan { ahead: 1, workers: 3 }, |_| Ok(rayon::current_num_threads()), |_, n| {
            assert_eq!(n, 3);
            Ok(())
        });
        r.unwrap();
        let v: Vec<usize> = run_collect(Plan { ahead: 2, workers: 2 });
        assert_eq!(v, (0..100).map(|i| i * 2).collect::<Vec<_>>());

        fn run_collect(p: Plan) -> Vec<usize> {
            let mut out = Vec::new();
            run(4, p, |k| Ok((k * 25..(k + 1) * 25).into_par_iter().map(|i| i * 2).collect::<Vec<_>>()), |_, b| {
                out.extend(b);
                Ok(())
            })
            .unwrap();
            out
        }
    }
}
