//! Several input files embedded as one run: `embed --data a.h5ad b.h5ad ...`, or `--data
//! files.txt` listing them (atlases ship in many files). Each file is embedded on its own (its
//! own task, or its own shards), so only methods that embed each cell on its own take several;
//! each file gets its own output, or with `--embedding-only` the embeddings go into one table
//! ([`write_table`]) with an obs column naming the file each cell came from.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::anndata::write::PendingOutput;
use crate::anndata::AnnData;
use crate::error::{Error, Result};

/// The obs column of a table made from several files that names each cell's file.
pub const FILE_COLUMN: &str = "scfoundry_file";

/// The input files `--data` names: the paths as given, or with a single `.txt` file the paths
/// it lists (one a line; blank lines and lines starting with `#` skipped; relative paths are
/// relative to the list's folder). The same file twice is an error.
pub fn expand(data: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let files = match data {
        [one] if one.extension().is_some_and(|e| e == "txt") && one.is_file() => {
            let text = std::fs::read_to_string(one).map_err(|e| Error::Io { path: one.clone(), source: e })?;
            let base = one.parent().map(Path::to_path_buf).unwrap_or_default();
            let listed: Vec<PathBuf> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(|l| if Path::new(l).is_absolute() { PathBuf::from(l) } else { base.join(l) })
                .collect();
            if listed.is_empty() {
                return Err(Error::BadOption {
                    option: "--data".into(),
                    detail: format!("{} lists no file", one.display()),
                    hint: Some("write one .h5ad or .zarr path a line (relative paths are relative to the list's folder)".into()),
                });
            }
            listed
        }
        _ => data.to_vec(),
    };
    let mut seen = HashSet::new();
    for f in &files {
        let key = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        if !seen.insert(key) {
            return Err(Error::BadOption {
                option: "--data".into(),
                detail: format!("{} is named twice", f.display()),
                hint: Some("name each file once".into()),
            });
        }
    }
    Ok(files)
}

/// A short, distinct name for each file (its stem; `stem-2`, ... where stems repeat), used in
/// task names, the outputs' names and the table's file column.
pub fn tags(files: &[PathBuf]) -> Vec<String> {
    let stems: Vec<String> = files.iter().map(|f| f.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "data".into())).collect();
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &stems {
        *count.entry(s).or_default() += 1;
    }
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    stems
        .iter()
        .map(|s| {
            if count[s.as_str()] == 1 {
                return s.clone();
            }
            let k = seen.entry(s).or_default();
            *k += 1;
            format!("{s}-{k}")
        })
        .collect()
}

/// One file's part of a table: its embedding-only output and the input it came from.
pub struct Part {
    pub output: PathBuf,
    pub input: PathBuf,
    pub tag: String,
}

/// Write the embeddings `obsm[key]` of `parts` (embedding-only outputs, in order) as one
/// embedding-only table at `dest`: the cells of each part in turn, `obs['scfoundry_file']` naming
/// each cell's file, and the first part's provenance with every input listed. Cell names that
/// repeat across files get `-<file>` appended (as `anndata.concat(..., index_unique="-")`).
/// Returns (cells, dimension, whether names were made unique).
pub fn write_table(parts: &[Part], key: &str, dest: &Path) -> Result<(usize, usize, bool)> {
    let mut names: Vec<Vec<String>> = Vec::new();
    let mut values: Vec<f32> = Vec::new();
    let mut codes: Vec<i32> = Vec::new();
    let mut dim = None;
    let mut inputs = Vec::new();
    let mut prov = serde_json::Map::new();
    for (k, p) in parts.iter().enumerate() {
        let ad = AnnData::open(&p.output)?;
        let (v, n, d) = ad.dense_entry("obsm", key)?;
        if *dim.get_or_insert(d) != d {
            return Err(Error::BadField {
                path: p.output.clone(),
                field: format!("obsm/{key}"),
                detail: format!("is {d} wide, the first file's is {}", dim.unwrap_or(0)),
                hint: Some("every file must be embedded with the same method and options".into()),
            });
        }
        if k == 0 {
            if let Some(Value::Object(m)) = ad.uns().get("scfoundry") {
                prov = m.clone();
            }
        }
        inputs.push(json!({ "file": p.tag, "input": p.input.display().to_string(), "cells": n, "first_row": codes.len() }));
        names.push(ad.obs_names.clone());
        values.extend_from_slice(&v);
        codes.extend(std::iter::repeat_n(k as i32, n));
    }
    let mut all: Vec<String> = names.concat();
    let unique = {
        let mut seen = HashSet::new();
        all.iter().all(|n| seen.insert(n.as_str()))
    };
    if !unique {
        all = names.iter().zip(parts).flat_map(|(ns, p)| ns.iter().map(move |n| format!("{n}-{}", p.tag))).collect();
    }
    let n = all.len();
    let d = dim.unwrap_or(0);
    let out = PendingOutput::create_embedding_only(dest, &all)?;
    out.write_dense(&format!("obsm/{key}"), &values, n, d)?;
    let cats: Vec<String> = parts.iter().map(|p| p.tag.clone()).collect();
    out.add_obs_categorical(FILE_COLUMN, &codes, &cats)?;
    prov.remove("input");
    prov.remove("input_size");
    prov.insert("inputs".into(), Value::Array(inputs));
    prov.insert("file_column".into(), json!(FILE_COLUMN));
    prov.insert("obs_names_made_unique".into(), json!(!unique));
    out.write_uns(&json!({ "scfoundry": Value::Object(prov) }))?;
    out.commit()?;
    Ok((n, d, !unique))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_stems_made_distinct() {
        let f = |s: &str| PathBuf::from(s);
        assert_eq!(tags(&[f("a/x.h5ad"), f("b/y.h5ad")]), ["x", "y"]);
        assert_eq!(tags(&[f("a/x.h5ad"), f("b/x.h5ad"), f("c/z.zarr")]), ["x-1", "x-2", "z"]);
    }

    #[test]
    fn a_list_file_names_files_relative_to_itself() {
        let dir = tempfile::tempdir().unwrap();
        let list = dir.path().join("files.txt");
        std::fs::write(&list, "# atlas\npart1.h5ad\n\n/abs/part2.h5ad\n").unwrap();
        assert_eq!(expand(&[list.clone()]).unwrap(), [dir.path().join("part1.h5ad"), PathBuf::from("/abs/part2.h5ad")]);
        std::fs::write(&list, "# nothing\n").unwrap();
        assert!(expand(&[list]).unwrap_err().to_string().contains("lists no file"));
        let twice = [dir.path().join("a.h5ad"), dir.path().join("a.h5ad")];
        assert!(expand(&twice).unwrap_err().to_string().contains("named twice"));
    }
}
