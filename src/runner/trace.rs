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
    /// The pid, Slurm job id (`123_4` for an array task) or other executor id.
    pub native_id: Option<String>,
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
    /// GPU tasks: cells per batch and peak device memory (from gpu.json). When a run has any,
    /// trace.txt gains `batch_size` and `peak_gpu_mem` columns, which `scfoundry trace` sizes
    /// batches from (Nextflow's own trace has no such fields).
    pub batch_size: Option<u64>,
    pub peak_gpu_mem: Option<u64>,
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
            or_dash(self.native_id.clone(), |v| v),
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

/// The whole file: header and one line per record; with the GPU columns when a record has
/// them.
pub fn render(records: &[TraceRecord]) -> String {
    let gpu = records.iter().any(|r| r.batch_size.is_some() || r.peak_gpu_mem.is_some());
    let mut s = COLUMNS.join("\t");
    if gpu {
        s.push_str("\tbatch_size\tpeak_gpu_mem");
    }
    s.push('\n');
    for r in records {
        s.push_str(&r.line());
        if gpu {
            s.push_str(&format!("\t{}\t{}", or_dash(r.batch_size, |v| v.to_string()), or_dash(r.peak_gpu_mem, fmt_memory)));
        }
        s.push('\n');
    }
    s
}

// ---- Reading trace files ------------------------------------------------------------

/// Memory as Nextflow prints it (`1.2 GB`, `512 B`, `0`) or raw bytes (`trace.raw = true`).
pub fn parse_memory(s: &str) -> Option<u64> {
    let s = s.trim();
    if s == "-" || s.is_empty() {
        return None;
    }
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (s[..i].trim(), s[i..].trim()),
        None => (s, "B"),
    };
    let pow = match unit.to_ascii_uppercase().as_str() {
        "B" => 0,
        "KB" | "K" => 1,
        "MB" | "M" => 2,
        "GB" | "G" => 3,
        "TB" | "T" => 4,
        "PB" | "P" => 5,
        "EB" | "E" => 6,
        _ => return None,
    };
    let v: f64 = num.parse().ok()?;
    if v < 0.0 {
        return None;
    }
    Some((v * 1024f64.powi(pow)).round() as u64)
}

/// A duration as Nextflow prints it (`850ms`, `1.2s`, `3m 4s`, `1h 2m`, `2d 1h`) or raw
/// milliseconds. Nextflow's `Duration` also reads `min`, `sec`, `hours`...; those are accepted.
pub fn parse_duration(s: &str) -> Option<u64> {
    let s = s.trim();
    if s == "-" || s.is_empty() {
        return None;
    }
    if let Ok(ms) = s.parse::<f64>() {
        return (ms >= 0.0).then_some(ms.round() as u64);
    }
    let mut total = 0f64;
    let mut rest = s;
    let mut any = false;
    while !rest.is_empty() {
        rest = rest.trim_start();
        let n_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if n_end == 0 {
            return None;
        }
        let v: f64 = rest[..n_end].parse().ok()?;
        rest = rest[n_end..].trim_start();
        let u_end = rest.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(rest.len());
        let unit = &rest[..u_end];
        rest = &rest[u_end..];
        let ms = match unit {
            "ms" | "milli" | "millis" => 1.0,
            "s" | "sec" | "second" | "seconds" => 1e3,
            "m" | "min" | "minute" | "minutes" => 60e3,
            "h" | "hour" | "hours" => 3600e3,
            "d" | "day" | "days" => 86400e3,
            _ => return None,
        };
        total += v * ms;
        any = true;
    }
    any.then_some(total.round() as u64)
}

/// `130.1%`, or raw `130.1`.
pub fn parse_percent(s: &str) -> Option<f64> {
    let s = s.trim();
    if s == "-" || s.is_empty() {
        return None;
    }
    s.trim_end_matches('%').trim().parse().ok()
}

/// A trace file: its column names and one map per row (column -> cell).
#[derive(Debug, Clone, Default)]
pub struct TraceTable {
    pub columns: Vec<String>,
    pub rows: Vec<std::collections::BTreeMap<String, String>>,
}

/// One task as read back, whichever names and units the file used.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReadRecord {
    pub task_id: Option<u64>,
    pub name: String,
    pub status: String,
    pub exit: Option<i32>,
    pub duration_ms: Option<u64>,
    pub realtime_ms: Option<u64>,
    pub cpu_percent: Option<f64>,
    pub peak_rss: Option<u64>,
    pub peak_vmem: Option<u64>,
    pub rchar: Option<u64>,
    pub wchar: Option<u64>,
    /// Cells per batch, when the task recorded it (`batch_size` column).
    pub batch_size: Option<u64>,
    /// Peak GPU memory, when the task recorded it (`peak_gpu_mem` column).
    pub peak_gpu_mem: Option<u64>,
}

impl TraceTable {
    /// Parse tab-separated text with a header line. Errors carry the 1-based line.
    pub fn parse(text: &str) -> std::result::Result<TraceTable, (usize, String)> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        let (_, header) = lines.next().ok_or((1, "the file is empty".to_string()))?;
        let columns: Vec<String> = header.split('\t').map(|c| c.trim().to_string()).collect();
        if !columns.iter().any(|c| c == "name" || c == "task_id" || c == "process") {
            return Err((1, format!("no `name` or `task_id` column in the header (is it tab-separated?): {header:?}")));
        }
        let mut rows = Vec::new();
        for (i, line) in lines {
            let cells: Vec<&str> = line.split('\t').collect();
            if cells.len() != columns.len() {
                return Err((i + 1, format!("{} fields, but the header has {}", cells.len(), columns.len())));
            }
            rows.push(columns.iter().cloned().zip(cells.iter().map(|c| c.trim().to_string())).collect());
        }
        Ok(TraceTable { columns, rows })
    }

    /// The rows as records; newer and older column names both read (`realtime`/`walltime`,
    /// `peak_rss`/`rss`, `peak_vmem`/`vmem`).
    pub fn records(&self) -> Vec<ReadRecord> {
        self.rows
            .iter()
            .map(|r| {
                let get = |names: &[&str]| names.iter().find_map(|n| r.get(*n).map(String::as_str)).filter(|v| *v != "-");
                ReadRecord {
                    task_id: get(&["task_id"]).and_then(|v| v.parse().ok()),
                    name: get(&["name", "process"]).unwrap_or("").to_string(),
                    status: get(&["status"]).unwrap_or("-").to_string(),
                    exit: get(&["exit"]).and_then(|v| v.parse().ok()),
                    duration_ms: get(&["duration"]).and_then(parse_duration),
                    realtime_ms: get(&["realtime", "walltime"]).and_then(parse_duration),
                    cpu_percent: get(&["%cpu"]).and_then(parse_percent),
                    peak_rss: get(&["peak_rss", "rss"]).and_then(parse_memory),
                    peak_vmem: get(&["peak_vmem", "vmem"]).and_then(parse_memory),
                    rchar: get(&["rchar"]).and_then(parse_memory),
                    wchar: get(&["wchar"]).and_then(parse_memory),
                    batch_size: get(&["batch_size"]).and_then(|v| v.parse().ok()),
                    peak_gpu_mem: get(&["peak_gpu_mem", "peak_gpu_memory"]).and_then(parse_memory),
                }
            })
            .collect()
    }
}

/// The largest batch whose peak GPU memory fits `budget`, from one measured (batch, peak), with
/// 10% headroom, assuming memory grows linearly with the batch through the origin (which
/// overstates the per-cell cost when the model's weights take a fixed part: a safe guess).
/// With two measurements at different batch sizes the fixed part is fitted too.
pub fn batch_that_fits(points: &[(u64, u64)], budget: u64) -> Option<u64> {
    let usable = budget as f64 * 0.9;
    let mut pts: Vec<(f64, f64)> = points.iter().filter(|(b, m)| *b > 0 && *m > 0).map(|&(b, m)| (b as f64, m as f64)).collect();
    pts.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    pts.dedup_by(|a, b| a.0 == b.0);
    let (fixed, per) = match (pts.first(), pts.last()) {
        (Some(a), Some(b)) if b.0 > a.0 && b.1 > a.1 => {
            let per = (b.1 - a.1) / (b.0 - a.0);
            ((a.1 - per * a.0).max(0.0), per)
        }
        (Some(a), _) => (0.0, a.1 / a.0),
        _ => return None,
    };
    let n = ((usable - fixed) / per).floor();
    (n >= 1.0).then_some(n as u64)
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

    #[test]
    fn formatted_values_parse_back() {
        for b in [0u64, 1, 512, 1023, 1024, 1536, 30_000_000, 1_288_490_189, 5 * (1u64 << 40)] {
            let back = parse_memory(&fmt_memory(b)).unwrap();
            // one decimal: within 5% of a unit step
            let tol = (b as f64 * 0.05).max(1.0);
            assert!((back as f64 - b as f64).abs() <= tol, "{b} -> {} -> {back}", fmt_memory(b));
            assert_eq!(fmt_memory(back), fmt_memory(b), "formatting what was parsed is stable");
        }
        for ms in [0u64, 5, 999, 1_000, 1_234, 59_940, 60_000, 184_000, 3_600_000, 90_061_000] {
            let back = parse_duration(&fmt_duration(ms)).unwrap();
            assert_eq!(fmt_duration(back), fmt_duration(ms));
            assert!((back as i64 - ms as i64).abs() <= 500, "{ms} -> {back}");
        }
        assert_eq!(parse_percent(&fmt_percent(130.14)), Some(130.1));
        assert_eq!(parse_memory("29.8 MB"), Some((29.8f64 * 1048576.0).round() as u64));
        assert_eq!(parse_memory("123456"), Some(123456), "raw bytes");
        assert_eq!(parse_duration("3m 4s"), Some(184_000));
        assert_eq!(parse_duration("1m"), Some(60_000));
        assert_eq!(parse_duration("352ms"), Some(352));
        assert_eq!(parse_duration("1234"), Some(1234), "raw milliseconds");
        assert_eq!(parse_duration("-"), None);
        assert_eq!(parse_memory("12 parsecs"), None);
    }

    #[test]
    fn rendered_trace_reads_back() {
        let r = TraceRecord {
            task_id: 3,
            hash: "ab/cdef12".into(),
            native_id: Some("77_1".into()),
            name: "EMBED_PCA_PROJECT (x, shard 1)".into(),
            status: "COMPLETED".into(),
            exit: Some(0),
            submit_ms: 0,
            duration_ms: Some(184_000),
            realtime_ms: Some(1_200),
            cpu_percent: Some(130.14),
            peak_rss: Some(1_288_490_189),
            peak_vmem: None,
            rchar: Some(0),
            wchar: Some(1536),
            batch_size: Some(48),
            peak_gpu_mem: Some(3 << 30),
        };
        let text = render(&[r.clone(), TraceRecord { task_id: 4, ..r.clone() }]);
        assert!(text.lines().next().unwrap().ends_with("\twchar\tbatch_size\tpeak_gpu_mem"), "{text}");
        let t = TraceTable::parse(&text).unwrap();
        assert_eq!((t.records()[1].batch_size, t.records()[1].peak_gpu_mem), (Some(48), Some(3 << 30)));
        // without GPU figures, Nextflow's columns only
        let plain = render(&[TraceRecord { batch_size: None, peak_gpu_mem: None, ..r.clone() }]);
        assert!(plain.lines().next().unwrap().ends_with("\twchar"), "{plain}");
        let back = &t.records()[0];
        assert_eq!(back.task_id, Some(3));
        assert_eq!(back.name, "EMBED_PCA_PROJECT (x, shard 1)");
        assert_eq!(back.duration_ms, Some(184_000));
        assert_eq!(back.realtime_ms, Some(1_200));
        assert_eq!(back.cpu_percent, Some(130.1));
        assert_eq!(fmt_memory(back.peak_rss.unwrap()), "1.2 GB");
        assert_eq!(back.peak_vmem, None);
        assert_eq!(back.wchar, Some(1536));
    }

    #[test]
    fn sizing() {
        // 8 cells used 10 GB: 80 GB with 10% headroom fits 57
        assert_eq!(batch_that_fits(&[(8, 10 << 30)], 80 << 30), Some(57));
        // 4 GB fixed + 1 GB per 8 cells
        assert_eq!(batch_that_fits(&[(8, 5 << 30), (16, 6 << 30)], 80 << 30), Some(544));
        assert_eq!(batch_that_fits(&[(8, 100 << 30)], 80 << 30), Some(5), "smaller than measured");
        assert_eq!(batch_that_fits(&[(1, 100 << 30)], 80 << 30), None);
    }
}
