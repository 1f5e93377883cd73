//! `scfoundry trace FILE`: each task's peak memory and wall time from a Nextflow-format
//! trace.txt (ours or Nextflow's, formatted or raw units), with a batch-size hint for a GPU.

use crate::cli::TraceArgs;
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::runner::trace::{batch_that_fits, fmt_duration, fmt_memory, fmt_percent, parse_memory, ReadRecord, TraceTable};

/// The process part of a task name: `EMBED_PCA (pbmc)` -> `EMBED_PCA`.
fn process_of(name: &str) -> &str {
    name.split(" (").next().unwrap_or(name)
}

pub fn render(records: &[ReadRecord], gpu_memory: Option<u64>) -> String {
    let dash = || "-".to_string();
    let rows: Vec<[String; 8]> = records
        .iter()
        .map(|r| {
            [
                r.task_id.map(|v| v.to_string()).unwrap_or_else(dash),
                r.name.clone(),
                r.status.clone(),
                r.exit.map(|v| v.to_string()).unwrap_or_else(dash),
                r.realtime_ms.map(fmt_duration).unwrap_or_else(dash),
                r.duration_ms.map(fmt_duration).unwrap_or_else(dash),
                r.peak_rss.map(fmt_memory).unwrap_or_else(dash),
                r.cpu_percent.map(fmt_percent).unwrap_or_else(dash),
            ]
        })
        .collect();
    let header = ["task", "name", "status", "exit", "wall", "duration", "peak_mem", "%cpu"];
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(&header.map(String::from));
    for r in &rows {
        out.push_str(&line(r));
    }
    let peak = records.iter().filter_map(|r| r.peak_rss).max();
    let wall: u64 = records.iter().filter_map(|r| r.realtime_ms).sum();
    out.push_str(&format!(
        "\n{} tasks, {} of task time, largest peak memory {}\n",
        records.len(),
        fmt_duration(wall),
        peak.map(fmt_memory).unwrap_or_else(|| "-".into())
    ));
    // Sizing: per process, from tasks that recorded batch size and peak GPU memory.
    let mut processes: Vec<&str> = records.iter().map(|r| process_of(&r.name)).collect();
    processes.dedup();
    let mut seen = std::collections::BTreeSet::new();
    processes.retain(|p| seen.insert(*p));
    out.push('\n');
    for p in processes {
        let tasks: Vec<&ReadRecord> = records.iter().filter(|r| process_of(&r.name) == p).collect();
        let points: Vec<(u64, u64)> = tasks.iter().filter_map(|r| Some((r.batch_size?, r.peak_gpu_mem?))).collect();
        let host = tasks.iter().filter_map(|r| r.peak_rss).max();
        let longest = tasks.iter().filter_map(|r| r.realtime_ms).max();
        let mut text = format!(
            "peak memory {}, longest {}",
            host.map(fmt_memory).unwrap_or_else(|| "-".into()),
            longest.map(fmt_duration).unwrap_or_else(|| "-".into())
        );
        if let Some(h) = host {
            text.push_str(&format!("; ask for {} (25% headroom)", fmt_memory(h + h / 4)));
        }
        text.push_str(". ");
        text.push_str(&match (gpu_memory, points.is_empty()) {
            (_, true) => {
                let missing = match (tasks.iter().any(|r| r.batch_size.is_some()), tasks.iter().any(|r| r.peak_gpu_mem.is_some())) {
                    (false, false) => "no batch size and no peak GPU memory",
                    (true, false) => "no peak GPU memory",
                    (false, true) => "no batch size",
                    (true, true) => "no task with both batch size and peak GPU memory",
                };
                format!("No batch-size hint: {missing} recorded (`batch_size`, `peak_gpu_mem` columns).")
            }
            (None, false) => format!("Measured {}; pass --gpu-memory (e.g. 80GB) for the batch size that fits a GPU.", describe(&points)),
            (Some(budget), false) => match batch_that_fits(&points, budget) {
                Some(b) => format!("--batch-size {b} fits {} with 10% headroom (measured {}).", fmt_memory(budget), describe(&points)),
                None => format!("Even a batch of 1 may not fit {} (measured {}).", fmt_memory(budget), describe(&points)),
            },
        });
        out.push_str(&format!("{p}: {text}\n"));
    }
    out
}

fn describe(points: &[(u64, u64)]) -> String {
    points.iter().map(|(b, m)| format!("batch {b} peaked at {}", fmt_memory(*m))).collect::<Vec<_>>().join(", ")
}

pub fn run(args: &TraceArgs) -> anyhow::Result<ExitStatus> {
    // a run folder stands for its trace.txt
    let file = if args.file.is_dir() { args.file.join("trace.txt") } else { args.file.clone() };
    let text = std::fs::read_to_string(&file).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile { path: file.clone() },
        _ => Error::Io { path: file.clone(), source: e },
    })?;
    let table = TraceTable::parse(&text).map_err(|(line, detail)| Error::Parse {
        path: file.clone(),
        line,
        detail,
        hint: Some("pass a trace.txt as Nextflow writes it (`-with-trace`) or a run folder's trace.txt".into()),
    })?;
    let gpu = match &args.gpu_memory {
        Some(g) => Some(parse_memory(g).filter(|&b| b > 0).ok_or_else(|| Error::BadOption {
            option: "--gpu-memory".into(),
            detail: format!("{g:?} is not a memory size"),
            hint: Some("write it like 80GB, 24 GB or 40960MB".into()),
        })?),
        None => None,
    };
    print!("{}", render(&table.records(), gpu));
    Ok(ExitStatus::Success)
}
