//! `scfoundry doctor`: what this binary can use on this machine: the CUDA build, the driver and
//! CUDA versions, cuBLAS, each device with its free memory, and the allocator a run would use.
//! `--bench-alloc` times allocation + free pairs of every allocator mode against raw driver calls.

use serde_json::json;

use crate::cli::DoctorArgs;
use crate::commands::ExitStatus;
use crate::gpu;
use crate::settings::Settings;

pub fn run(s: &Settings, args: &DoctorArgs) -> anyhow::Result<ExitStatus> {
    let spec = s.device_spec(&args.device)?;
    let source = if args.device.allocator.is_some() {
        "--allocator"
    } else if s.workspace.as_ref().is_some_and(|w| w.config.allocator.is_some()) {
        "workspace scfoundry.toml"
    } else {
        "default"
    };
    let mut out = serde_json::Map::new();
    out.insert("scfoundry".into(), json!(env!("CARGO_PKG_VERSION")));
    out.insert("cuda_compiled".into(), json!(gpu::CUDA_COMPILED));
    out.insert("allocator".into(), json!({"in_effect": spec.allocator.describe(), "from": source, "options": spec.allocator}));
    let mut text = vec![format!("scfoundry {}", env!("CARGO_PKG_VERSION"))];
    let cuda = cuda_section(args, &mut out, &mut text);
    text.push(format!("allocator in effect: {} (from {source})", spec.allocator.describe()));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{}", text.join("\n"));
    }
    Ok(if cuda.is_ok() { ExitStatus::Success } else { ExitStatus::Failure })
}

#[cfg(not(feature = "cuda"))]
fn cuda_section(args: &DoctorArgs, out: &mut serde_json::Map<String, serde_json::Value>, text: &mut Vec<String>) -> Result<(), ()> {
    text.push("CUDA: not compiled in (this is the CPU build; scripts/build-cuda.sh builds the GPU binary, see README \"GPU build\")".into());
    out.insert("cuda".into(), json!(null));
    if args.bench_alloc {
        crate::progress::warn("--bench-alloc needs the CUDA build; nothing measured");
        return Err(());
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda_section(args: &DoctorArgs, out: &mut serde_json::Map<String, serde_json::Value>, text: &mut Vec<String>) -> Result<(), ()> {
    use crate::gpu::{cuda, options::human};
    text.push(format!("CUDA: compiled in ({}; driver and cuBLAS opened at run time)", gpu::build::Targets::this_binary().describe()));
    let inv = match cuda::inventory() {
        Ok(i) => i,
        Err(e) => {
            text.push(format!("driver: not usable: {e}"));
            if let Some(h) = e.hint() {
                text.push(format!("  hint: {h}"));
            }
            out.insert("cuda".into(), json!({"error": e.to_string()}));
            return Err(());
        }
    };
    text.push(format!("driver: {} (supports CUDA {})", inv.driver_library, inv.driver_cuda_version));
    let mut usable = true;
    text.push(format!("cuBLAS: {}", inv.cublas.as_ref().map(String::as_str).unwrap_or_else(|e| e.as_str())));
    text.push(format!("cuRAND: {}", inv.curand.as_ref().map(String::as_str).unwrap_or_else(|e| e.as_str())));
    text.push(format!("devices: {}", inv.devices.len()));
    for d in &inv.devices {
        text.push(format!(
            "  {}  {}  sm {}  {} total, {} free  memory pools: {}  managed memory: {}",
            d.ordinal,
            d.name,
            d.compute_capability,
            human(d.total_bytes),
            human(d.free_bytes),
            if d.memory_pools { "yes" } else { "no" },
            if d.managed_memory && d.concurrent_managed_access { "yes" } else if d.managed_memory { "yes (no concurrent access)" } else { "no" },
        ));
        match &d.kernels {
            Ok(how) => text.push(format!("     kernels: {how}")),
            Err(why) => {
                text.push(format!("     kernels: cannot run here: {why}"));
                usable = false;
            }
        }
    }
    out.insert("cuda".into(), serde_json::to_value(&inv).unwrap_or_default());
    if !usable {
        return Err(());
    }
    if args.bench_alloc {
        match cuda::latency_bench(args.gpu, args.pairs, args.seed) {
            Ok(rows) => {
                let raw = rows.first().map(|r| r.pair_us).unwrap_or(f64::NAN);
                text.push(format!("allocation + free, {} pairs, sizes log-uniform 1 KiB-64 MiB (seed {}), device {}:", args.pairs, args.seed, args.gpu));
                text.push(format!("  {:<40} {:>10} {:>18} {:>14}", "resource", "pair (us)", "64 live (us)", "vs raw async"));
                for r in &rows {
                    text.push(format!("  {:<40} {:>10.2} {:>18.2} {:>13.2}x", r.resource, r.pair_us, r.with_live_us, r.pair_us / raw));
                }
                out.insert("bench_alloc".into(), json!({"pairs": args.pairs, "seed": args.seed, "gpu": args.gpu, "rows": rows}));
            }
            Err(e) => {
                text.push(format!("--bench-alloc failed: {e}"));
                return Err(());
            }
        }
    }
    Ok(())
}
