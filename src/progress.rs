//! Progress reporting. Library code talks to the `Reporter` trait; this is the one module
//! that draws bars (indicatif, on stderr). `--quiet` or a non-terminal stderr draws nothing.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A unit of long work with a known size.
pub trait Progress: Send + Sync {
    fn inc(&self, n: u64);
    fn finish(&self);
    /// Jump to a position (a resumed download starts part-way).
    fn set(&self, _pos: u64) {}
}

/// Creates progress for a named step.
pub trait Reporter: Send + Sync {
    fn step(&self, label: &str, total: u64, unit: &str) -> Box<dyn Progress>;
    /// A transfer of bytes (downloads, hashing); `total` may be unknown.
    fn bytes(&self, label: &str, total: Option<u64>) -> Box<dyn Progress> {
        self.step(label, total.unwrap_or(0), "bytes")
    }
    /// A one-line note (warnings go through `warn`).
    fn note(&self, msg: &str);
}

/// Prints nothing.
pub struct Silent;
struct NoProgress;
impl Progress for NoProgress {
    fn inc(&self, _: u64) {}
    fn finish(&self) {}
}
impl Reporter for Silent {
    fn step(&self, _: &str, _: u64, _: &str) -> Box<dyn Progress> {
        Box::new(NoProgress)
    }
    fn note(&self, _: &str) {}
}

/// Bars on stderr.
pub struct Bars;

struct Bar(ProgressBar);
impl Progress for Bar {
    fn inc(&self, n: u64) {
        self.0.inc(n)
    }
    fn finish(&self) {
        self.0.finish_and_clear()
    }
    fn set(&self, pos: u64) {
        self.0.set_position(pos)
    }
}

impl Reporter for Bars {
    fn step(&self, label: &str, total: u64, unit: &str) -> Box<dyn Progress> {
        let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(8));
        let style = ProgressStyle::with_template(&format!(
            "{{spinner}} {label:<24} [{{bar:30}}] {{human_pos}}/{{human_len}} {unit} ({{eta}})"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        pb.set_style(style);
        pb.enable_steady_tick(Duration::from_millis(250));
        Box::new(Bar(pb))
    }
    fn bytes(&self, label: &str, total: Option<u64>) -> Box<dyn Progress> {
        let pb = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr_with_hz(8));
        let template = match total {
            Some(_) => format!("{{spinner}} {label:<24} [{{bar:30}}] {{binary_bytes}}/{{binary_total_bytes}} {{binary_bytes_per_sec}} ({{eta}})"),
            None => format!("{{spinner}} {label:<24} {{binary_bytes}} {{binary_bytes_per_sec}}"),
        };
        pb.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> "));
        pb.enable_steady_tick(Duration::from_millis(250));
        Box::new(Bar(pb))
    }
    fn note(&self, msg: &str) {
        eprintln!("{msg}");
    }
}

/// Notes only, no bars: for `--quiet`-less runs whose stderr is not wanted to hold bars
/// ($SCFOUNDRY_NO_PROGRESS).
pub struct NotesOnly;
impl Reporter for NotesOnly {
    fn step(&self, _: &str, _: u64, _: &str) -> Box<dyn Progress> {
        Box::new(NoProgress)
    }
    fn note(&self, msg: &str) {
        eprintln!("{msg}");
    }
}

/// The reporter for a command: bars and notes, notes only, or nothing (`--quiet`).
pub fn for_settings(quiet: bool, progress: bool) -> Box<dyn Reporter> {
    match (quiet, progress) {
        (true, _) => Box::new(Silent),
        (false, true) => Box::new(Bars),
        (false, false) => Box::new(NotesOnly),
    }
}

/// The reporter for the current settings. In a shard's task process started by the local
/// runner ($SCFOUNDRY_PROGRESS_FILE set), cells go to that file for the runner's one bar
/// ([`ShardBar`]) and notes to stderr.
pub fn reporter(quiet: bool) -> Box<dyn Reporter> {
    if let Some(path) = std::env::var_os(crate::env::EnvVars::PROGRESS_FILE) {
        return Box::new(ToFile(std::path::PathBuf::from(path)));
    }
    if quiet {
        Box::new(Silent)
    } else {
        Box::new(Bars)
    }
}

/// Counts a task's cells into a file (the count as decimal text, rewritten at most 4 times a
/// second and when a step finishes) for the runner that draws the bar.
struct ToFile(std::path::PathBuf);

struct FileCount {
    path: std::path::PathBuf,
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
    last: std::sync::Mutex<std::time::Instant>,
}

impl FileCount {
    fn write(&self) {
        let tmp = self.path.with_extension("tmp");
        if std::fs::write(&tmp, self.done.load(std::sync::atomic::Ordering::Relaxed).to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, &self.path);
        }
    }
}

impl Progress for FileCount {
    fn inc(&self, n: u64) {
        self.done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut last) = self.last.lock() {
            if last.elapsed() >= Duration::from_millis(250) {
                *last = std::time::Instant::now();
                self.write();
            }
        }
    }
    fn finish(&self) {
        self.write();
    }
}

impl Reporter for ToFile {
    fn step(&self, _: &str, _: u64, unit: &str) -> Box<dyn Progress> {
        // cells are what the whole run counts; other steps (files, genes) draw nothing
        if unit != "cells" {
            return Box::new(NoProgress);
        }
        Box::new(FileCount { path: self.0.clone(), done: Default::default(), last: std::sync::Mutex::new(std::time::Instant::now()) })
    }
    fn note(&self, msg: &str) {
        eprintln!("{msg}");
    }
}

/// One bar for a run of several task processes: cells done over all of them (each writes its
/// count to its own file, see [`reporter`]), rate and ETA; drawn until dropped.
pub struct ShardBar {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ShardBar {
    /// Draw `label`'s bar over `total` cells from the counts in `files`; nothing when `draw` is
    /// false.
    pub fn start(label: &str, total: u64, files: Vec<std::path::PathBuf>, draw: bool) -> ShardBar {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if !draw {
            return ShardBar { stop, thread: None };
        }
        let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
        let style = ProgressStyle::with_template(&format!("{{spinner}} {label:<24} [{{bar:30}}] {{human_pos}}/{{human_len}} cells {{per_sec}} ({{eta}})"))
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        pb.set_style(style);
        let flag = stop.clone();
        let thread = std::thread::spawn(move || loop {
            let done: u64 = files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).filter_map(|t| t.trim().parse::<u64>().ok()).sum();
            pb.set_position(done.min(total));
            if flag.load(std::sync::atomic::Ordering::SeqCst) {
                pb.finish_and_clear();
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        });
        ShardBar { stop, thread: Some(thread) }
    }
}

impl Drop for ShardBar {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A warning, always shown (also with `--quiet`): things the user must know.
pub fn warn(msg: &str) {
    eprintln!("warning: {msg}");
}
