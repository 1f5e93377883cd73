//! The pinned weights manifest (`weights.toml`, compiled in) and checks of the weights folder.
//!
//! Layout: `<weights dir>/<entry.file>`. A verified file gets a stamp in
//! `<weights dir>/.verified/<id>.json` (size, mtime, sha256), so `weights list` need not
//! hash multi-gigabyte files every time. Nothing here ever deletes a file; downloads live in
//! `download.rs`.
//!
//! `$SCFOUNDRY_MANIFEST` names a manifest file to use instead of the compiled-in one (tests
//! point it at a loopback server; a mirror can list the same entries with its own urls).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

pub static MANIFEST_TEXT: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/weights.toml"));

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub method: String,
    pub file: String,
    pub url: String,
    pub revision: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub sha256: Option<String>,
    pub licence: String,
    #[serde(default)]
    pub archive: Option<String>,
    /// For a member of another entry's archive (same `url`): its path inside the archive.
    #[serde(default)]
    pub member: Option<String>,
    #[serde(default)]
    pub note: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    /// Where upstream's repository keeps the file when that is not a tail of `file` (CellFM's
    /// `csv/gene_info.csv`): a folder laid out as upstream's is searched for it there too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_path: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
pub struct Manifest {
    #[serde(default)]
    pub weights: BTreeMap<String, Entry>,
}

impl Manifest {
    pub fn builtin() -> Manifest {
        parse_manifest(MANIFEST_TEXT).unwrap_or_else(|e| panic!("weights.toml: {e}"))
    }

    /// The manifest in effect: `$SCFOUNDRY_MANIFEST` if set (tests, mirrors), else the built-in.
    pub fn load() -> Result<Manifest> {
        let Some(p) = std::env::var_os(crate::env::EnvVars::MANIFEST) else { return Ok(Manifest::builtin()) };
        let path = PathBuf::from(p);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
        parse_manifest(&text).map_err(|detail| Error::Config {
            path,
            detail,
            hint: Some(format!("${} names this manifest; unset it to use the built-in weights.toml", crate::env::EnvVars::MANIFEST)),
        })
    }

    /// The archive entry that `id` is a member of (same url, `archive` set), if any.
    pub fn archive_of(&self, id: &str) -> Option<&str> {
        let e = self.weights.get(id)?;
        if e.archive.is_some() {
            return None;
        }
        self.weights.iter().find(|(_, a)| a.archive.is_some() && a.url == e.url).map(|(aid, _)| aid.as_str())
    }

    /// The member entries of an archive entry.
    pub fn members_of(&self, archive_id: &str) -> Vec<&str> {
        let Some(a) = self.weights.get(archive_id) else { return vec![] };
        self.weights.iter().filter(|(id, e)| *id != archive_id && e.archive.is_none() && e.url == a.url).map(|(id, _)| id.as_str()).collect()
    }

    /// Where each of `ids`' files is in a folder laid out as upstream releases it: the longest
    /// tail of the entry's path (`a/b/c.json`, `b/c.json`, `c.json`) that the folder holds, else
    /// its `upstream_path`. Two entries on one file keep the longer tail (so
    /// `1_Pooling/config.json` never stands in for `config.json`). Returns (id, path inside the
    /// folder) for those found, and the absent.
    pub fn find_in_folder<S: AsRef<str>>(&self, ids: &[S], dir: &Path) -> (Vec<(String, String)>, Vec<String>) {
        let mut found: Vec<(String, String, usize)> = Vec::new();
        let mut absent = Vec::new();
        for id in ids.iter().map(AsRef::as_ref) {
            let Some(e) = self.weights.get(id) else {
                absent.push(id.to_string());
                continue;
            };
            let parts: Vec<&str> = e.file.split('/').collect();
            let upstream = e.upstream_path.iter().map(|p| (p.clone(), p.split('/').count()));
            match (0..parts.len()).map(|k| (parts[k..].join("/"), parts.len() - k)).chain(upstream).find(|(tail, _)| dir.join(tail).is_file()) {
                Some((tail, n)) => found.push((id.to_string(), tail, n)),
                None => absent.push(id.to_string()),
            }
        }
        let mut keep = Vec::new();
        for (id, tail, n) in &found {
            if found.iter().any(|(_, t, m)| t == tail && m > n) {
                absent.push(id.clone());
            } else {
                keep.push((id.clone(), tail.clone()));
            }
        }
        (keep, absent)
    }

    /// What upstream calls an entry's file, for errors: its description, else the first
    /// sentence of its note.
    pub fn what_is(&self, id: &str) -> String {
        let Some(e) = self.weights.get(id) else { return id.to_string() };
        let text = e.description.clone().or_else(|| e.note.clone()).unwrap_or_default();
        let first = text.split(". ").next().unwrap_or_default().trim_end_matches('.');
        let short: String = first.chars().take(160).collect();
        if short.is_empty() { format!("entry {id}") } else { format!("entry {id}: {short}{}", if first.chars().count() > 160 { "..." } else { "" }) }
    }

    /// Entry ids for a name: a method (all its entries) or an entry id.
    pub fn resolve(&self, name: &str) -> Vec<&str> {
        self.weights.iter().filter(|(id, e)| *id == name || e.method == name).map(|(id, _)| id.as_str()).collect()
    }
}

pub fn parse_manifest(text: &str) -> std::result::Result<Manifest, String> {
    let m: Manifest = toml::from_str(text).map_err(|e| e.to_string())?;
    for (id, e) in &m.weights {
        if let Some(s) = &e.sha256 {
            if s.len() != 64 || !s.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(format!("weights.{id}.sha256 is not 64 hex digits"));
            }
        }
        if e.file.starts_with('/') || e.file.split('/').any(|c| c == "..") {
            return Err(format!("weights.{id}.file must be a relative path inside the weights folder"));
        }
        if let Some(a) = &e.archive {
            if a != "tar.gz" && a != "zip" {
                return Err(format!("weights.{id}.archive must be \"tar.gz\" or \"zip\""));
            }
        }
    }
    for (id, e) in &m.weights {
        let is_member = e.archive.is_none() && m.weights.values().any(|a| a.archive.is_some() && a.url == e.url);
        if is_member && e.member.is_none() {
            return Err(format!("weights.{id} has an archive's url but no `member` (its path inside the archive)"));
        }
        if !is_member && e.member.is_some() {
            return Err(format!("weights.{id}.member is set but no entry with `archive` has its url"));
        }
    }
    Ok(m)
}

/// What we know about one entry in a weights folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    Missing,
    /// Present, size as pinned (or no pinned size), not yet hashed.
    Present,
    /// Present and its sha256 matches the pin (weights.toml's, or the folder's local pin).
    Verified,
    /// Present, no pinned sha256 to check against.
    Unpinned,
    WrongSize { expected: u64, found: u64 },
    WrongHash { expected: String, found: String },
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Status::Missing => write!(f, "missing"),
            Status::Present => write!(f, "present (not verified)"),
            Status::Verified => write!(f, "verified"),
            Status::Unpinned => write!(f, "present (no sha256 pinned)"),
            Status::WrongSize { expected, found } => write!(f, "WRONG SIZE ({found} bytes, expected {expected})"),
            Status::WrongHash { .. } => write!(f, "WRONG SHA256"),
        }
    }
}

/// Record that `path` (entry `id`) was hashed: later checks of the same size and mtime are cheap.
/// Failing to write a stamp is not an error (read-only shared folders).
pub fn write_stamp(dir: &Path, id: &str, path: &Path, sha256: &str) {
    let Ok(meta) = std::fs::metadata(path) else { return };
    let stamp = Stamp { size: meta.len(), mtime_ns: mtime_ns(&meta), sha256: sha256.to_string() };
    let stamp_path = dir.join(".verified").join(format!("{id}.json"));
    if std::fs::create_dir_all(stamp_path.parent().unwrap()).is_ok() {
        let _ = std::fs::write(&stamp_path, serde_json::to_string(&stamp).unwrap());
    }
}

/// The sha256 recorded in an entry's stamp, if the stamp matches the file's size and mtime
/// (for unpinned entries, whose sha256 was computed at download).
pub fn stamped_sha256(dir: &Path, id: &str, path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    let text = std::fs::read_to_string(dir.join(".verified").join(format!("{id}.json"))).ok()?;
    let s: Stamp = serde_json::from_str(&text).ok()?;
    (s.size == meta.len() && s.mtime_ns == mtime_ns(&meta)).then_some(s.sha256)
}

#[derive(Debug, Serialize, Deserialize)]
struct Stamp {
    size: u64,
    mtime_ns: i128,
    sha256: String,
}

fn mtime_ns(meta: &std::fs::Metadata) -> i128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

/// The file of local pins in a weights folder (see `LocalPins`).
pub const LOCAL_PINS_FILE: &str = "local-pins.toml";

/// A sha256 this weights folder trusts for an entry that weights.toml does not pin: the hash of
/// the first download (trust on first use), or of a file a user brought in by hand.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LocalPin {
    pub sha256: String,
    pub size: u64,
    /// Where the bytes came from (the url, or the file imported).
    pub source: String,
    /// When the pin was recorded (RFC 3339).
    pub pinned_at: String,
}

/// `<weights dir>/local-pins.toml`: one `[pins."<id>"]` table per locally pinned entry. It lives
/// in the weights folder because the pins describe its files, whichever workspace uses them.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LocalPins {
    #[serde(default)]
    pub pins: BTreeMap<String, LocalPin>,
}

impl LocalPins {
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(LOCAL_PINS_FILE)
    }

    /// The pins of a weights folder (none when the file does not exist).
    pub fn load(dir: &Path) -> Result<LocalPins> {
        let path = LocalPins::path(dir);
        match std::fs::read_to_string(&path) {
            Ok(text) => toml::from_str(&text).map_err(|e| Error::Config {
                path: path.clone(),
                detail: e.message().to_string(),
                hint: Some("this file holds the sha256 of unpinned weights as first downloaded; fix or delete the broken table (its entries are then trusted again on their next download)".into()),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(LocalPins::default()),
            Err(e) => Err(Error::Io { path, source: e }),
        }
    }

    pub fn get(&self, id: &str) -> Option<&LocalPin> {
        self.pins.get(id)
    }

    /// Record (or replace) the pin of `id` and write the file (a temporary file renamed over it).
    pub fn record(dir: &Path, id: &str, pin: LocalPin) -> Result<()> {
        let mut pins = LocalPins::load(dir)?;
        pins.pins.insert(id.to_string(), pin);
        let path = LocalPins::path(dir);
        let io = |e: std::io::Error| Error::Io { path: path.clone(), source: e };
        let text = format!(
            "# sha256 of weights that weights.toml does not pin, trusted on first download (or import).\n# A later download that differs is refused; `scfoundry weights pull --repin ID` accepts a new one.\n{}",
            toml::to_string(&pins).expect("pins serialise")
        );
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
        std::io::Write::write_all(&mut tmp, text.as_bytes()).map_err(io)?;
        tmp.persist(&path).map_err(|e| io(e.error))?;
        Ok(())
    }
}

/// The sha256 an entry is held to: weights.toml's, else this folder's local pin.
pub fn pinned_sha256(dir: &Path, id: &str, e: &Entry) -> Result<Option<String>> {
    if let Some(s) = &e.sha256 {
        return Ok(Some(s.clone()));
    }
    Ok(LocalPins::load(dir)?.get(id).map(|p| p.sha256.clone()))
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path, mut progress: impl FnMut(u64)) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::Io { path: path.into(), source: e })?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        progress(n as u64);
    }
    Ok(hex::encode(h.finalize()))
}

/// Check one entry. With `hash`, a present file without a current stamp is hashed
/// (and stamped when it matches).
pub fn check(dir: &Path, id: &str, e: &Entry, hash: bool, progress: impl FnMut(u64)) -> Result<Status> {
    let path = dir.join(&e.file);
    let meta = match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => m,
        _ => return Ok(Status::Missing),
    };
    if let Some(expected) = e.size {
        if meta.len() != expected {
            return Ok(Status::WrongSize { expected, found: meta.len() });
        }
    }
    let Some(pinned) = &pinned_sha256(dir, id, e)? else { return Ok(Status::Unpinned) };
    let stamp_path = dir.join(".verified").join(format!("{id}.json"));
    if let Ok(text) = std::fs::read_to_string(&stamp_path) {
        if let Ok(s) = serde_json::from_str::<Stamp>(&text) {
            if s.size == meta.len() && s.mtime_ns == mtime_ns(&meta) && &s.sha256 == pinned {
                return Ok(Status::Verified);
            }
        }
    }
    if !hash {
        return Ok(Status::Present);
    }
    let found = sha256_file(&path, progress)?;
    if &found != pinned {
        return Ok(Status::WrongHash { expected: pinned.clone(), found });
    }
    write_stamp(dir, id, &path, &found);
    Ok(Status::Verified)
}


/// How an entry's url is fetched: `weights pull` downloads a direct link; a share page
/// (Google Drive, Dropbox, SharePoint, WeChat Drive) or a repository page (a Hugging Face
/// `tree/` view, a GitHub repository) is opened in a browser, and the file brought in with
/// `scfoundry weights import`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetch {
    Direct,
    SharePage,
    RepositoryPage,
}

impl Fetch {
    pub fn of(url: &str) -> Fetch {
        let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        let host = host.to_ascii_lowercase();
        let share = ["drive.google.com", "docs.google.com", "drive.weixin.qq.com", "www.dropbox.com", "dropbox.com"];
        if share.contains(&host.as_str()) || host.ends_with(".sharepoint.com") {
            return Fetch::SharePage;
        }
        if (host == "huggingface.co" && path.contains("/tree/")) || host == "github.com" {
            return Fetch::RepositoryPage;
        }
        Fetch::Direct
    }

    /// Whether `weights pull` can download it.
    pub fn pullable(self) -> bool {
        self == Fetch::Direct
    }

    pub fn label(self) -> &'static str {
        match self {
            Fetch::Direct => "pull",
            Fetch::SharePage => "by hand (share page)",
            Fetch::RepositoryPage => "by hand (repository page)",
        }
    }
}

/// Who pins an entry's sha256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// weights.toml carries its sha256.
    Manifest,
    /// The weights folder's `local-pins.toml` does (first download or import).
    Local,
    /// Nobody: whatever file is there is used as it is.
    Unpinned,
}

impl Pin {
    pub fn of(pins: &LocalPins, id: &str, e: &Entry) -> Pin {
        if e.sha256.is_some() {
            Pin::Manifest
        } else if pins.get(id).is_some() {
            Pin::Local
        } else {
            Pin::Unpinned
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Pin::Manifest => "pinned (weights.toml)",
            Pin::Local => "pinned locally",
            Pin::Unpinned => "unpinned",
        }
    }
}

/// A model folder as users download it: a Hugging Face cache entry (`models--ORG--NAME`,
/// resolved through `refs/main` to `snapshots/<rev>/`), or any other folder as it is (a
/// snapshot folder, an upstream release folder). `flag` names where the folder came from in
/// errors (`--model-dir`, `weights import`).
pub fn resolve_model_folder(dir: &Path, flag: &str) -> Result<PathBuf> {
    if !dir.is_dir() {
        return Err(Error::ModelDir {
            dir: dir.to_path_buf(),
            detail: format!("{flag}: not a folder"),
            hint: "pass the model's folder as downloaded: a Hugging Face snapshot (`models--ORG--NAME/snapshots/<rev>/`) or cache entry (`models--ORG--NAME`), or the upstream release folder".into(),
        });
    }
    let snapshots = dir.join("snapshots");
    if !snapshots.is_dir() {
        return Ok(dir.to_path_buf());
    }
    let revs: Vec<String> = std::fs::read_dir(&snapshots)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    let refs = dir.join("refs").join("main");
    let rev = match std::fs::read_to_string(&refs) {
        Ok(t) => t.trim().to_string(),
        Err(_) => {
            return Err(Error::ModelDir {
                dir: dir.to_path_buf(),
                detail: format!("{flag}: a Hugging Face cache entry without refs/main, so which of its snapshots is meant is unknown (snapshots: {})", if revs.is_empty() { "none".to_string() } else { revs.join(", ") }),
                hint: format!("pass the snapshot folder itself, e.g. {}", snapshots.join(revs.first().map(String::as_str).unwrap_or("<rev>")).display()),
            })
        }
    };
    let snap = snapshots.join(&rev);
    if rev.is_empty() || rev.contains('/') || !snap.is_dir() {
        return Err(Error::ModelDir {
            dir: dir.to_path_buf(),
            detail: format!("{flag}: refs/main names revision `{rev}`, but snapshots/{rev}/ is not there (snapshots: {})", if revs.is_empty() { "none".to_string() } else { revs.join(", ") }),
            hint: "download the model again (e.g. `huggingface-cli download ORG/NAME`), or pass one of the snapshot folders itself".into(),
        });
    }
    Ok(snap)
}

/// A file a method reads from a model folder: its path inside the folder and what upstream
/// calls it.
pub struct Needed<'a> {
    pub file: &'a str,
    pub upstream: &'a str,
}

/// Check that a model folder holds every file in `needed` (the first of each group of
/// alternatives, `a|b`, that is there); the error names the folder, the missing file and what
/// upstream calls it.
pub fn require_files(method: &str, flag: &str, dir: &Path, needed: &[Needed]) -> Result<()> {
    for n in needed {
        if n.file.split('|').any(|f| dir.join(f).is_file()) {
            continue;
        }
        let names = n.file.split('|').collect::<Vec<_>>().join(" or ");
        let cache_hint = std::fs::read_dir(dir)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.starts_with("models--")).collect::<Vec<_>>())
            .unwrap_or_default();
        let hint = if cache_hint.is_empty() {
            format!("{flag} must name the folder that holds {names} as upstream lays it out (`scfoundry methods show {method}` lists the files); a Hugging Face snapshot (`models--ORG--NAME/snapshots/<rev>/`) or cache entry (`models--ORG--NAME`) works as it is")
        } else {
            format!("this looks like a Hugging Face cache: pass one of its model folders, e.g. {}", dir.join(&cache_hint[0]).display())
        };
        return Err(Error::ModelDir { dir: dir.to_path_buf(), detail: format!("{flag} for {method} has no {names} ({})", n.upstream), hint });
    }
    Ok(())
}

/// The sha256 of each of `files` (paths inside `dir`, `a|b` for alternatives) that is there,
/// keyed by its path: the provenance of a run from a `--model-dir`.
pub fn folder_shas(dir: &Path, files: &[&str]) -> Result<serde_json::Map<String, serde_json::Value>> {
    let mut out = serde_json::Map::new();
    for f in files {
        if let Some(name) = f.split('|').find(|n| dir.join(n).is_file()) {
            out.insert(name.to_string(), serde_json::Value::String(sha256_file(&dir.join(name), |_| {})?));
        }
    }
    Ok(out)
}

pub use crate::settings::{cache_base, default_dir};

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(file: &str, content: &[u8]) -> Entry {
        Entry {
            method: "pca".into(),
            file: file.into(),
            url: "http://127.0.0.1/x".into(),
            revision: "test".into(),
            size: Some(content.len() as u64),
            sha256: Some(hex::encode(Sha256::digest(content))),
            licence: "MIT".into(),
            archive: None,
            member: None,
            note: None,
            description: None,
            upstream_path: None,
        }
    }

    #[test]
    fn statuses() {
        let dir = tempfile::tempdir().unwrap();
        let e = entry("m/model.bin", b"weights!");
        assert_eq!(check(dir.path(), "a", &e, true, |_| {}).unwrap(), Status::Missing);
        std::fs::create_dir_all(dir.path().join("m")).unwrap();
        std::fs::write(dir.path().join("m/model.bin"), b"weights!").unwrap();
        assert_eq!(check(dir.path(), "a", &e, false, |_| {}).unwrap(), Status::Present);
        assert_eq!(check(dir.path(), "a", &e, true, |_| {}).unwrap(), Status::Verified);
        // the stamp makes the next check cheap and still verified
        assert!(dir.path().join(".verified/a.json").exists());
        assert_eq!(check(dir.path(), "a", &e, false, |_| {}).unwrap(), Status::Verified);
        // same size, different content: the stale stamp must not hide it
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(dir.path().join("m/model.bin"), b"weights?").unwrap();
        assert!(matches!(check(dir.path(), "a", &e, true, |_| {}).unwrap(), Status::WrongHash { .. }));
        std::fs::write(dir.path().join("m/model.bin"), b"short").unwrap();
        assert!(matches!(check(dir.path(), "a", &e, true, |_| {}).unwrap(), Status::WrongSize { expected: 8, found: 5 }));
        // nothing was deleted
        assert!(dir.path().join("m/model.bin").exists());
    }

    #[test]
    fn manifest_rejects_escaping_paths_and_bad_hashes() {
        let bad = "[weights.x]\nmethod='pca'\nfile='../etc/passwd'\nurl='u'\nrevision='r'\nlicence='MIT'\n";
        assert!(parse_manifest(bad).unwrap_err().contains("relative path"));
        let bad = "[weights.x]\nmethod='pca'\nfile='a'\nurl='u'\nrevision='r'\nlicence='MIT'\nsha256='abc'\n";
        assert!(parse_manifest(bad).unwrap_err().contains("64 hex"));
    }
}
