//! genept (GenePT-w) against upstream's computation (committed fixture tests/fixtures/genept/,
//! made by scripts/genept_reference.py with numpy): a seeded random table pickled as upstream's
//! GenePT_gene_embedding_ada_text.pickle ({gene: numpy float64 vector}), the same vectors in
//! the other pickle shapes the loader reads, and the embeddings upstream's notebook code gives
//! for the demo cells. Embeddings within 1e-4 relative error; the command end to end; bad input.

use std::path::{Path, PathBuf};

use serde_json::Value;

use scfoundry::anndata::AnnData;
use scfoundry::methods::genept::{embed_cell, Lookup, Table, TABLE_FILE};

use crate::common::{TestContext, Tiny, max_rel_err, read_obsm, repo};

const MAX_REL_ERR: f64 = 1e-4;

fn dir() -> PathBuf {
    repo().join("tests/fixtures/genept")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

#[test]
fn genept_table_reads_every_pickle_shape() {
    let f = fixture();
    let t = Table::load(&dir().join(TABLE_FILE)).unwrap();
    assert_eq!(t.dim as u64, f["dim"].as_u64().unwrap());
    assert_eq!(t.index.len() as u64, f["genes"]["in_table"].as_u64().unwrap());
    // protocol 2 lists of floats and protocol 5 numpy buffers hold the same first 10 vectors
    for other in ["lists_protocol2.pickle", "arrays_protocol5.pickle"] {
        let o = Table::load(&dir().join(other)).unwrap();
        assert_eq!(o.index.len(), 10, "{other}");
        for k in f["first_keys"].as_array().unwrap() {
            let k = k.as_str().unwrap();
            assert_eq!(o.get(k).unwrap(), t.get(k).unwrap(), "{other}: {k}");
        }
    }
}

#[test]
fn genept_embeddings_match_upstream() {
    crate::common::no_hdf5_locking();
    let f = fixture();
    let t = Table::load(&dir().join(TABLE_FILE)).unwrap();
    let ad = AnnData::open(&repo().join(f["data"].as_str().unwrap())).unwrap();
    let l = Lookup::new(&ad.var_names, &t);
    assert_eq!(l.missing as u64, f["genes"]["missing"].as_u64().unwrap());
    let b = ad.matrix(None).unwrap().read_rows(0, ad.n_obs).unwrap();
    let mut rows = Vec::new();
    let mut acc = vec![0f64; t.dim];
    for i in 0..ad.n_obs {
        let (idx, vals) = b.row(i);
        embed_cell(idx, vals, &l, &t, &mut acc);
        rows.extend(acc.iter().map(|&v| v as f32));
    }
    let err = max_rel_err(&rows, &f["embeddings"], t.dim);
    eprintln!("genept: largest relative error {err:.3e} over {} cells", ad.n_obs);
    assert!(err < MAX_REL_ERR, "{err:.3e}");
}


fn read_i64(path: &Path, name: &str) -> i64 {
    hdf5::File::open(path).unwrap().dataset(name).unwrap().read_scalar().unwrap()
}

#[test]
fn genept_embed_command_matches_upstream() {
    let ctx = TestContext::new();
    let f = fixture();
    std::fs::copy(repo().join(f["data"].as_str().unwrap()), ctx.path("pbmc.h5ad")).unwrap();
    let r = ctx.run(&["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", dir().to_str().unwrap()]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["embed", "-m", "genept", "-d", "pbmc.h5ad", "--model-dir", dir().to_str().unwrap()], &[], "X_genept", 3, 0);
    r.stderr_has("165 of 765 genes (var_names) have no GenePT embedding");
    let out = ctx.path("pbmc.genept.h5ad");
    let (got, dim) = read_obsm(&out, "X_genept");
    assert_eq!((got.len() / dim, dim), (50, 32));
    let err = max_rel_err(&got, &f["embeddings"], dim);
    assert!(err < MAX_REL_ERR, "{err:.3e}");
    assert_eq!(read_i64(&out, "uns/scfoundry/parameters/genes_without_embedding"), 165);
    // no batch option: --batch-size is ignored with a warning
    let r = ctx.run(&["embed", "-m", "genept", "-d", "pbmc.h5ad", "-o", "b.h5ad", "--batch-size", "4", "--model-dir", dir().to_str().unwrap()]);
    r.success().stderr_has("genept does not honour --batch-size");
    assert_eq!(read_obsm(&ctx.path("b.h5ad"), "X_genept").0, got);
}

#[test]
fn genept_bad_tables_and_data() {
    let ctx = TestContext::new();
    std::fs::copy(repo().join("tests/fixtures/geneformer/pbmc68k_50.h5ad"), ctx.path("pbmc.h5ad")).unwrap();
    // no weights: the hint says how to get them
    let r = ctx.run(&["embed", "-m", "genept", "-d", "pbmc.h5ad"]);
    r.user_error().stderr_has("weights for genept are not in").stderr_has("genept-embeddings-v2").has_hint();
    let with = |name: &str, bytes: Option<&[u8]>| {
        let d = ctx.path(name);
        std::fs::create_dir_all(&d).unwrap();
        if let Some(b) = bytes {
            std::fs::write(d.join(TABLE_FILE), b).unwrap();
        }
        let r = ctx.run(&["embed", "-m", "genept", "-d", "pbmc.h5ad", "-o", "x.h5ad", "--model-dir", d.to_str().unwrap()]);
        r.user_error();
        assert!(!ctx.path("x.h5ad").exists());
        r.stderr
    };
    let e = with("none", None);
    assert!(e.contains(TABLE_FILE) && e.contains("no such file"), "{e}");
    let e = with("junk", Some(b"not a pickle"));
    assert!(e.contains(TABLE_FILE) && e.contains("pickled dict"), "{e}");
    // a pickle that would run code is refused, not run: os.system("true")
    let e = with("evil", Some(b"cos\nsystem\n(S'true'\ntR."));
    assert!(e.contains("code, not data"), "{e}");
    // data whose genes the table does not know
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "-m", "genept", "-d", "t.h5ad", "--model-dir", dir().to_str().unwrap()]);
    r.user_error().stderr_has("var_names").stderr_has("gene symbols").has_hint();
}
