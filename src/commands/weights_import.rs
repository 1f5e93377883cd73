//! `scfoundry weights import NAME PATH`: a file or folder the user downloaded (a share page's
//! file, a Hugging Face snapshot or cache entry, an upstream release folder) checked against
//! the manifest and placed in the weights folder, so that later runs and other workspaces find
//! it. A pinned entry must match its sha256 (weights.toml's, or the folder's local pin); an
//! unpinned one gets the sha256 found recorded as a local pin, as a first download does.

use std::path::{Path, PathBuf};

use crate::commands::weights::{extract_imported_archive, resolve_ids};
use crate::commands::ExitStatus;
use crate::error::Error;
use crate::progress::{self, warn};
use crate::settings::Settings;
use crate::weights::{check, resolve_model_folder, sha256_file, write_stamp, LocalPin, LocalPins, Manifest, Status};

/// Options of `weights import`.
pub struct ImportOptions {
    /// Replace a different file already in the weights folder (`repin` does too).
    pub force: bool,
    /// Accept a file that differs from the weights folder's local pin, replacing the pin.
    pub repin: bool,
    /// Place a symbolic link to the file instead of a copy (or hard link).
    pub link: bool,
}

pub fn run(s: &Settings, name: &str, path: &Path, o: &ImportOptions) -> anyhow::Result<ExitStatus> {
    let manifest = Manifest::load()?;
    let ids = resolve_ids(s, &manifest, &[name.to_string()], "import")?;
    let meta = std::fs::metadata(path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e })?;
    let pairs: Vec<(String, PathBuf)> = if meta.is_file() {
        vec![(entry_for_file(&manifest, name, &ids, path)?, path.to_path_buf())]
    } else {
        let dir = resolve_model_folder(path, "weights import")?;
        let (found, absent) = entries_in_folder(&manifest, &ids, &dir);
        if found.is_empty() {
            let looked: Vec<String> = ids.iter().map(|id| format!("{id} ({})", manifest.weights[id].file)).collect();
            return Err(Error::Import {
                id: name.into(),
                detail: format!("{} holds none of the files of {name}'s entries: {}", dir.display(), looked.join(", ")),
                hint: format!("pass the folder that holds them as upstream lays it out, or one file with its entry id (`scfoundry weights import ID FILE`); a method that reads a whole folder also takes it with `--model-dir {}`", dir.display()),
            }
            .into());
        }
        if !s.quiet {
            for id in &absent {
                eprintln!("{id}: not in {} (its file is {}); left as it was", dir.display(), manifest.weights[id].file);
            }
        }
        found
    };
    std::fs::create_dir_all(&s.weights_dir).map_err(|e| Error::Io { path: s.weights_dir.clone(), source: e })?;
    for (id, src) in &pairs {
        import_one(s, &manifest, id, src, o)?;
    }
    Ok(ExitStatus::Success)
}

/// The entry a single file is imported as: the one named, or the method's entry whose file
/// has the same name.
fn entry_for_file(manifest: &Manifest, name: &str, ids: &[String], path: &Path) -> crate::error::Result<String> {
    if ids.len() == 1 {
        return Ok(ids[0].clone());
    }
    let base = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let same: Vec<&String> = ids.iter().filter(|id| Path::new(&manifest.weights[*id].file).file_name().is_some_and(|n| n.to_string_lossy() == base)).collect();
    match same.as_slice() {
        [one] => Ok((*one).clone()),
        _ => {
            let list: Vec<String> = ids.iter().map(|id| format!("{id} ({})", manifest.weights[id].file)).collect();
            Err(Error::Import {
                id: name.into(),
                detail: format!("{} is {} of {name}'s entries by its name `{base}`", path.display(), if same.is_empty() { "none" } else { "more than one" }),
                hint: format!("name the entry: `scfoundry weights import ID {}`, one of {}", path.display(), list.join(", ")),
            })
        }
    }
}

/// Each entry's file in a folder (see `Manifest::find_in_folder`); the found and the absent.
fn entries_in_folder(manifest: &Manifest, ids: &[String], dir: &Path) -> (Vec<(String, PathBuf)>, Vec<String>) {
    let (found, absent) = manifest.find_in_folder(ids, dir);
    (found.into_iter().map(|(id, tail)| (id, dir.join(tail))).collect(), absent)
}

fn import_one(s: &Settings, manifest: &Manifest, id: &str, src: &Path, o: &ImportOptions) -> crate::error::Result<()> {
    let e = &manifest.weights[id];
    let dir = &s.weights_dir;
    let dest = dir.join(&e.file);
    // a Hugging Face snapshot holds links into blobs/: the bytes are the blob's
    let real = std::fs::canonicalize(src).map_err(|err| Error::Io { path: src.to_path_buf(), source: err })?;
    let size = std::fs::metadata(&real).map_err(|err| Error::Io { path: real.clone(), source: err })?.len();
    let rep = progress::for_settings(s.quiet, s.progress);
    let hashing = rep.bytes(&format!("check {id}"), Some(size));
    let found = sha256_file(&real, |n| hashing.inc(n))?;
    hashing.finish();
    let pins = LocalPins::load(dir)?;
    let local = if e.sha256.is_none() { pins.get(id).cloned() } else { None };
    if let Some(expected) = &e.sha256 {
        if &found != expected {
            return Err(Error::ImportChecksum {
                id: id.into(),
                path: src.to_path_buf(),
                expected: expected.clone(),
                found,
                pinned_by: "weights.toml".into(),
                hint: format!(
                    "this is not the file pinned for {id} (revision {}): download it again from {} (a cut download, or another release?) and import that; nothing was placed",
                    e.revision, e.url
                ),
            });
        }
    } else if let Some(pin) = local.as_ref().filter(|p| p.sha256 != found && !o.repin) {
        return Err(Error::ImportChecksum {
            id: id.into(),
            path: src.to_path_buf(),
            expected: pin.sha256.clone(),
            found,
            pinned_by: format!("this weights folder's {} (pinned {} from {})", LocalPins::path(dir).display(), pin.pinned_at, pin.source),
            hint: format!("nothing was placed; if the new file is expected (a new upstream release), accept it with `scfoundry weights import --repin {id} {}`", src.display()),
        });
    }
    if let Some(pinned) = e.size.filter(|&p| p != size) {
        return Err(Error::Import {
            id: id.into(),
            detail: format!("{} has {size} bytes, weights.toml pins {pinned}", src.display()),
            hint: format!("download it again from {} and import that; nothing was placed", e.url),
        });
    }
    let same_file = std::fs::canonicalize(&dest).is_ok_and(|d| d == real);
    match check(dir, id, e, false, |_| {})? {
        Status::Missing => {}
        _ if same_file => {}
        _ => {
            let there = sha256_file(&dest, |_| {})?;
            if there != found && !o.force && !o.repin {
                return Err(Error::Import {
                    id: id.into(),
                    detail: format!("{} already holds a different file (sha256 {there})", dest.display()),
                    hint: format!("nothing was replaced: move it aside, or pass --force to replace it with {}", src.display()),
                });
            }
        }
    }
    if !same_file {
        place(&real, &dest, o.link)?;
    }
    write_stamp(dir, id, &dest, &found);
    let how = if o.link { "linked" } else { "placed" };
    if e.sha256.is_some() {
        rep.note(&format!("{id}: verified against weights.toml, {how} at {}", dest.display()));
    } else if local.as_ref().is_some_and(|p| p.sha256 == found) {
        rep.note(&format!("{id}: matches its local pin, {how} at {}", dest.display()));
    } else {
        let pinned_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let source = std::path::absolute(src).unwrap_or_else(|_| src.to_path_buf()).display().to_string();
        LocalPins::record(dir, id, LocalPin { sha256: found.clone(), size, source, pinned_at })?;
        let replaced = local.map(|p| format!(" (replacing {})", p.sha256)).unwrap_or_default();
        warn(&format!(
            "{id}: cannot be verified: weights.toml pins no sha256 (revision {}); its sha256 {found} is now pinned in {}{replaced}, and a later file that differs is refused; {how} at {}",
            e.revision,
            LocalPins::path(dir).display(),
            dest.display()
        ));
    }
    if e.archive.is_some() {
        extract_imported_archive(s, manifest, id)?;
    }
    Ok(())
}

/// Put `src` at `dest` through a temporary name beside it: a symbolic link with `link`, else a
/// hard link where the file system allows one, else a copy.
fn place(src: &Path, dest: &Path, link: bool) -> crate::error::Result<()> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| Error::Io { path: parent.to_path_buf(), source: e })?;
    let tmp = PathBuf::from(format!("{}.import", dest.display()));
    let _ = std::fs::remove_file(&tmp);
    let io = |e: std::io::Error| Error::Io { path: tmp.clone(), source: e };
    if link {
        std::os::unix::fs::symlink(src, &tmp).map_err(io)?;
    } else if std::fs::hard_link(src, &tmp).is_err() {
        std::fs::copy(src, &tmp).map_err(io)?;
    }
    std::fs::rename(&tmp, dest).map_err(|e| Error::Io { path: dest.to_path_buf(), source: e })
}
