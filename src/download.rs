//! HTTP(S) downloads that resume, and safe extraction of archives, for `weights pull`.
//!
//! A download goes to `<file>.part` beside its destination. A second attempt asks for the rest
//! with `Range: bytes=N-`; a server that ignores the range (answers 200) restarts the file from
//! its first byte. The caller verifies the finished `.part` and renames it into place, so the
//! destination only ever holds a complete, checked file. Network failures never delete
//! anything: the `.part` stays for the next attempt, and an existing file is not touched.
//!
//! Archives (tar.gz, zip) are extracted into a folder the caller then renames into place;
//! members with absolute paths, `..` components, or links that point outside are refused
//! before anything of that member is written.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::progress::Reporter;

/// A blocking HTTP client with connect and read timeouts.
pub struct Client {
    agent: ureq::Agent,
    timeout: Duration,
}

/// What one transfer did.
#[derive(Debug, Clone, Copy)]
pub struct Transfer {
    /// Bytes received in this attempt.
    pub received: u64,
    /// Bytes already in the `.part` that this attempt continued from.
    pub resumed_from: u64,
    /// Size of the complete file.
    pub total: u64,
    pub seconds: f64,
}

impl Client {
    pub fn new(timeout: Duration) -> Client {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(timeout)
            .timeout_read(timeout)
            .timeout_write(timeout)
            .redirects(10)
            .user_agent(concat!("scfoundry/", env!("CARGO_PKG_VERSION")))
            .build();
        Client { agent, timeout }
    }

    fn transport_error(&self, id: &str, url: &str, part: &Path, have: u64, t: &dyn std::fmt::Display) -> Error {
        let text = t.to_string();
        let low = text.to_lowercase();
        let detail = if low.contains("timed out") || low.contains("would block") || low.contains("timeout") {
            format!("no data for {} s (--timeout {}): {text}", self.timeout.as_secs(), self.timeout.as_secs())
        } else if low.contains("connection refused") {
            format!("connection refused (is the server up?): {text}")
        } else {
            text
        };
        Error::Network { id: id.into(), url: url.into(), detail, hint: resume_hint(part, have) }
    }

    /// Download `url` into `part`, continuing from the bytes already there. Returns when the
    /// server has sent the whole file; any failure leaves `part` as it is (to resume).
    pub fn fetch(&self, id: &str, url: &str, part: &Path, expected: Option<u64>, rep: &dyn Reporter) -> Result<Transfer> {
        let started = Instant::now();
        let io = |e: std::io::Error| Error::Io { path: part.to_path_buf(), source: e };
        let mut have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
        if let Some(size) = expected {
            if have == size {
                return Ok(Transfer { received: 0, resumed_from: have, total: size, seconds: 0.0 });
            }
        }
        let mut req = self.agent.get(url);
        if have > 0 {
            req = req.set("Range", &format!("bytes={have}-"));
        }
        let resp = match req.call() {
            Ok(r) => r,
            Err(ureq::Error::Status(416, r)) if have > 0 => {
                // The range starts at or past the end: the .part may already be complete.
                let total = r.header("Content-Range").and_then(|c| c.rsplit('/').next()).and_then(|t| t.trim().parse::<u64>().ok());
                if total == Some(have) {
                    return Ok(Transfer { received: 0, resumed_from: have, total: have, seconds: 0.0 });
                }
                return Err(Error::Download {
                    id: id.into(),
                    detail: format!("{url} refused to resume at byte {have} (HTTP 416) and does not say the file is that long"),
                    hint: Some(format!("the file on the server changed: delete {} and pull again", part.display())),
                });
            }
            Err(ureq::Error::Status(code, r)) => {
                return Err(Error::HttpStatus { id: id.into(), url: url.into(), status: code, reason: r.status_text().to_string() });
            }
            Err(ureq::Error::Transport(t)) => return Err(self.transport_error(id, url, part, have, &t)),
        };
        let is_html = resp.content_type().eq_ignore_ascii_case("text/html");
        if is_html && !url.ends_with(".html") {
            return Err(Error::Download {
                id: id.into(),
                detail: format!("{url} answered with a web page (Content-Type text/html), not the file: it is a share or login page"),
                hint: Some(format!(
                    "download the file in a browser and put it where `scfoundry weights path {id}` says; `scfoundry weights verify {id}` then checks it"
                )),
            });
        }
        let length = resp.header("Content-Length").and_then(|v| v.trim().parse::<u64>().ok());
        let (mut file, total) = if resp.status() == 206 {
            let range = resp.header("Content-Range").unwrap_or("");
            let (start, total) = parse_content_range(range).ok_or_else(|| Error::Download {
                id: id.into(),
                detail: format!("{url} answered 206 with an unreadable Content-Range {range:?}"),
                hint: Some("try again later; the partial download was kept".into()),
            })?;
            if start != have {
                return Err(Error::Download {
                    id: id.into(),
                    detail: format!("asked {url} for bytes from {have}, it sent bytes from {start}"),
                    hint: Some("try again later; the partial download was kept".into()),
                });
            }
            (OpenOptions::new().append(true).open(part).map_err(io)?, total.or(length.map(|l| l + have)))
        } else {
            if have > 0 {
                rep.note(&format!("{id}: the server does not resume (it ignored Range: bytes={have}-); starting from the first byte"));
                have = 0;
            }
            (File::create(part).map_err(io)?, length)
        };
        let bar = rep.bytes(&format!("download {id}"), total.or(expected));
        bar.set(have);
        let mut reader = resp.into_reader();
        let mut buf = vec![0u8; 1 << 18];
        let mut received = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    bar.finish();
                    let _ = file.flush();
                    let _ = file.sync_all();
                    return Err(self.transport_error(id, url, part, have + received, &format!("connection lost after {} bytes: {e}", have + received)));
                }
            };
            file.write_all(&buf[..n]).map_err(io)?;
            received += n as u64;
            bar.inc(n as u64);
        }
        bar.finish();
        file.flush().map_err(io)?;
        file.sync_all().map_err(io)?;
        let now = have + received;
        if let Some(t) = total {
            if now < t {
                return Err(Error::Network {
                    id: id.into(),
                    url: url.into(),
                    detail: format!("the transfer ended after {now} of {t} bytes"),
                    hint: resume_hint(part, now),
                });
            }
        }
        Ok(Transfer { received, resumed_from: have, total: now, seconds: started.elapsed().as_secs_f64() })
    }
}

fn resume_hint(part: &Path, have: u64) -> String {
    if have > 0 {
        format!("run the same command again: it resumes from byte {have} (kept in {}); nothing was deleted", part.display())
    } else {
        "check the network (or the url), then run the same command again; nothing was deleted".into()
    }
}

/// `bytes START-END/TOTAL` -> (START, TOTAL if known).
fn parse_content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let (start, _end) = range.split_once('-')?;
    Some((start.trim().parse().ok()?, total.trim().parse().ok()))
}

/// A member name as a relative path inside the target, or why it is refused.
pub fn safe_relative(name: &str) -> std::result::Result<PathBuf, String> {
    if name.contains('\\') {
        return Err("backslash in the name".into());
    }
    if name.starts_with('/') {
        return Err("absolute path".into());
    }
    let mut out = PathBuf::new();
    for c in Path::new(name).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => return Err("`..` in the path".into()),
            Component::RootDir | Component::Prefix(_) => return Err("absolute path".into()),
        }
    }
    if out.as_os_str().is_empty() {
        return Err("empty path".into());
    }
    Ok(out)
}

/// A link at `rel` (relative to the target) pointing to `target`: refuse it unless it stays inside.
pub fn check_link(rel: &Path, target: &Path) -> std::result::Result<(), String> {
    if target.is_absolute() {
        return Err(format!("link to the absolute path {}", target.display()));
    }
    let mut depth: i64 = rel.components().count() as i64 - 1;
    for c in target.components() {
        match c {
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("link to {}, outside the folder", target.display()));
                }
            }
            Component::RootDir | Component::Prefix(_) => return Err(format!("link to the absolute path {}", target.display())),
        }
    }
    Ok(())
}

/// Extract `archive` ("tar.gz" or "zip") into the folder `into` (which should be new and empty).
/// Refuses the whole archive at its first unsafe member. Returns the number of members.
pub fn extract(kind: &str, archive: &Path, into: &Path) -> Result<usize> {
    let unsafe_member = |member: &str, detail: String| Error::UnsafeArchive { archive: archive.to_path_buf(), member: member.into(), detail };
    let bad = |detail: String| Error::Download {
        id: archive.display().to_string(),
        detail: format!("cannot be read as {kind}: {detail}"),
        hint: Some("the archive is damaged or not what weights.toml says; `scfoundry weights verify` checks it".into()),
    };
    let wio = |p: &Path, e: std::io::Error| Error::Io { path: p.to_path_buf(), source: e };
    let mkparent = |p: &Path| -> Result<()> {
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).map_err(|e| wio(d, e))?;
        }
        Ok(())
    };
    let f = File::open(archive).map_err(|e| wio(archive, e))?;
    let mut count = 0;
    match kind {
        "tar.gz" => {
            let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(BufReader::new(f)));
            for entry in ar.entries().map_err(|e| bad(e.to_string()))? {
                let mut entry = entry.map_err(|e| bad(e.to_string()))?;
                let name = String::from_utf8_lossy(&entry.path_bytes()).to_string();
                use tar::EntryType as T;
                let ty = entry.header().entry_type();
                if matches!(ty, T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink) {
                    continue;
                }
                let rel = safe_relative(&name).map_err(|d| unsafe_member(&name, d))?;
                let out = into.join(&rel);
                match ty {
                    T::Directory => std::fs::create_dir_all(&out).map_err(|e| wio(&out, e))?,
                    T::Regular | T::Continuous => {
                        mkparent(&out)?;
                        let mut w = File::create(&out).map_err(|e| wio(&out, e))?;
                        std::io::copy(&mut entry, &mut w).map_err(|e| bad(format!("{name}: {e}")))?;
                    }
                    T::Symlink => {
                        let target = entry.link_name().map_err(|e| bad(e.to_string()))?.ok_or_else(|| unsafe_member(&name, "link without a target".into()))?;
                        check_link(&rel, &target).map_err(|d| unsafe_member(&name, d))?;
                        mkparent(&out)?;
                        std::os::unix::fs::symlink(&target, &out).map_err(|e| wio(&out, e))?;
                    }
                    T::Link => {
                        let target = entry.link_name().map_err(|e| bad(e.to_string()))?.ok_or_else(|| unsafe_member(&name, "link without a target".into()))?;
                        let t = safe_relative(&target.to_string_lossy()).map_err(|d| unsafe_member(&name, format!("hard link: {d}")))?;
                        mkparent(&out)?;
                        std::fs::copy(into.join(&t), &out).map_err(|e| wio(&out, e))?;
                    }
                    other => return Err(unsafe_member(&name, format!("unsupported entry type {other:?} (device, fifo, ...)"))),
                }
                count += 1;
            }
        }
        "zip" => {
            let mut z = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| bad(e.to_string()))?;
            for i in 0..z.len() {
                let mut m = z.by_index(i).map_err(|e| bad(e.to_string()))?;
                let name = m.name().to_string();
                let rel = safe_relative(&name).map_err(|d| unsafe_member(&name, d))?;
                let out = into.join(&rel);
                if m.is_dir() {
                    std::fs::create_dir_all(&out).map_err(|e| wio(&out, e))?;
                } else if m.is_symlink() {
                    let mut target = String::new();
                    m.read_to_string(&mut target).map_err(|e| bad(format!("{name}: {e}")))?;
                    check_link(&rel, Path::new(&target)).map_err(|d| unsafe_member(&name, d))?;
                    mkparent(&out)?;
                    std::os::unix::fs::symlink(&target, &out).map_err(|e| wio(&out, e))?;
                } else {
                    mkparent(&out)?;
                    let mut w = File::create(&out).map_err(|e| wio(&out, e))?;
                    std::io::copy(&mut m, &mut w).map_err(|e| bad(format!("{name}: {e}")))?;
                }
                count += 1;
            }
        }
        other => return Err(bad(format!("unknown archive kind {other:?}"))),
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_names() {
        assert_eq!(safe_relative("a/./b.txt").unwrap(), PathBuf::from("a/b.txt"));
        assert!(safe_relative("../evil").is_err());
        assert!(safe_relative("a/../../evil").is_err());
        assert!(safe_relative("/etc/passwd").is_err());
        assert!(safe_relative("a\\..\\b").is_err());
        assert!(safe_relative("./").is_err());
    }

    #[test]
    fn links() {
        assert!(check_link(Path::new("a/link"), Path::new("../b")).is_ok());
        assert!(check_link(Path::new("a/link"), Path::new("../../b")).is_err());
        assert!(check_link(Path::new("link"), Path::new("/etc")).is_err());
        assert!(check_link(Path::new("link"), Path::new("x/../../y")).is_err());
    }

    #[test]
    fn content_range() {
        assert_eq!(parse_content_range("bytes 100-199/200"), Some((100, Some(200))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, None)));
        assert_eq!(parse_content_range("items 1-2/3"), None);
    }
}
