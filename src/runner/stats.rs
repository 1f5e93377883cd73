//! What a task process measures of itself, like Nextflow's `.command.trace`:
//! wall time, CPU time, peak resident and virtual memory, characters read and written.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TaskStats {
    pub realtime_ms: u64,
    pub cpu_ms: u64,
    /// bytes
    pub peak_rss: u64,
    /// bytes
    pub peak_vmem: u64,
    pub rchar: u64,
    pub wchar: u64,
}

impl TaskStats {
    pub fn cpu_percent(&self) -> f64 {
        if self.realtime_ms == 0 {
            0.0
        } else {
            self.cpu_ms as f64 / self.realtime_ms as f64 * 100.0
        }
    }

    /// Measure this process now (Linux /proc; zeros elsewhere).
    pub fn measure_self(realtime_ms: u64) -> TaskStats {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kb = |key: &str| -> u64 {
            status
                .lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        let io = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
        let io_field = |key: &str| -> u64 {
            io.lines().find(|l| l.starts_with(key)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
        };
        let cpu_ms = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut ru);
            let t = |tv: libc::timeval| tv.tv_sec as u64 * 1000 + tv.tv_usec as u64 / 1000;
            t(ru.ru_utime) + t(ru.ru_stime)
        };
        TaskStats {
            realtime_ms,
            cpu_ms,
            peak_rss: kb("VmHWM:"),
            peak_vmem: kb("VmPeak:"),
            rchar: io_field("rchar:"),
            wchar: io_field("wchar:"),
        }
    }
}
