//! Progress reporting. Library code talks to the `Reporter` trait; this is the one module
//! that draws bars (indicatif, on stderr). `--quiet` or a non-terminal stderr draws nothing.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A unit of long work with a known size.
pub trait Progress: Send + Sync {
    fn inc(&self, n: u64);
    fn finish(&self);
}

/// Creates progress for a named step.
pub trait Reporter: Send + Sync {
    fn step(&self, label: &str, total: u64, unit: &str) -> Box<dyn Progress>;
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
    fn note(&self, msg: &str) {
        eprintln!("{msg}");
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
