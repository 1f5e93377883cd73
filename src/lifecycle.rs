//! What a killed run leaves behind: nothing unfinished.
//!
//! - Unfinished outputs (the temporary files an output is built in) are registered here; when the
//!   process is interrupted (SIGINT, SIGTERM, SIGHUP) they are removed, the process says what it
//!   removed, and exits with 128 + the signal's number.
//! - A task process started by the local runner watches a pipe from its parent
//!   ($SCFOUNDRY_PARENT_PIPE): when the parent dies (killed, even by SIGKILL), the pipe closes and
//!   the task removes its unfinished output and exits, freeing its card. Tasks run by Slurm or
//!   Nextflow keep those engines' semantics (no pipe).
//! - Temporary files carry the host, the boot id and the pid of their owner in their names, so a
//!   later run sweeps the leftovers of a killed one on the same host (never another host's: run
//!   folders may sit on a file system shared by nodes), and only those whose owner is dead.
//!
//! Signals reach a small thread through a self-pipe (the handler only writes one byte), so the
//! cleanup runs outside the handler; handlers are not inherited by programs we start.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

use crate::env::EnvVars;

static UNFINISHED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// Called with the signal's number before an interrupted process exits (the runner records the
/// interrupted tasks in the run folder).
static ON_INTERRUPT: Mutex<Option<fn(i32)>> = Mutex::new(None);
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

/// Install the signal watcher, and for a task process started with a parent pipe, the parent
/// watcher. Call once, early in `main`.
pub fn install() {
    let mut fds = [0i32; 2];
    // SAFETY: plain libc calls; the handler only writes one byte to a pipe (async-signal-safe).
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return;
        }
        SIGNAL_PIPE.store(fds[1], Ordering::SeqCst);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    let read_end = fds[0];
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        // SAFETY: reading one byte from our own pipe.
        let n = unsafe { libc::read(read_end, b.as_mut_ptr().cast(), 1) };
        if n == 1 {
            let sig = b[0] as i32;
            let hook = ON_INTERRUPT.lock().ok().and_then(|h| *h);
            if let Some(record) = hook {
                record(sig);
            }
            abandon(&format!("interrupted by {}", signal_name(sig)), 128 + sig);
        }
    });
    if std::env::var_os(EnvVars::PARENT_PIPE).is_some() {
        std::thread::spawn(|| {
            let mut stdin = std::io::stdin();
            let mut buf = [0u8; 64];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => continue,
                }
            }
            abandon("the scfoundry process that started this task has ended", 128 + libc::SIGHUP);
        });
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::SeqCst);
    let b = sig as u8;
    // SAFETY: write(2) is async-signal-safe.
    unsafe {
        libc::write(fd, (&b as *const u8).cast(), 1);
    }
}

/// Run `f` with the signal's number when SIGINT, SIGTERM or SIGHUP interrupts this process,
/// before the unfinished outputs are removed and the process exits.
pub fn on_interrupt(f: fn(i32)) {
    if let Ok(mut h) = ON_INTERRUPT.lock() {
        *h = Some(f);
    }
}

/// `SIGINT`, `SIGTERM`, `SIGHUP`: a signal's name as report.json records it.
pub fn signal_short_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "signal",
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT (Ctrl-C)",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// Remove the unfinished outputs, say so, and exit now.
fn abandon(why: &str, code: i32) -> ! {
    let files = UNFINISHED.lock().map(|v| v.clone()).unwrap_or_default();
    let mut removed = Vec::new();
    for f in &files {
        // a Zarr output is staged in a folder
        if std::fs::remove_file(f).is_ok() || (f.is_dir() && std::fs::remove_dir_all(f).is_ok()) {
            removed.push(f.display().to_string());
        }
    }
    if removed.is_empty() {
        eprintln!("scfoundry: {why}; no unfinished output to remove");
    } else {
        eprintln!("scfoundry: {why}; removed the unfinished output {}; finished outputs and the run folder are kept", removed.join(", "));
    }
    // SAFETY: exit without unwinding other threads (they may be mid-computation).
    unsafe { libc::_exit(code) }
}

/// An unfinished output being built at `path`: removed if the process is interrupted.
pub fn register(path: &Path) {
    if let Ok(mut v) = UNFINISHED.lock() {
        v.push(path.to_path_buf());
    }
}

/// `path` is finished (renamed into place) or already removed.
pub fn unregister(path: &Path) {
    if let Ok(mut v) = UNFINISHED.lock() {
        v.retain(|p| p != path);
    }
}

/// `host.bootid.pid`: who owns a temporary file, for the sweep of a later run.
pub fn owner_tag() -> String {
    format!("{}.{}.{}", host(), boot_id(), std::process::id())
}

fn host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok { String::from_utf8_lossy(&buf[..buf.iter().position(|&c| c == 0).unwrap_or(buf.len())]).to_string() } else { String::new() };
    let clean: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' }).collect();
    if clean.is_empty() {
        "host".into()
    } else {
        clean
    }
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().chars().filter(|c| c.is_ascii_hexdigit()).take(8).collect()).unwrap_or_else(|_| "noboot".into())
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// Remove the temporary files in `dir` named `{prefix}{host}.{boot}.{pid}.*` of this host whose
/// owner is dead (another boot, or no such process). Returns what was removed.
pub fn sweep(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let (me, boot) = (host(), boot_id());
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(prefix).and_then(|r| r.strip_prefix(&format!("{me}."))) else { continue };
        let mut parts = rest.splitn(3, '.');
        let (Some(b), Some(pid)) = (parts.next(), parts.next().and_then(|p| p.parse::<i32>().ok())) else { continue };
        let gone = |p: &Path| if p.is_dir() { std::fs::remove_dir_all(p).is_ok() } else { std::fs::remove_file(p).is_ok() };
        if (b != boot || !alive(pid)) && gone(&e.path()) {
            removed.push(e.path());
        }
    }
    removed
}
