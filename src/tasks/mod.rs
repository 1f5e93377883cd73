//! What runs inside a task process (`scfoundry __task SPEC`, started by the runner): the
//! dispatcher, the shared runtime (device, batches, verified weights, the commit of an
//! embedding), the method table and one adapter per method. It does the work, then records
//! its own cost (stats.json) and result (result.json) beside the spec.

use std::path::Path;
use std::time::Instant;

use crate::error::Error;
use crate::runner::stats::TaskStats;
use crate::runner::{Step, TaskResult, TaskSpec};

pub mod counts;
pub mod embed;
pub mod genes;
pub mod inputs;
pub mod integrate;
pub mod method;
pub mod pipeline;
pub mod precision;
pub mod runtime;
pub mod shard;
pub mod table;

/// The task of a command whose work lives with the command (benchmark, geometry, finetune),
/// given by the binary so that this layer does not reach up into `commands`.
pub type CommandTask = fn(&TaskSpec, &Path) -> anyhow::Result<TaskResult>;

/// Run the task of `spec_path`: a method's through the table, a command's through
/// `command_tasks` (by command name).
pub fn run(spec_path: &Path, command_tasks: &[(&str, CommandTask)]) -> anyhow::Result<()> {
    let started = Instant::now();
    let text = std::fs::read_to_string(spec_path).map_err(|e| Error::Io { path: spec_path.into(), source: e })?;
    let spec: TaskSpec = serde_json::from_str(&text)?;
    let dir = spec_path.parent().unwrap_or(Path::new("."));
    // A task given --gpu takes its card before anything touches CUDA (on any device: the user
    // gave the cards to these tasks); the lock is held until this process ends.
    let held = match &spec.gpus {
        Some(list) => Some(take_card(list, &spec.name, spec.quiet)?),
        None => None,
    };
    let not_here = || Error::NotImplemented { name: format!("{} {}", spec.command, spec.method), version: env!("CARGO_PKG_VERSION") };
    let method = table::get(&spec.method);
    let outcome: anyhow::Result<TaskResult> = match spec.command.as_str() {
        "embed" => match (method.and_then(|m| m.embed(&spec, dir, &spec.step)), &spec.step) {
            (Some(r), _) => r.map_err(Into::into),
            (None, Step::Merge { shards }) if method.is_some() => shard::merge(&spec, shards).map_err(Into::into),
            (None, _) => Err(not_here().into()),
        },
        "transfer" => method.and_then(|m| m.transfer(&spec, dir, &spec.step)).unwrap_or_else(|| Err(not_here())).map_err(Into::into),
        "integrate" if spec.step == Step::Embed => method.and_then(|m| m.integrate(&spec)).unwrap_or_else(|| Err(not_here().into())),
        c if spec.step == Step::Embed => match command_tasks.iter().find(|(name, _)| *name == c) {
            Some((_, task)) => task(&spec, dir),
            None => Err(not_here().into()),
        },
        _ => Err(not_here().into()),
    };
    let stats = TaskStats::measure_self(started.elapsed().as_millis() as u64);
    let _ = std::fs::write(dir.join("stats.json"), serde_json::to_string_pretty(&stats)?);
    let mut result = outcome?;
    result.card = held.as_ref().map(|h| h.record());
    std::fs::write(dir.join("result.json"), serde_json::to_string_pretty(&result)?)?;
    Ok(())
}

/// Lock a free card of `list` (waiting, and saying so once, while all are held) and make it
/// the only card CUDA will see.
pub fn take_card(list: &crate::gpu::cards::GpuList, name: &str, quiet: bool) -> anyhow::Result<crate::gpu::cards::HeldCard> {
    use crate::gpu::cards;
    let dir = cards::lock_dir();
    let held = cards::take(list, &dir, |why| {
        if !quiet {
            eprintln!("{name}: {why}");
        }
    })?;
    cards::make_visible(&held);
    Ok(held)
}

/// `__hold-gpu`: take a card as a task does, append `ordinal uuid slot start_ms end_ms` to
/// `record`, hold it for `ms` milliseconds. For the tests of the card locks (no CUDA needed).
pub fn hold_gpu(list: &crate::gpu::cards::GpuList, record: &Path, ms: u64) -> anyhow::Result<()> {
    use std::io::Write;
    let held = take_card(list, "__hold-gpu", false)?;
    let start = chrono::Utc::now().timestamp_millis();
    std::thread::sleep(std::time::Duration::from_millis(ms));
    let end = chrono::Utc::now().timestamp_millis();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    let line = format!("{} {} {} {start} {end} {visible}\n", held.card.ordinal, held.card.uuid, held.slot);
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(record).map_err(|e| Error::Io { path: record.into(), source: e })?;
    f.write_all(line.as_bytes()).map_err(|e| Error::Io { path: record.into(), source: e })?;
    Ok(())
}
