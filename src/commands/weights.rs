//! `scfoundry weights list|verify|path|pull`: the pinned manifest against the weights folder,
//! and downloads into it (see `download.rs` for the transfer and the archive extraction).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::commands::ExitStatus;
use crate::download::Client;
use crate::error::{suggest, Error};
use crate::progress::{self, warn, Reporter};
use crate::settings::Settings;
use crate::weights::{check, sha256_file, write_stamp, Fetch, LocalPin, LocalPins, Manifest, Pin, Status};

fn size(n: Option<u64>) -> String {
    match n {
        None => "?".into(),
        Some(b) => crate::runner::trace::fmt_memory(b),
    }
}

/// `scfoundry weights list`: every entry of the manifest, present or missing, with who pins
/// its sha256 (weights.toml, this folder's local pins, or nobody), how it is fetched (`weights
/// pull`, or by hand from a share page and then `weights import`) and its state in the folder.
/// `markdown`: the manifest's table as docs/weights.md carries it (no folder state).
pub fn list(s: &Settings, method: Option<&str>, hash: bool, markdown: bool) -> anyhow::Result<ExitStatus> {
    if let Some(m) = method {
        s.registry.get(m)?;
    }
    let manifest = Manifest::load()?;
    if markdown {
        print!("{}", manifest_table(&manifest, method));
        return Ok(ExitStatus::Success);
    }
    println!("weights folder: {} (from {})", s.weights_dir.display(), s.weights_dir_source);
    let pins = LocalPins::load(&s.weights_dir)?;
    let mut rows = vec![["ID", "METHOD", "SIZE", "LICENCE", "SHA256", "GET", "STATUS"].map(String::from).to_vec()];
    for (id, e) in &manifest.weights {
        if method.is_some_and(|m| m != e.method) {
            continue;
        }
        let st = check(&s.weights_dir, id, e, hash, |_| {})?;
        let get = if Fetch::of(&e.url).pullable() { "pull" } else { "by hand" };
        rows.push(vec![id.clone(), e.method.clone(), size(e.size), e.licence.clone(), Pin::of(&pins, id, e).label().to_string(), get.to_string(), st.to_string()]);
    }
    if rows.len() == 1 {
        println!("(no entries{})", method.map(|m| format!(" for {m}")).unwrap_or_default());
        return Ok(ExitStatus::Success);
    }
    let widths: Vec<usize> = (0..rows[0].len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap()).collect();
    for r in &rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(s, w)| format!("{s:<w$}")).collect();
        println!("{}", line.join("  ").trim_end());
    }
    let by_hand = rows.iter().skip(1).filter(|r| r[5] == "by hand").count();
    if by_hand > 0 {
        println!("\n{by_hand} entr{} at a share or repository page that `weights pull` cannot fetch: download {} in a browser, then `scfoundry weights import NAME PATH` (docs/weights.md)", if by_hand == 1 { "y points" } else { "ies point" }, if by_hand == 1 { "it" } else { "each" });
    }
    Ok(ExitStatus::Success)
}

/// The manifest as a Markdown table (docs/weights.md's, between its markers): each entry's
/// method, id, file, whether weights.toml pins its sha256, and how to fetch it.
pub fn manifest_table(manifest: &Manifest, method: Option<&str>) -> String {
    let mut out = String::from("| method | entry | file | sha256 in weights.toml | how to get it |\n|---|---|---|---|---|\n");
    let mut entries: Vec<(&String, &crate::weights::Entry)> = manifest.weights.iter().filter(|(_, e)| method.is_none_or(|m| m == e.method)).collect();
    entries.sort_by(|a, b| (&a.1.method, a.0).cmp(&(&b.1.method, b.0)));
    for (id, e) in entries {
        let pinned = if e.sha256.is_some() { "yes" } else { "no: pinned locally at first pull or import" };
        let get = match Fetch::of(&e.url) {
            Fetch::Direct if manifest.archive_of(id).is_some() => format!("`weights pull` (from the archive `{}`)", manifest.archive_of(id).unwrap_or_default()),
            Fetch::Direct => "`weights pull`".to_string(),
            f @ (Fetch::SharePage | Fetch::RepositoryPage) => {
                let what = if f == Fetch::SharePage { "share page" } else { "repository page" };
                format!("by hand from the [{what}]({}), then `weights import`", e.url)
            }
        };
        out.push_str(&format!("| {} | `{id}` | `{}` | {pinned} | {get} |\n", e.method, e.file));
    }
    out
}

pub fn verify(s: &Settings, names: &[String]) -> anyhow::Result<ExitStatus> {
    let manifest = Manifest::load()?;
    let ids: Vec<String> = if names.is_empty() { manifest.weights.keys().cloned().collect() } else { resolve_ids(s, &manifest, names, "verify")? };
    let mut bad = 0;
    for id in &ids {
        let e = &manifest.weights[id];
        let st = check(&s.weights_dir, id, e, true, |_| {})?;
        if matches!(st, Status::WrongHash { .. } | Status::WrongSize { .. }) {
            bad += 1;
        }
        println!("{id}: {st}");
    }
    if bad > 0 {
        eprintln!("error: {bad} file(s) do not match weights.toml");
        eprintln!("hint: nothing was deleted; move the bad file(s) aside and run `scfoundry weights pull` for them (or pull with --force)");
        return Ok(ExitStatus::Failure);
    }
    Ok(ExitStatus::Success)
}

/// Entry ids for the names given (methods or entry ids), in manifest order, or a clear error.
pub(crate) fn resolve_ids(s: &Settings, manifest: &Manifest, names: &[String], what: &str) -> anyhow::Result<Vec<String>> {
    let mut ids: Vec<String> = Vec::new();
    for n in names {
        let matched = manifest.resolve(n);
        if matched.is_empty() {
            let known_method = s.registry.methods.contains_key(n.as_str());
            let cands = manifest.weights.keys().map(String::as_str).chain(s.registry.methods.keys().map(String::as_str));
            return Err(Error::BadOption {
                option: format!("weights {what}"),
                detail: if known_method { format!("method `{n}` needs no weights") } else { format!("`{n}` is neither a method with weights nor a weights entry") },
                hint: suggest(n, cands).filter(|_| !known_method).map(|x| format!("did you mean `{x}`?")).or(Some("`scfoundry weights list` shows the entries".into())),
            }
            .into());
        }
        for id in matched {
            if !ids.iter().any(|x| x == id) {
                ids.push(id.to_string());
            }
        }
    }
    Ok(ids)
}

/// `scfoundry weights path NAME...`: where each entry lives (or will live) in the weights folder.
pub fn path(s: &Settings, names: &[String]) -> anyhow::Result<ExitStatus> {
    let manifest = Manifest::load()?;
    for id in resolve_ids(s, &manifest, names, "path")? {
        println!("{}", s.weights_dir.join(&manifest.weights[&id].file).display());
    }
    Ok(ExitStatus::Success)
}

/// Options of `weights pull`.
pub struct PullOptions {
    pub force: bool,
    pub timeout: Duration,
    /// Refuse entries pinned neither in weights.toml nor in the folder's local pins.
    pub require_pinned: bool,
    /// Download again and replace the local pins of the entries named (a new upstream release).
    pub repin: bool,
}

/// `scfoundry weights pull NAME...`: download, verify and place the entries (resuming partial
/// downloads), extracting archives. Entries that fail are reported; the others still run.
pub fn pull(s: &Settings, names: &[String], opts: &PullOptions) -> anyhow::Result<ExitStatus> {
    let manifest = Manifest::load()?;
    let ids = resolve_ids(s, &manifest, names, "pull")?;
    // Members come from their archive: pull the archive once, then extract what is wanted.
    let mut plain: Vec<String> = Vec::new();
    let mut archives: Vec<(String, Vec<String>)> = Vec::new();
    for id in &ids {
        let (aid, member) = match manifest.archive_of(id) {
            Some(a) => (a.to_string(), Some(id.clone())),
            None if manifest.weights[id].archive.is_some() => (id.clone(), None),
            None => {
                plain.push(id.clone());
                continue;
            }
        };
        let slot = match archives.iter().position(|(a, _)| *a == aid) {
            Some(i) => i,
            None => {
                archives.push((aid, Vec::new()));
                archives.len() - 1
            }
        };
        if let Some(m) = member {
            archives[slot].1.push(m);
        }
    }
    if opts.require_pinned {
        let pins = LocalPins::load(&s.weights_dir)?;
        let downloads = plain.iter().chain(archives.iter().map(|(a, _)| a));
        let unpinned: Vec<&String> = downloads.filter(|id| manifest.weights[*id].sha256.is_none() && pins.get(id).is_none()).collect();
        if let Some(first) = unpinned.first() {
            let list: Vec<&str> = unpinned.iter().map(|i| i.as_str()).collect();
            return Err(Error::Download {
                id: (*first).clone(),
                detail: format!(
                    "--require-pinned: weights.toml pins no sha256 for {} and {} holds no local pin for it; nothing was downloaded",
                    list.join(", "),
                    LocalPins::path(&s.weights_dir).display()
                ),
                hint: Some("pull it once without --require-pinned where the network is trusted (its sha256 is then pinned locally), or add `sha256` to the manifest".into()),
            }
            .into());
        }
    }
    let rep = progress::for_settings(s.quiet, s.progress);
    let client = Client::new(opts.timeout)?;
    let puller = Puller { s, manifest: &manifest, client, force: opts.force || opts.repin, repin: opts.repin, rep: rep.as_ref() };
    std::fs::create_dir_all(&s.weights_dir).map_err(|e| Error::Io { path: s.weights_dir.clone(), source: e })?;
    let mut failures: Vec<anyhow::Error> = Vec::new();
    for id in &plain {
        if let Err(e) = lock(&s.weights_dir, id).and_then(|_guard| puller.file(id)) {
            failures.push(e.into());
        }
    }
    for (aid, members) in &archives {
        let mut members = members.clone();
        if members.is_empty() {
            members = manifest.members_of(aid).into_iter().map(String::from).collect();
        }
        if let Err(e) = lock(&s.weights_dir, aid).and_then(|_guard| puller.archive(aid, &members)) {
            failures.push(e.into());
        }
    }
    match failures.len() {
        0 => Ok(ExitStatus::Success),
        1 => Err(failures.pop().unwrap()),
        n => {
            for e in &failures {
                eprintln!("error: {e}");
                if let Some(h) = e.downcast_ref::<Error>().and_then(Error::hint) {
                    eprintln!("hint: {h}");
                }
            }
            eprintln!("error: {n} of the requested entries failed (see above); the others are in place");
            Ok(ExitStatus::Failure)
        }
    }
}

/// After `weights import` placed an archive entry: extract it as `weights pull` does (its
/// member entries to their files, or the whole archive beside it). Nothing is downloaded: the
/// archive is verified in place.
pub(crate) fn extract_imported_archive(s: &Settings, manifest: &Manifest, aid: &str) -> crate::error::Result<()> {
    let rep = progress::for_settings(s.quiet, s.progress);
    let puller = Puller { s, manifest, client: Client::new(Duration::from_secs(30))?, force: false, repin: false, rep: rep.as_ref() };
    let members: Vec<String> = manifest.members_of(aid).into_iter().map(String::from).collect();
    let _guard = lock(&s.weights_dir, aid)?;
    puller.archive(aid, &members)
}

struct Puller<'a> {
    s: &'a Settings,
    manifest: &'a Manifest,
    client: Client,
    force: bool,
    repin: bool,
    rep: &'a dyn Reporter,
}

fn mib_per_s(bytes: u64, secs: f64) -> String {
    if secs <= 0.0 {
        return "-".into();
    }
    format!("{:.1} MiB/s", bytes as f64 / (1024.0 * 1024.0) / secs)
}

impl Puller<'_> {
    fn dest(&self, id: &str) -> PathBuf {
        self.s.weights_dir.join(&self.manifest.weights[id].file)
    }

    /// Whether an existing file can be kept as it is (and say so); an error for a bad one.
    fn already_there(&self, id: &str) -> crate::error::Result<bool> {
        let e = &self.manifest.weights[id];
        let dest = self.dest(id);
        let hashing = self.rep.bytes(&format!("check {id}"), e.size);
        let st = check(&self.s.weights_dir, id, e, true, |n| hashing.inc(n))?;
        hashing.finish();
        match st {
            Status::Missing => Ok(false),
            _ if self.force => Ok(false),
            Status::Verified => {
                self.rep.note(&format!("{id}: already verified in {}", dest.display()));
                Ok(true)
            }
            Status::Unpinned | Status::Present => {
                self.rep.note(&format!("{id}: present in {} (weights.toml pins no sha256; pass --force to download again)", dest.display()));
                Ok(true)
            }
            bad @ (Status::WrongHash { .. } | Status::WrongSize { .. }) => Err(Error::Download {
                id: id.into(),
                detail: format!("{} is present but {bad}", dest.display()),
                hint: Some("nothing was deleted: move the file aside and pull again, or pass --force (the file is replaced only by a verified download)".into()),
            }),
        }
    }

    /// Download one entry's file to its place (an archive stays an archive here).
    fn file(&self, id: &str) -> crate::error::Result<()> {
        if self.already_there(id)? {
            return Ok(());
        }
        let e = &self.manifest.weights[id];
        let dest = self.dest(id);
        let dir = dest.parent().unwrap_or(&self.s.weights_dir);
        std::fs::create_dir_all(dir).map_err(|err| Error::Io { path: dir.to_path_buf(), source: err })?;
        let part = PathBuf::from(format!("{}.part", dest.display()));
        if let (Some(size), Ok(m)) = (e.size, std::fs::metadata(&part)) {
            if m.len() > size {
                remove(&part)?;
                warn(&format!("{id}: {} held {} bytes, more than the {size} pinned: it cannot be a prefix of the file and was deleted", part.display(), m.len()));
            }
        }
        let t = self.client.fetch(id, &e.url, &part, e.size, self.rep)?;
        let speed = mib_per_s(t.received, t.seconds);
        if t.resumed_from > 0 {
            self.rep.note(&format!("{id}: resumed at byte {}; received {} bytes in {:.2} s ({speed})", t.resumed_from, t.received, t.seconds));
        } else {
            self.rep.note(&format!("{id}: received {} bytes in {:.2} s ({speed})", t.received, t.seconds));
        }
        let got = std::fs::metadata(&part).map_err(|err| Error::Io { path: part.clone(), source: err })?.len();
        if let Some(size) = e.size {
            if got != size {
                remove(&part)?;
                return Err(Error::Download {
                    id: id.into(),
                    detail: format!("the server's file has {got} bytes, weights.toml pins {size}; the download was deleted"),
                    hint: Some(format!("the file at {} changed upstream (or the pin is wrong); {} was left as it was", e.url, dest.display())),
                });
            }
        }
        let hashing = self.rep.bytes(&format!("verify {id}"), Some(got));
        let found = sha256_file(&part, |n| hashing.inc(n))?;
        hashing.finish();
        if let Some(pinned) = &e.sha256 {
            if &found != pinned {
                remove(&part)?;
                let kept = if dest.exists() { format!("the existing {} was left as it was", dest.display()) } else { "nothing else was touched".into() };
                return Err(Error::Checksum {
                    id: id.into(),
                    url: e.url.clone(),
                    expected: pinned.clone(),
                    found,
                    hint: format!("the bytes from {} are not the pinned file (changed upstream, a proxy or a captive portal?): the download was deleted, {kept}", e.url),
                });
            }
        }
        let dir = &self.s.weights_dir;
        let local = if e.sha256.is_none() { LocalPins::load(dir)?.get(id).cloned() } else { None };
        if let Some(pin) = local.as_ref().filter(|p| p.sha256 != found && !self.repin) {
            return Err(Error::Download {
                id: id.into(),
                detail: format!(
                    "the downloaded file's sha256 is {found}, but this weights folder pinned {} at its first download ({}, in {})",
                    pin.sha256,
                    pin.pinned_at,
                    LocalPins::path(dir).display()
                ),
                hint: Some(format!(
                    "the bytes at {} changed since then (a new upstream release, or a tampered download): nothing was replaced, the new bytes are kept in {}; if the change is expected, accept it with `scfoundry weights pull --repin {id}`",
                    e.url,
                    part.display()
                )),
            });
        }
        std::fs::rename(&part, &dest).map_err(|err| Error::Io { path: dest.clone(), source: err })?;
        write_stamp(dir, id, &dest, &found);
        if e.sha256.is_some() {
            self.rep.note(&format!("{id}: verified, {}", dest.display()));
        } else if local.as_ref().is_some_and(|p| p.sha256 == found) {
            self.rep.note(&format!("{id}: matches its local pin, {}", dest.display()));
        } else {
            let pinned_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
            LocalPins::record(dir, id, LocalPin { sha256: found.clone(), size: got, source: e.url.clone(), pinned_at })?;
            let replaced = local.map(|p| format!(" (replacing {})", p.sha256)).unwrap_or_default();
            warn(&format!(
                "{id}: cannot be verified: weights.toml pins no sha256 (revision {}); trusting this download: its sha256 {found} is now pinned in {}{replaced}, and a later download that differs is refused",
                e.revision,
                LocalPins::path(dir).display()
            ));
        }
        Ok(())
    }

    /// Pull an archive entry, then extract it: the wanted member entries to their files, or,
    /// without member entries, the whole archive beside its file.
    fn archive(&self, aid: &str, members: &[String]) -> crate::error::Result<()> {
        let a = &self.manifest.weights[aid];
        let kind = a.archive.as_deref().unwrap_or("zip");
        let mut todo: Vec<&String> = Vec::new();
        for m in members {
            if !self.already_there(m)? {
                todo.push(m);
            }
        }
        if !members.is_empty() && todo.is_empty() && !self.force {
            return Ok(());
        }
        self.file(aid)?;
        let archive = self.dest(aid);
        let target = archive.parent().unwrap_or(&self.s.weights_dir).to_path_buf();
        let tmp = tempfile::Builder::new()
            .prefix(".extract-")
            .tempdir_in(&target)
            .map_err(|err| Error::Io { path: target.clone(), source: err })?;
        let n = crate::download::extract(kind, &archive, tmp.path())?;
        self.rep.note(&format!("{aid}: extracted {n} members"));
        if members.is_empty() {
            for item in std::fs::read_dir(tmp.path()).map_err(|err| Error::Io { path: tmp.path().into(), source: err })? {
                let item = item.map_err(|err| Error::Io { path: tmp.path().into(), source: err })?;
                let fin = target.join(item.file_name());
                if fin.exists() {
                    self.rep.note(&format!("{aid}: kept the existing {}", fin.display()));
                    continue;
                }
                std::fs::rename(item.path(), &fin).map_err(|err| Error::Io { path: fin.clone(), source: err })?;
                self.rep.note(&format!("{aid}: extracted to {}", fin.display()));
            }
            return Ok(());
        }
        for id in todo {
            let e = &self.manifest.weights[id];
            let member = e.member.as_deref().unwrap_or_default();
            let src = tmp.path().join(member);
            if !src.is_file() {
                return Err(Error::Download {
                    id: id.into(),
                    detail: format!("{member} is not in {}", archive.display()),
                    hint: Some("weights.toml's `member` does not match the archive; fix the entry".into()),
                });
            }
            let found = sha256_file(&src, |_| {})?;
            let size = std::fs::metadata(&src).map(|m| m.len()).unwrap_or(0);
            if e.size.is_some_and(|s| s != size) || e.sha256.as_ref().is_some_and(|p| *p != found) {
                return Err(Error::Checksum {
                    id: id.into(),
                    url: e.url.clone(),
                    expected: e.sha256.clone().unwrap_or_else(|| "(none)".into()),
                    found,
                    hint: format!("member {member} of {aid} ({size} bytes) is not the pinned file; nothing was placed"),
                });
            }
            let dest = self.dest(id);
            if let Some(d) = dest.parent() {
                std::fs::create_dir_all(d).map_err(|err| Error::Io { path: d.into(), source: err })?;
            }
            std::fs::rename(&src, &dest).map_err(|err| Error::Io { path: dest.clone(), source: err })?;
            write_stamp(&self.s.weights_dir, id, &dest, &found);
            if e.sha256.is_none() {
                warn(&format!("{id}: cannot be verified: weights.toml pins no sha256; its sha256 {found} is recorded"));
            }
        }
        self.rep.note(&format!("{aid}: {} member(s) verified and in place under {}", members.len(), target.display()));
        Ok(())
    }
}

/// An exclusive lock on one entry (`<weights>/.locks/<id>.lock`, flock), held while it is
/// pulled: two processes sharing a weights folder must not write the same `.part`. The lock
/// files stay (removing them would race with a process that has just opened one).
fn lock(dir: &Path, id: &str) -> crate::error::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let locks = dir.join(".locks");
    std::fs::create_dir_all(&locks).map_err(|e| Error::Io { path: locks.clone(), source: e })?;
    let path = locks.join(format!("{id}.lock"));
    let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
    // SAFETY: flock on a descriptor we own; released when `f` is closed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() == std::io::ErrorKind::WouldBlock {
            return Err(Error::Download {
                id: id.into(),
                detail: format!("another process is pulling it into {} (lock {})", dir.display(), path.display()),
                hint: Some("wait for the other `scfoundry weights pull` to finish, then run again (it will find the file verified)".into()),
            });
        }
        // file systems without flock (some NFS mounts): go on unlocked
    }
    Ok(f)
}

fn remove(p: &Path) -> crate::error::Result<()> {
    std::fs::remove_file(p).map_err(|e| Error::Io { path: p.to_path_buf(), source: e })
}
