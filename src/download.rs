//! HTTP(S) downloads that resume, and safe extraction of archives, for `weights pull`.
//!
//! A download goes to `<file>.part` beside its destination. A second attempt asks for the rest
//! with `Range: bytes=N-`; a server that ignores the range (answers 200) restarts the file from
//! its first byte. The caller verifies the finished `.part` and renames it into place, so the
//! destination only ever holds a complete, checked file. Network failures never delete
//! anything: the `.part` stays for the next attempt, and an existing file is not touched.
//!
//! Archives (tar.gz, zip) are extracted into a fresh folder the caller then renames into place.
//! No member is ever written through a link: members with absolute paths or `..` components,
//! members whose path passes through a link member (or a link on disk), device files and fifos
//! are refused; hard links may only copy a regular file the same archive wrote earlier; symbolic
//! links are created last, each checked to resolve inside the folder following the archive's
//! other links (a chain of links that each look harmless alone is judged as the kernel walks it).

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::progress::Reporter;

/// A blocking HTTP client with connect and read timeouts. It follows redirects itself so that
/// each hop gets its own proxy choice (Hugging Face redirects to another host), and trusts the
/// root store of `tls_config`.
pub struct Client {
    tls: Arc<rustls::ClientConfig>,
    proxies: Proxies,
    /// One agent per proxy (None: direct), made on first use.
    agents: Mutex<HashMap<Option<String>, ureq::Agent>>,
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

/// Redirects followed before giving up.
const MAX_REDIRECTS: usize = 10;

/// The TLS roots `weights pull` trusts: the bundled webpki roots, the platform's (through
/// rustls-native-certs, which reads $SSL_CERT_FILE/$SSL_CERT_DIR instead when they are set),
/// and the PEM certificates of $SSL_CERT_FILE and of every file in the folders of
/// $SSL_CERT_DIR (`:`-separated), as curl and pip take them. A variable that names nothing
/// usable is an error, not a silent fallback.
pub fn tls_config() -> Result<Arc<rustls::ClientConfig>> {
    use crate::env::EnvVars;
    use rustls_pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let unusable = |var: &str, path: &Path, detail: String| Error::Config {
        path: path.to_path_buf(),
        detail: format!("${var} names this, but {detail}"),
        hint: Some(format!("point ${var} at PEM certificates (`-----BEGIN CERTIFICATE-----`), e.g. your organisation's CA, or unset it")),
    };
    let pem_certs = |path: &Path| -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(path).map(|it| it.filter_map(|c| c.ok()).collect()).unwrap_or_default()
    };
    if let Some(file) = std::env::var_os(EnvVars::SSL_CERT_FILE).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(file);
        if let Err(e) = std::fs::metadata(&path) {
            return Err(unusable(EnvVars::SSL_CERT_FILE, &path, format!("it cannot be read: {e}")));
        }
        let (added, _) = roots.add_parsable_certificates(pem_certs(&path));
        if added == 0 {
            return Err(unusable(EnvVars::SSL_CERT_FILE, &path, "it holds no PEM certificate".into()));
        }
    }
    if let Some(dirs) = std::env::var_os(EnvVars::SSL_CERT_DIR).filter(|v| !v.is_empty()) {
        for dir in std::env::split_paths(&dirs) {
            let items = std::fs::read_dir(&dir).map_err(|e| unusable(EnvVars::SSL_CERT_DIR, &dir, format!("it cannot be read as a folder: {e}")))?;
            let mut added = 0;
            for item in items.flatten() {
                if item.path().is_file() {
                    added += roots.add_parsable_certificates(pem_certs(&item.path())).0;
                }
            }
            if added == 0 {
                return Err(unusable(EnvVars::SSL_CERT_DIR, &dir, "no file in it holds a PEM certificate".into()));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(rustls::crypto::ring::default_provider().into())
        .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
        .expect("ring supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The proxy settings of the environment: `https_proxy`/`HTTPS_PROXY` for https urls,
/// `http_proxy`/`HTTP_PROXY` for http, `all_proxy`/`ALL_PROXY` for either, and the hosts of
/// `no_proxy`/`NO_PROXY` reached directly (lowercase first, as curl).
#[derive(Debug, Clone, Default)]
pub struct Proxies {
    pub https: Option<String>,
    pub http: Option<String>,
    pub no_proxy: Vec<String>,
}

impl Proxies {
    pub fn from_env() -> Proxies {
        use crate::env::EnvVars as E;
        let var = |names: &[&str]| names.iter().find_map(|n| std::env::var(n).ok().filter(|v| !v.trim().is_empty()));
        let all = var(&[E::ALL_PROXY_LOWER, E::ALL_PROXY]);
        Proxies {
            https: var(&[E::HTTPS_PROXY_LOWER, E::HTTPS_PROXY]).or(all.clone()),
            http: var(&[E::HTTP_PROXY_LOWER, E::HTTP_PROXY]).or(all),
            no_proxy: var(&[E::NO_PROXY_LOWER, E::NO_PROXY]).map(|v| v.split(',').map(|r| r.trim().to_string()).filter(|r| !r.is_empty()).collect()).unwrap_or_default(),
        }
    }

    /// The proxy for one url, or None to connect directly.
    pub fn for_url(&self, url: &url::Url) -> Option<&str> {
        let proxy = match url.scheme() {
            "https" => self.https.as_deref(),
            "http" => self.http.as_deref(),
            _ => None,
        }?;
        let host = url.host_str().unwrap_or_default();
        let port = url.port_or_known_default().unwrap_or(0);
        (!self.no_proxy.iter().any(|rule| no_proxy_matches(rule, host, port))).then_some(proxy)
    }
}

/// Whether one `NO_PROXY` rule covers `host:port`: `*`; a host name and its subdomains
/// (`example.org`, `.example.org`, `*.example.org`); an IP address; an IPv4/IPv6 network
/// (`10.0.0.0/8`); each optionally with `:port`.
fn no_proxy_matches(rule: &str, host: &str, port: u16) -> bool {
    use std::net::IpAddr;
    let rule = rule.trim().to_ascii_lowercase();
    let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    if rule == "*" {
        return true;
    }
    let (name, rule_port) = match rule.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || h.ends_with(']') => (h.trim_start_matches('[').trim_end_matches(']').to_string(), p.parse::<u16>().ok()),
        _ => (rule.trim_start_matches('[').trim_end_matches(']').to_string(), None),
    };
    if rule_port.is_some_and(|p| p != port) {
        return false;
    }
    if let Some((net, bits)) = name.split_once('/') {
        let (Ok(net), Ok(bits), Ok(ip)) = (net.parse::<IpAddr>(), bits.parse::<u32>(), host.parse::<IpAddr>()) else { return false };
        return match (net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) if bits <= 32 => bits == 0 || (u32::from(n) ^ u32::from(a)) >> (32 - bits) == 0,
            (IpAddr::V6(n), IpAddr::V6(a)) if bits <= 128 => bits == 0 || (u128::from(n) ^ u128::from(a)) >> (128 - bits) == 0,
            _ => false,
        };
    }
    let name = name.trim_start_matches("*.").trim_start_matches('.');
    !name.is_empty() && (host == name || host.ends_with(&format!(".{name}")))
}

impl Client {
    pub fn new(timeout: Duration) -> Result<Client> {
        Ok(Client { tls: tls_config()?, proxies: Proxies::from_env(), agents: Mutex::new(HashMap::new()), timeout })
    }

    fn agent(&self, proxy: Option<&str>) -> Result<ureq::Agent> {
        let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = agents.get(&proxy.map(String::from)) {
            return Ok(a.clone());
        }
        let mut b = ureq::AgentBuilder::new()
            .timeout_connect(self.timeout)
            .timeout_read(self.timeout)
            .timeout_write(self.timeout)
            .redirects(0)
            .tls_config(self.tls.clone())
            .user_agent(concat!("scfoundry/", env!("CARGO_PKG_VERSION")));
        if let Some(p) = proxy {
            let parsed = ureq::Proxy::new(p).map_err(|e| Error::BadOption {
                option: "the proxy variable (HTTPS_PROXY, HTTP_PROXY or ALL_PROXY)".into(),
                detail: format!("{p:?}: {e}"),
                hint: Some("give the proxy as http://host:port (or http://user:password@host:port)".into()),
            })?;
            b = b.proxy(parsed);
        }
        let a = b.build();
        agents.insert(proxy.map(String::from), a.clone());
        Ok(a)
    }

    /// GET `url` (with `Range: bytes=have-` when resuming), following redirects hop by hop,
    /// each through the proxy its own url calls for.
    fn get(&self, id: &str, url: &str, have: u64) -> Result<std::result::Result<ureq::Response, ureq::Error>> {
        let bad_url = |detail: String| Error::Download { id: id.into(), detail, hint: Some("check the entry's url in weights.toml (or the manifest in $SCFOUNDRY_MANIFEST)".into()) };
        let mut at = url::Url::parse(url).map_err(|e| bad_url(format!("{url} is not a url: {e}")))?;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent(self.proxies.for_url(&at))?.request_url("GET", &at);
            if have > 0 {
                req = req.set("Range", &format!("bytes={have}-"));
            }
            let resp = match req.call() {
                Ok(r) if (300..400).contains(&r.status()) => r,
                other => return Ok(other),
            };
            let Some(location) = resp.header("Location") else { return Ok(Ok(resp)) };
            at = at.join(location).map_err(|e| bad_url(format!("{at} redirects to {location:?}, which is not a url: {e}")))?;
        }
        Err(Error::Download { id: id.into(), detail: format!("{url} redirects more than {MAX_REDIRECTS} times"), hint: Some("the server is misconfigured; try again later".into()) })
    }

    fn transport_error(&self, id: &str, url: &str, part: &Path, have: u64, t: &dyn std::fmt::Display) -> Error {
        let text = t.to_string();
        let low = text.to_lowercase();
        if let Some(cause) = certificate_cause(&text) {
            use crate::env::EnvVars;
            return Error::Network {
                id: id.into(),
                url: url.into(),
                detail: format!("the server's TLS certificate was refused: {cause}: {text}"),
                hint: format!(
                    "scfoundry trusts its bundled roots, the system's, ${} (a PEM file) and ${} (a folder of PEM files); behind a TLS-inspecting proxy set {} to the proxy's CA certificate (the one curl or pip are given), then run the same command again; nothing was deleted",
                    EnvVars::SSL_CERT_FILE,
                    EnvVars::SSL_CERT_DIR,
                    EnvVars::SSL_CERT_FILE
                ),
            };
        }
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
        let resp = match self.get(id, url, have)? {
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

/// What a TLS failure says about the server's certificate, in words, if it is about that.
fn certificate_cause(text: &str) -> Option<&'static str> {
    if !text.contains("certificate") {
        return None;
    }
    Some(if text.contains("UnknownIssuer") {
        "it is not signed by an authority scfoundry trusts (UnknownIssuer)"
    } else if text.contains("Expired") {
        "it has expired (or the clock is wrong)"
    } else if text.contains("NotValidForName") {
        "it was issued for another host name"
    } else if text.contains("Revoked") {
        "it was revoked"
    } else {
        "it is not valid"
    })
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

/// Where a link at `rel` pointing to `target` leads, relative to the folder, following the
/// archive's other links on the way (as the kernel will once they exist). Lexical: nothing on
/// disk is read. An error when the path leaves the folder, is absolute, or loops.
pub fn resolve_link(links: &HashMap<PathBuf, PathBuf>, rel: &Path, target: &Path) -> std::result::Result<PathBuf, String> {
    let mut out: Vec<OsString> = rel.parent().map(|p| p.components().map(|c| c.as_os_str().to_owned()).collect()).unwrap_or_default();
    // components still to walk, last first
    let mut pending: Vec<Component> = target.components().rev().collect();
    let mut hops = 0;
    if target.is_absolute() {
        return Err(format!("link to the absolute path {}", target.display()));
    }
    while let Some(c) = pending.pop() {
        match c {
            Component::Normal(n) => {
                out.push(n.to_owned());
                let here: PathBuf = out.iter().collect();
                if let Some(next) = links.get(&here) {
                    hops += 1;
                    if hops > 40 {
                        return Err(format!("link to {}: a loop of links", target.display()));
                    }
                    if next.is_absolute() {
                        return Err(format!("link to {}, which goes through {} to the absolute path {}", target.display(), here.display(), next.display()));
                    }
                    out.pop();
                    pending.extend(next.components().rev());
                }
            }
            Component::CurDir => {}
            Component::ParentDir => {
                if out.pop().is_none() {
                    return Err(format!("link to {}, outside the folder", target.display()));
                }
            }
            Component::RootDir | Component::Prefix(_) => return Err(format!("link to the absolute path {}", target.display())),
        }
    }
    Ok(out.iter().collect())
}

/// One extraction into a fresh folder: folders and regular files are written as they come,
/// never through a link; hard links copy a regular file this archive wrote earlier; symbolic
/// links are checked and created last, once nothing more is written through them.
struct Extraction<'a> {
    archive: &'a Path,
    into: &'a Path,
    /// Regular files written, relative to `into`.
    files: HashSet<PathBuf>,
    /// Symbolic link members (path -> target), in archive order.
    links: HashMap<PathBuf, PathBuf>,
    link_order: Vec<(String, PathBuf)>,
    count: usize,
}

impl Extraction<'_> {
    fn refuse(&self, member: &str, detail: String) -> Error {
        Error::UnsafeArchive { archive: self.archive.to_path_buf(), member: member.into(), detail }
    }

    fn io(p: &Path, e: std::io::Error) -> Error {
        Error::Io { path: p.to_path_buf(), source: e }
    }

    /// Refuse a member whose path is, or passes through, a link member or a link on disk.
    fn check_path(&self, member: &str, rel: &Path) -> Result<()> {
        let mut p = PathBuf::new();
        for c in rel.components() {
            p.push(c);
            if self.links.contains_key(&p) {
                let what = if p == rel { "has the name of an earlier link member" } else { "passes through the link member" };
                return Err(self.refuse(member, format!("{what} {}", p.display())));
            }
            if std::fs::symlink_metadata(self.into.join(&p)).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(self.refuse(member, format!("passes through the symbolic link {} on disk", p.display())));
            }
        }
        Ok(())
    }

    fn dir(&mut self, member: &str, rel: &Path) -> Result<()> {
        self.check_path(member, rel)?;
        let out = self.into.join(rel);
        std::fs::create_dir_all(&out).map_err(|e| Self::io(&out, e))?;
        self.count += 1;
        Ok(())
    }

    /// A new regular file at `rel` (its folders made first), never opened through a link.
    fn create(&self, member: &str, rel: &Path) -> Result<File> {
        use std::os::unix::fs::OpenOptionsExt;
        self.check_path(member, rel)?;
        let out = self.into.join(rel);
        if let Some(d) = out.parent() {
            std::fs::create_dir_all(d).map_err(|e| Self::io(d, e))?;
        }
        OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_NOFOLLOW).open(&out).map_err(|e| Self::io(&out, e))
    }

    fn file(&mut self, member: &str, rel: &Path, data: &mut dyn Read) -> Result<()> {
        let mut w = self.create(member, rel)?;
        std::io::copy(data, &mut w).map_err(|e| Error::Download {
            id: self.archive.display().to_string(),
            detail: format!("cannot be read: {member}: {e}"),
            hint: Some("the archive is damaged or not what weights.toml says; `scfoundry weights verify` checks it".into()),
        })?;
        self.files.insert(rel.to_path_buf());
        self.count += 1;
        Ok(())
    }

    /// A hard link member: a copy of a regular file written earlier from this archive.
    fn hard_link(&mut self, member: &str, rel: &Path, target: &Path) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let t = safe_relative(&target.to_string_lossy()).map_err(|d| self.refuse(member, format!("hard link: {d}")))?;
        if !self.files.contains(&t) {
            return Err(self.refuse(member, format!("hard link to {}, which is not a regular file extracted earlier from this archive", t.display())));
        }
        let src = self.into.join(&t);
        let mut r = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&src).map_err(|e| Self::io(&src, e))?;
        self.file(member, rel, &mut r)
    }

    /// A symbolic link member: recorded now, created by `finish`.
    fn symlink(&mut self, member: &str, rel: &Path, target: &Path) -> Result<()> {
        self.check_path(member, rel)?;
        if target.is_absolute() {
            return Err(self.refuse(member, format!("link to the absolute path {}", target.display())));
        }
        if self.files.contains(rel) {
            return Err(self.refuse(member, "a link over a file of the same archive".into()));
        }
        self.links.insert(rel.to_path_buf(), target.to_path_buf());
        self.link_order.push((member.to_string(), rel.to_path_buf()));
        Ok(())
    }

    /// Create the links, each checked to resolve inside the folder through all the others.
    fn finish(mut self) -> Result<usize> {
        for (member, rel) in std::mem::take(&mut self.link_order) {
            let target = &self.links[&rel];
            resolve_link(&self.links, &rel, target).map_err(|d| self.refuse(&member, d))?;
            let out = self.into.join(&rel);
            if std::fs::symlink_metadata(&out).is_ok() {
                return Err(self.refuse(&member, format!("a link over {}, which the archive also writes", rel.display())));
            }
            if let Some(d) = out.parent() {
                std::fs::create_dir_all(d).map_err(|e| Self::io(d, e))?;
            }
            std::os::unix::fs::symlink(target, &out).map_err(|e| Self::io(&out, e))?;
            self.count += 1;
        }
        Ok(self.count)
    }
}

/// Extract `archive` ("tar.gz" or "zip") into the folder `into` (which should be new and empty).
/// Refuses the whole archive at its first unsafe member. Returns the number of members.
pub fn extract(kind: &str, archive: &Path, into: &Path) -> Result<usize> {
    let bad = |detail: String| Error::Download {
        id: archive.display().to_string(),
        detail: format!("cannot be read as {kind}: {detail}"),
        hint: Some("the archive is damaged or not what weights.toml says; `scfoundry weights verify` checks it".into()),
    };
    let f = File::open(archive).map_err(|e| Error::Io { path: archive.to_path_buf(), source: e })?;
    let mut x = Extraction { archive, into, files: HashSet::new(), links: HashMap::new(), link_order: Vec::new(), count: 0 };
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
                let rel = safe_relative(&name).map_err(|d| x.refuse(&name, d))?;
                let link_target = || -> Result<PathBuf> {
                    entry.link_name().map_err(|e| bad(e.to_string()))?.map(|t| t.into_owned()).ok_or_else(|| x.refuse(&name, "link without a target".into()))
                };
                match ty {
                    T::Directory => x.dir(&name, &rel)?,
                    T::Regular | T::Continuous => x.file(&name, &rel, &mut entry)?,
                    T::Symlink => {
                        let t = link_target()?;
                        x.symlink(&name, &rel, &t)?
                    }
                    T::Link => {
                        let t = link_target()?;
                        x.hard_link(&name, &rel, &t)?
                    }
                    T::Char | T::Block | T::Fifo => return Err(x.refuse(&name, format!("a device file or fifo ({ty:?})"))),
                    other => return Err(x.refuse(&name, format!("unsupported entry type {other:?}"))),
                }
            }
        }
        "zip" => {
            let mut z = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| bad(e.to_string()))?;
            for i in 0..z.len() {
                let mut m = z.by_index(i).map_err(|e| bad(e.to_string()))?;
                let name = m.name().to_string();
                let rel = safe_relative(&name).map_err(|d| x.refuse(&name, d))?;
                let kind = m.unix_mode().map(|mode| mode & libc::S_IFMT).filter(|&t| t != 0);
                if m.is_dir() {
                    x.dir(&name, &rel)?;
                } else if m.is_symlink() {
                    let mut target = String::new();
                    m.read_to_string(&mut target).map_err(|e| bad(format!("{name}: {e}")))?;
                    x.symlink(&name, &rel, Path::new(&target))?;
                } else if kind.is_none_or(|t| t == libc::S_IFREG) {
                    x.file(&name, &rel, &mut m)?;
                } else {
                    return Err(x.refuse(&name, format!("a device file, fifo or socket (mode {:o})", m.unix_mode().unwrap_or(0))));
                }
            }
        }
        other => return Err(bad(format!("unknown archive kind {other:?}"))),
    }
    x.finish()
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
        let none = HashMap::new();
        let check = |links: &HashMap<PathBuf, PathBuf>, rel: &str, t: &str| resolve_link(links, Path::new(rel), Path::new(t));
        assert_eq!(check(&none, "a/link", "../b").unwrap(), PathBuf::from("b"));
        assert!(check(&none, "a/link", "../../b").is_err());
        assert!(check(&none, "link", "/etc").is_err());
        assert!(check(&none, "link", "x/../../y").is_err());
        // the chain of the security review: each link alone stays inside, together they leave
        let mut chain = HashMap::new();
        chain.insert(PathBuf::from("m/a/b/c/d/up"), PathBuf::from("../../../.."));
        chain.insert(PathBuf::from("m/a/b/c/d/up2"), PathBuf::from("up/../../../.."));
        assert_eq!(check(&chain, "m/a/b/c/d/up", "../../../..").unwrap(), PathBuf::from("m"));
        assert!(check(&chain, "m/a/b/c/d/up2", "up/../../../..").unwrap_err().contains("outside the folder"));
        let mut ring = HashMap::new();
        ring.insert(PathBuf::from("x"), PathBuf::from("y"));
        ring.insert(PathBuf::from("y"), PathBuf::from("x"));
        assert!(check(&ring, "x", "y").unwrap_err().contains("loop"));
    }

    #[test]
    fn no_proxy_rules() {
        assert!(no_proxy_matches("*", "huggingface.co", 443));
        assert!(no_proxy_matches("example.org", "cdn.example.org", 443));
        assert!(no_proxy_matches(".example.org", "example.org", 443));
        assert!(no_proxy_matches("*.example.org", "a.b.example.org", 80));
        assert!(!no_proxy_matches("example.org", "badexample.org", 443));
        assert!(no_proxy_matches("127.0.0.1", "127.0.0.1", 8443));
        assert!(no_proxy_matches("127.0.0.1:8443", "127.0.0.1", 8443));
        assert!(!no_proxy_matches("127.0.0.1:8443", "127.0.0.1", 9000));
        assert!(no_proxy_matches("10.0.0.0/8", "10.2.3.4", 443));
        assert!(!no_proxy_matches("10.0.0.0/8", "11.2.3.4", 443));
        assert!(no_proxy_matches("::1", "[::1]", 443));
        let p = Proxies { https: Some("http://proxy:3128".into()), http: None, no_proxy: vec!["localhost".into()] };
        assert_eq!(p.for_url(&url::Url::parse("https://huggingface.co/x").unwrap()), Some("http://proxy:3128"));
        assert_eq!(p.for_url(&url::Url::parse("https://localhost:8443/x").unwrap()), None);
        assert_eq!(p.for_url(&url::Url::parse("http://huggingface.co/x").unwrap()), None);
    }

    #[test]
    fn content_range() {
        assert_eq!(parse_content_range("bytes 100-199/200"), Some((100, Some(200))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, None)));
        assert_eq!(parse_content_range("items 1-2/3"), None);
    }
}
