//! Nextflow's `trace.txt` format: tab-separated, with Nextflow's own units
//! (`1.2 GB`, `3m 4s`, `130.1%`, `-` for a missing value), so runs of scfoundry and of
//! Nextflow read the same way. Formatting follows Nextflow's `MemoryUnit.toString()`,
//! `Duration.toString()` and the trace file's `%.1f%%` percentages.

/// The columns we write, in Nextflow's names and order.
pub const COLUMNS: &[&str] = &[
    "task_id", "hash", "native_id", "name", "status", "exit", "submit", "duration", "realtime", "%cpu", "peak_rss", "peak_vmem", "rchar", "wchar",
];

/// Bytes as Nextflow prints memory: 1024-based, at most one decimal, `0` for zero.
pub fn fmt_memory(bytes: u64) -> String {
    if bytes == 0 {
        return "0".into();
    }
    const UNITS: [&str; 7] = ["B", "KB", "MB", "GB", "TB", "PB", "EB"];
    let groups = ((bytes as f64).log10() / 1024f64.log10()) as usize;
    let groups = groups.min(UNITS.len() - 1);
    let v = bytes as f64 / 1024f64.powi(groups as i32);
    format!("{} {}", fmt_one_decimal(v), UNITS[groups])
}

/// Java's DecimalFormat("0.#"): one optional decimal, half-even rounding.
fn fmt_one_decimal(v: f64) -> String {
    let scaled = v * 10.0;
    let floor = scaled.floor();
    let diff = scaled - floor;
    let r = if (diff - 0.5).abs() < 1e-9 { if floor as i64 % 2 == 0 { floor } else { floor + 1.0 } } else { scaled.round() };
    let r = r as i64;
    if r % 10 == 0 {
        format!("{}", r / 10)
    } else {
        format!("{}.{}", r / 10, r % 10)
    }
}

/// Milliseconds as Nextflow prints a duration: `850ms`, `1.2s`, `3m 4s`, `1h 2m`, `2d 1h`.
pub fn fmt_duration(ms: u64) -> String {
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    if ms < 60_000 {
        let tenths = ((ms as f64 / 1000.0) * 10.0).round() as u64;
        return if tenths % 10 == 0 { format!("{}s", tenths / 10) } else { format!("{}.{}s", tenths / 10, tenths % 10) };
    }
    let secs_total = (ms as f64 / 1000.0).round() as u64;
    let (mins_total, secs) = (secs_total / 60, secs_total % 60);
    let (hours_total, mins) = (mins_total / 60, mins_total % 60);
    let (days, hours) = (hours_total / 24, hours_total % 24);
    let mut parts = Vec::new();
    if days > 0 {
        parts.push(format!("{days}d"));
    }
    if hours > 0 {
        parts.push(format!("{hours}h"));
    }
    if mins > 0 {
        parts.push(format!("{mins}m"));
    }
    if secs > 0 {
        parts.push(format!("{secs}s"));
    }
    parts.join(" ")
}

/// A percentage as in Nextflow's trace: `%.1f%%`.
pub fn fmt_percent(p: f64) -> String {
    format!("{p:.1}%")
}

/// One task's record. `None` prints as `-`.
#[derive(Debug, Clone, Default)]
pub struct TraceRecord {
    pub task_id: u64,
    pub hash: String,
    pub native_id: Option<u32>,
    pub name: String,
    pub status: String,
    pub exit: Option<i32>,
    /// Milliseconds since the epoch.
    pub submit_ms: i64,
    pub duration_ms: Option<u64>,
    pub realtime_ms: Option<u64>,
    pub cpu_percent: Option<f64>,
    pub peak_rss: Option<u64>,
    pub peak_vmem: Option<u64>,
    pub rchar: Option<u64>,
    pub wchar: Option<u64>,
}

fn or_dash<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".into())
}

/// `yyyy-MM-dd HH:mm:ss.SSS` in local time, as Nextflow writes `submit`.
pub fn fmt_date(ms: i64) -> String {
    use chrono::TimeZone;
    match chrono::Local.timestamp_millis_opt(ms) {
        chrono::LocalResult::Single(t) => t.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
        _ => "-".into(),
    }
}

impl TraceRecord {
    pub fn line(&self) -> String {
        [
            self.task_id.to_string(),
            self.hash.clone(),
            or_dash(self.native_id, |v| v.to_string()),
            self.name.clone(),
            self.status.clone(),
            or_dash(self.exit, |v| v.to_string()),
            fmt_date(self.submit_ms),
            or_dash(self.duration_ms, fmt_duration),
            or_dash(self.realtime_ms, fmt_duration),
            or_dash(self.cpu_percent, fmt_percent),
            or_dash(self.peak_rss, fmt_memory),
            or_dash(self.peak_vmem, fmt_memory),
            or_dash(self.rchar, fmt_memory),
            or_dash(self.wchar, fmt_memory),
        ]
        .join("\t")
    }
}

/// The whole file: header and one line per record.
pub fn render(records: &[TraceRecord]) -> String {
    let mut s = COLUMNS.join("\t");
    s.push('\n');
    for r in records {
        s.push_str(&r.line());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_like_nextflow() {
        assert_eq!(fmt_memory(0), "0");
        assert_eq!(fmt_memory(512), "512 B");
        assert_eq!(fmt_memory(1024), "1 KB");
        assert_eq!(fmt_memory(1536), "1.5 KB");
        assert_eq!(fmt_memory(1_288_490_189), "1.2 GB");
        assert_eq!(fmt_memory(4 * 1024 * 1024), "4 MB");
    }

    #[test]
    fn duration_like_nextflow() {
        assert_eq!(fmt_duration(0), "0ms");
        assert_eq!(fmt_duration(999), "999ms");
        assert_eq!(fmt_duration(1_000), "1s");
        assert_eq!(fmt_duration(1_234), "1.2s");
        assert_eq!(fmt_duration(59_940), "59.9s");
        assert_eq!(fmt_duration(184_000), "3m 4s");
        assert_eq!(fmt_duration(3_600_000), "1h");
        assert_eq!(fmt_duration(90_061_000), "1d 1h 1m 1s");
    }

    #[test]
    fn percent_and_dash() {
        assert_eq!(fmt_percent(130.14), "130.1%");
        let r = TraceRecord { task_id: 1, hash: "ab/cdef12".into(), name: "EMBED (x)".into(), status: "COMPLETED".into(), ..Default::default() };
        let line = r.line();
        let cols: Vec<&str> = line.split('\t').collect();
        assert_eq!(cols.len(), COLUMNS.len());
        assert_eq!(cols[2], "-");
        assert_eq!(cols[13], "-");
    }
}
