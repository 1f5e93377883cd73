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

/// The reporter for the current settings.
pub fn reporter(quiet: bool) -> Box<dyn Reporter> {
    if quiet {
        Box::new(Silent)
    } else {
        Box::new(Bars)
    }
}

/// A warning, always shown (also with `--quiet`): things the user must know.
pub fn warn(msg: &str) {
    eprintln!("warning: {msg}");
}
