//! Time `harmonize` on an embedding read from raw files, for `bench/harmony_vs_harmonypy.py`.
//!
//!     harmony_bench Z.f32 CODES.u32 N D [REPEATS] [OUT.f32]
//!
//! Z.f32: N x D little-endian f32, row-major; CODES.u32: N little-endian u32 batch codes (one
//! key). Prints one JSON line: the wall and CPU time (all threads, getrusage) of each repeat
//! in seconds, `harmonize` alone (not the file reading), iterations, converged. OUT.f32
//! receives the corrected embedding. Options are harmonypy 2.1's defaults, seed 0.

use std::time::Instant;

use scfoundry::methods::harmony::{harmonize, HarmonyOptions};

/// CPU seconds of this process so far (user + system, all threads).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn read(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: harmony_bench Z.f32 CODES.u32 N D [REPEATS] [OUT.f32]");
        std::process::exit(2);
    }
    let (n, d): (usize, usize) = (a[3].parse().unwrap(), a[4].parse().unwrap());
    let repeats: usize = a.get(5).map_or(1, |s| s.parse().unwrap());
    let z: Vec<f32> = read(&a[1]).chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let codes: Vec<u32> = read(&a[2]).chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!((z.len(), codes.len()), (n * d, n), "file sizes do not match N x D");
    let opts = HarmonyOptions::default();
    let mut times = Vec::new();
    let mut cpu = Vec::new();
    let mut last = None;
    for _ in 0..repeats {
        let (t, c) = (Instant::now(), cpu_seconds());
        let r = harmonize(&z, n, d, std::slice::from_ref(&codes), &opts, None).expect("harmonize");
        times.push(t.elapsed().as_secs_f64());
        cpu.push(cpu_seconds() - c);
        last = Some(r);
    }
    let r = last.unwrap();
    if let Some(out) = a.get(6) {
        let bytes: Vec<u8> = r.z_corr.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out, bytes).unwrap();
    }
    println!(
        "{{\"times\": {:?}, \"cpu\": {:?}, \"iterations\": {}, \"converged\": {}, \"threads\": {}}}",
        times,
        cpu,
        r.iterations,
        r.converged,
        rayon::current_num_threads()
    );
}
