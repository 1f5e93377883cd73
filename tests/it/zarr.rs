//! AnnData Zarr stores in and out, against stores that real anndata writes
//! (tests/python/zarr_stores.py, one interpreter per anndata version: $SCFOUNDRY_TEST_ANNDATA):
//! - every store (format 2 and 3, CSR X compressed with Blosc, dense X chunked by rows, a
//!   sharded format 3 store, consolidated metadata or not) embeds with pca byte for byte as the
//!   .h5ad of the same data, and reads the same obs;
//! - `--out x.zarr` is read back by anndata as the input plus the embedding, equal to the .h5ad
//!   output's (tests/python/zarr_output_check.py);
//! - a shard of a sharded run on a store reads only its own rows.

use std::path::{Path, PathBuf};

use crate::common::{read_obsm, repo, TestContext};

/// `VERSION=python,...` from $SCFOUNDRY_TEST_ANNDATA, keeping the interpreters that have zarr.
fn zarr_pythons() -> Option<Vec<(String, PathBuf)>> {
    let Ok(v) = std::env::var("SCFOUNDRY_TEST_ANNDATA") else {
        if std::env::var_os("CI").is_some() {
            panic!("CI=true but SCFOUNDRY_TEST_ANNDATA is not set: scripts/test.sh must provide the anndata version venvs");
        }
        eprintln!("SCFOUNDRY_TEST_ANNDATA not set: skipping the Zarr stores anndata writes (CI runs them)");
        return None;
    };
    let mut out = Vec::new();
    for (k, p) in v.split(',').filter_map(|kv| kv.split_once('=')) {
        let has = std::process::Command::new(p).args(["-c", "import zarr"]).output().map(|o| o.status.success()).unwrap_or(false);
        if has {
            out.push((k.to_string(), PathBuf::from(p)));
        } else {
            assert!(!["0.10", "0.12", "0.13"].contains(&k), "anndata {k} ({p}) has no zarr: its requirements file under ci/ must list it");
            eprintln!("anndata {k}: no zarr installed; its stores are not tested");
        }
    }
    Some(out)
}

/// One store written by anndata, with the .h5ad of the same data.
struct Made {
    version: String,
    zarr: PathBuf,
    h5ad: PathBuf,
    format: u64,
    sharded: bool,
}

/// Every store of every anndata version in the matrix, written into the test folder.
fn stores(ctx: &TestContext, pythons: &[(String, PathBuf)]) -> Vec<Made> {
    let mut out = Vec::new();
    for (version, py) in pythons {
        let dir = ctx.path(&format!("anndata-{version}"));
        let o = std::process::Command::new(py).arg(repo().join("tests/python/zarr_stores.py")).arg(&dir).output().unwrap();
        assert!(o.status.success(), "anndata {version}: zarr_stores.py failed:\n{}", String::from_utf8_lossy(&o.stderr));
        let made: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for s in made["stores"].as_array().unwrap() {
            out.push(Made {
                version: version.clone(),
                zarr: PathBuf::from(s["zarr"].as_str().unwrap()),
                h5ad: PathBuf::from(s["h5ad"].as_str().unwrap()),
                format: s["format"].as_u64().unwrap(),
                sharded: s["sharded"].as_bool().unwrap(),
            });
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn zarr_stores_of_every_anndata_version_embed_like_their_h5ad() {
    let Some(pythons) = zarr_pythons() else { return };
    let ctx = TestContext::new();
    let made = stores(&ctx, &pythons);
    if std::env::var_os("CI").is_some() {
        assert!(made.iter().any(|m| m.sharded), "no sharded store was written (anndata 0.13 with zarr 3 writes one)");
        assert!(made.iter().any(|m| m.format == 3) && made.iter().any(|m| m.format == 2), "both zarr formats must be tested");
    }
    for (i, m) in made.iter().enumerate() {
        let (a, b) = (format!("z{i}.h5ad"), format!("h{i}.h5ad"));
        ctx.run(&["embed", "-m", "pca", "-d", s(&m.zarr), "--n-comps", "5", "-o", &a]).success();
        ctx.run(&["embed", "-m", "pca", "-d", s(&m.h5ad), "--n-comps", "5", "-o", &b]).success();
        let ((x, dx), (y, dy)) = (read_obsm(&ctx.path(&a), "X_pca"), read_obsm(&ctx.path(&b), "X_pca"));
        assert_eq!(dx, dy);
        assert!(bits(&x) == bits(&y), "anndata {}: {} embeds unlike its .h5ad", m.version, m.zarr.display());
        // the same obs, read in-process
        let (z, h) = (scfoundry::anndata::AnnData::open(&m.zarr).unwrap(), scfoundry::anndata::AnnData::open(&m.h5ad).unwrap());
        assert_eq!(z.obs_names, h.obs_names);
        assert_eq!(z.var_names, h.var_names);
        let (zo, ho) = (z.obs().unwrap(), h.obs().unwrap());
        for col in ["cell_type", "barcode"] {
            assert_eq!(zo.column(col), ho.column(col), "anndata {}: {}: obs[{col}]", m.version, m.zarr.display());
        }
        assert_eq!(z.dense_entry("obsm", "X_umap").unwrap(), h.dense_entry("obsm", "X_umap").unwrap());
        assert_eq!(z.uns()["note"], h.uns()["note"]);
        if m.sharded {
            // the sharded CSR layer reads as the dense X does
            let (l, x) = (z.matrix(Some("counts")).unwrap(), z.matrix(None).unwrap());
            assert_eq!(l.format, "csr");
            let (p, q) = (l.read_rows(10, 50).unwrap(), x.read_rows(10, 50).unwrap());
            assert_eq!((p.indptr, p.indices, bits(&p.data)), (q.indptr, q.indices, bits(&q.data)));
        }
        eprintln!("anndata {}: {} embeds as its .h5ad", m.version, m.zarr.display());
    }
}

#[test]
fn zarr_output_is_read_back_by_anndata_as_the_input_plus_the_embedding() {
    let Some(pythons) = zarr_pythons() else { return };
    let ctx = TestContext::new();
    let made = stores(&ctx, &pythons);
    // from a format 2 store, a format 3 sharded store, and an .h5ad
    let mut inputs: Vec<PathBuf> = Vec::new();
    inputs.extend(made.iter().find(|m| m.format == 2).map(|m| m.zarr.clone()));
    inputs.extend(made.iter().find(|m| m.format == 3).map(|m| m.zarr.clone()));
    inputs.extend(made.iter().find(|m| m.sharded).map(|m| m.zarr.clone()));
    inputs.extend(made.first().map(|m| m.h5ad.clone()));
    for (i, input) in inputs.iter().enumerate() {
        let (out, reference) = (format!("out{i}.zarr"), format!("ref{i}.h5ad"));
        ctx.run(&["embed", "-m", "pca", "-d", s(input), "--n-comps", "5", "-o", &reference]).success();
        ctx.run(&["embed", "-m", "pca", "-d", s(input), "--n-comps", "5", "-o", &out]).success();
        // written again over itself: the earlier store is replaced, nothing is left beside it
        ctx.run(&["embed", "-m", "pca", "-d", s(input), "--n-comps", "5", "-o", &out]).success();
        let leftovers: Vec<_> = std::fs::read_dir(ctx.dir.path()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.ends_with(".tmp") || n.ends_with(".old")).collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        // the output store embeds as the input does (scfoundry reads what it wrote)
        let again = format!("again{i}.h5ad");
        ctx.run(&["embed", "-m", "pca", "-d", &out, "--n-comps", "5", "-o", &again]).success();
        assert!(bits(&read_obsm(&ctx.path(&again), "X_pca").0) == bits(&read_obsm(&ctx.path(&reference), "X_pca").0), "{out} embeds unlike its input");
        for (version, py) in &pythons {
            let o = std::process::Command::new(py)
                .arg(repo().join("tests/python/zarr_output_check.py"))
                .args([s(input), s(&ctx.path(&out)), s(&ctx.path(&reference)), "X_pca"])
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&o.stdout);
            assert!(o.status.success(), "anndata {version}, {} -> {out}: {stdout}\n{}", input.display(), String::from_utf8_lossy(&o.stderr));
            eprintln!("{}", stdout.trim());
        }
    }
}

#[test]
fn a_shard_of_a_run_on_a_zarr_store_reads_only_its_rows() {
    let Some(pythons) = zarr_pythons() else { return };
    let ctx = TestContext::new();
    // the genept fixture's cells (an embedding task that reports the rows it read), written by
    // each anndata with zarr as a store: CSR X in format 2; with zarr 3 also format 3, X sharded
    let genept = repo().join("tests/fixtures/genept");
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(genept.join("reference.json")).unwrap()).unwrap();
    let h5ad = repo().join(f["data"].as_str().unwrap());
    let mut n = 0;
    for (version, py) in &pythons {
        for format in ["2", "3"] {
            let store = ctx.path(&format!("cells-{version}-{format}.zarr"));
            let o = std::process::Command::new(py).arg(repo().join("tests/python/zarr_from_h5ad.py")).arg(&h5ad).arg(&store).arg(format).output().unwrap();
            assert!(o.status.success(), "anndata {version}: {}", String::from_utf8_lossy(&o.stderr));
            if format == "3" && store.join(".zgroup").exists() {
                continue; // zarr 2 writes format 2 only
            }
            let args = ["embed", "-m", "genept", "-d", s(&store), "--model-dir", s(&genept)];
            crate::common::assert_shards_equal(&ctx, &args, &[], "X_genept", 2, 0);
            std::fs::remove_dir_all(ctx.path("runs-X_genept")).unwrap();
            n += 1;
        }
    }
    assert!(n > 0);
}

#[test]
fn a_folder_that_is_not_a_store_is_refused_with_a_hint() {
    let ctx = TestContext::new();
    std::fs::create_dir(ctx.path("plain.zarr")).unwrap();
    ctx.run(&["embed", "-m", "pca", "-d", "plain.zarr", "-o", "o.h5ad"]).user_error().stderr_has("not a Zarr store").has_hint();
}
