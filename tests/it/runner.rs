//! The local runner: a run folder with a Nextflow-format trace.txt and a cost report.

use crate::common::TestContext;

#[test]
fn trace_txt_in_nextflow_format() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad"]);
    r.success().stderr_has("run folder: ");
    let runs: Vec<_> = std::fs::read_dir(ctx.path("runs")).unwrap().filter_map(|e| e.ok()).collect();
    assert_eq!(runs.len(), 1, "one run folder beside the output");
    let dir = runs[0].path();
    let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
    let lines: Vec<&str> = trace.lines().collect();
    assert_eq!(lines.len(), 2, "{trace}");
    assert_eq!(lines[0], "task_id\thash\tnative_id\tname\tstatus\texit\tsubmit\tduration\trealtime\t%cpu\tpeak_rss\tpeak_vmem\trchar\twchar");
    let cols: Vec<&str> = lines[1].split('\t').collect();
    assert_eq!(cols.len(), 14);
    assert_eq!(cols[0], "1");
    let hash = cols[1];
    assert!(hash.len() == 9 && hash.as_bytes()[2] == b'/', "hash like ab/cdef12: {hash}");
    assert!(cols[2].parse::<u32>().is_ok(), "native_id is the pid");
    assert_eq!(cols[3], "EMBED_PCA (pbmc68k_counts)");
    assert_eq!(cols[4], "COMPLETED");
    assert_eq!(cols[5], "0");
    assert!(cols[6].len() == 23 && cols[6].as_bytes()[4] == b'-' && cols[6].as_bytes()[19] == b'.', "submit date: {}", cols[6]);
    let is_duration = |s: &str| s.ends_with("ms") || s.ends_with('s');
    assert!(is_duration(cols[7]) && is_duration(cols[8]), "{} {}", cols[7], cols[8]);
    assert!(cols[9].ends_with('%'));
    for c in &cols[10..14] {
        let unit = c.rsplit(' ').next().unwrap();
        assert!(["B", "KB", "MB", "GB"].contains(&unit), "memory column {c}");
        let v: f64 = c.split(' ').next().unwrap().parse().unwrap();
        assert!(v > 0.0, "{c}");
    }
    // peak RSS is plausible: more than 1 MB
    assert!(cols[10].ends_with("MB") || cols[10].ends_with("GB"), "{}", cols[10]);
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["method"], "pca");
    assert_eq!(report["tasks"][0]["status"], "COMPLETED");
    assert!(report["max_peak_rss"].as_u64().unwrap() > 1 << 20);
    assert_eq!(report["tasks"][0]["result"]["dim"], 50);
}

#[test]
fn failed_task_is_traced() {
    let ctx = TestContext::new();
    let mut t = crate::common::Tiny::counts(10, 8);
    t.x[7] = 0.5;
    t.write(&ctx.path("t.h5ad"));
    // the counts check lets one fractional value through with a warning; pca's task refuses it
    ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad"]).failed().stderr_has("warning: counts check").stderr_has("run folder: ");
    let dir = std::fs::read_dir(ctx.path("runs")).unwrap().next().unwrap().unwrap().path();
    let trace = std::fs::read_to_string(dir.join("trace.txt")).unwrap();
    let cols: Vec<&str> = trace.lines().nth(1).unwrap().split('\t').collect();
    assert_eq!(cols[4], "FAILED");
    assert_eq!(cols[5], "1");
}

#[test]
fn quiet_prints_nothing_on_success() {
    let ctx = TestContext::new();
    ctx.demo("pbmc68k_counts.h5ad");
    let r = ctx.run(&["embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--quiet", "--n-comps", "4"]);
    r.success();
    assert_eq!(r.stderr, "");
    assert_eq!(r.stdout, "");
}
