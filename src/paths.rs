//! Paths as the OS will see them, for the checks made before any work.

use std::path::{Component, Path, PathBuf};

/// `path` as the OS will resolve it when it is written: the longest part that exists with its
/// symbolic links resolved, then the rest with `.` and `..` taken lexically (the folders that do
/// not exist yet are created before the write, so `nosuchdir/../x` is `x`).
pub fn resolved(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let comps: Vec<Component> = abs.components().collect();
    // the longest existing prefix
    let mut split = comps.len();
    let mut base = None;
    while split > 0 {
        let prefix: PathBuf = comps[..split].iter().collect();
        if let Ok(c) = std::fs::canonicalize(&prefix) {
            base = Some(c);
            break;
        }
        split -= 1;
    }
    let mut out = base.unwrap_or_else(|| PathBuf::from("/"));
    for c in &comps[split..] {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Whether writing `out` would write the existing file `input` (the same path once resolved, or
/// the same file through a hard link).
pub fn same_file(input: &Path, out: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(a) = std::fs::canonicalize(input) else { return false };
    let b = resolved(out);
    if a == b {
        return true;
    }
    match (std::fs::metadata(&a), std::fs::metadata(&b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// An output file (`--out`, `--predict-out`) must not be an existing folder, unless it is a
/// Zarr store named `.zarr` (an output store replaces it): checked before any work.
pub fn check_output_file(out: &Path, option: &str) -> crate::error::Result<()> {
    if out.is_dir() && !(crate::anndata::zarr::is_store_name(out) && crate::anndata::zarr::is_store(out)) {
        return Err(crate::error::Error::BadOption {
            option: option.into(),
            detail: format!("{} is a folder; {option} names the output file", out.display()),
            hint: Some(format!("pass a file name, e.g. {}", out.join("out.h5ad").display())),
        });
    }
    Ok(())
}

/// An output folder (`benchmark --out`, `geometry --out`) must not be an existing file:
/// checked before any work.
pub fn check_output_dir(out: &Path, option: &str) -> crate::error::Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(crate::error::Error::BadOption {
            option: option.into(),
            detail: format!("{} is a file; {option} names the folder for the results", out.display()),
            hint: Some("pass a folder that does not exist yet or holds earlier results".into()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_dot_through_a_missing_folder_is_the_file() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("in.h5ad");
        std::fs::write(&f, b"x").unwrap();
        assert!(same_file(&f, &d.path().join("nosuchdir/../in.h5ad")));
        assert!(same_file(&f, &d.path().join("a/b/../../in.h5ad")));
        assert!(!same_file(&f, &d.path().join("nosuchdir/in.h5ad")));
        std::fs::hard_link(&f, d.path().join("link.h5ad")).unwrap();
        assert!(same_file(&f, &d.path().join("link.h5ad")));
        std::os::unix::fs::symlink(&f, d.path().join("sym.h5ad")).unwrap();
        assert!(same_file(&f, &d.path().join("sym.h5ad")));
    }
}

/// Default output of `embed` and `integrate`: `<input stem>.<method>.h5ad` beside the input.
pub fn default_output(data: &Path, method: &str) -> PathBuf {
    let stem = data.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    data.with_file_name(format!("{stem}.{method}.h5ad"))
}
