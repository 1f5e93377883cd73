//! Every bad input gets one clear error naming the file and the field, a hint, exit 1,
//! the input untouched and no output file.

use crate::common::{sha256, TestContext, Tiny};
use std::path::PathBuf;

/// Write `t` as `name`, run `embed --method pca` on it, and check the invariants.
fn embed_fails(ctx: &TestContext, name: &str, extra: &[&str]) -> crate::common::Run {
    let input = ctx.path(name);
    let before = std::fs::read(&input).ok().map(|_| sha256(&input));
    let mut args = vec!["embed", "--method", "pca", "--data", name];
    args.extend_from_slice(extra);
    let r = ctx.run(&args);
    r.user_error().has_hint();
    if let Some(b) = before {
        assert_eq!(b, sha256(&input), "the input file changed");
    }
    let stem = name.trim_end_matches(".h5ad");
    let out: PathBuf = ctx.path(&format!("{stem}.pca.h5ad"));
    assert!(!out.exists(), "an output file was left behind");
    // no temporary files either
    let leftovers: Vec<_> = std::fs::read_dir(ctx.dir.path()).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".tmp")).collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    r
}

#[test]
fn missing_file() {
    let ctx = TestContext::new();
    embed_fails(&ctx, "nope.h5ad", &[]).stderr_has("nope.h5ad: no such file");
}

#[test]
fn not_hdf5() {
    let ctx = TestContext::new();
    std::fs::write(ctx.path("table.h5ad"), "gene,cell1\nCD3E,4\n").unwrap();
    embed_fails(&ctx, "table.h5ad", &[]).stderr_has("table.h5ad: not an HDF5 file").stderr_has("convert");
}

#[test]
fn truncated_file() {
    let ctx = TestContext::new();
    let p = ctx.path("cut.h5ad");
    Tiny::counts(30, 20).write(&p);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    embed_fails(&ctx, "cut.h5ad", &[]).stderr_has("cut.h5ad").stderr_has("truncated");
}

#[test]
fn no_x() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.write_x = false;
    t.write(&ctx.path("nox.h5ad"));
    embed_fails(&ctx, "nox.h5ad", &[]).stderr_has("nox.h5ad: X: is missing");
}

#[test]
fn x_rows_disagree_with_obs() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.obs_names.pop();
    t.write(&ctx.path("rows.h5ad"));
    embed_fails(&ctx, "rows.h5ad", &[]).stderr_has("rows.h5ad: X has 10 rows but `obs` has 9 cells");
}

#[test]
fn x_columns_disagree_with_var() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.var_names.push("extra".into());
    t.write(&ctx.path("cols.h5ad"));
    embed_fails(&ctx, "cols.h5ad", &[]).stderr_has("cols.h5ad: X has 8 columns but `var` has 9 genes");
}

#[test]
fn non_finite_value() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.x[3 * 8 + 2] = f32::NAN;
    t.write(&ctx.path("nan.h5ad"));
    embed_fails(&ctx, "nan.h5ad", &[]).stderr_has("nan.h5ad: X holds a non-finite value (NaN) at cell 3 (cell_3), gene 2 (gene_2)");
}

#[test]
fn negative_value() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.x[5 * 8 + 1] = -2.0;
    t.write(&ctx.path("neg.h5ad"));
    embed_fails(&ctx, "neg.h5ad", &[])
        .stderr_has("neg.h5ad: counts check: pca needs raw counts, but X holds a negative value (-2) at cell 5 (cell_5), gene 1 (gene_1)")
        .stderr_has("--skip-counts-check");
}

#[test]
fn non_integer_value() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.x[0] = 1.5;
    t.write(&ctx.path("lognorm.h5ad"));
    // one fractional value among counts: the counts check only warns; pca's own pass refuses it
    let r = ctx.run(&["embed", "--method", "pca", "--data", "lognorm.h5ad"]);
    r.failed().has_hint().stderr_has("warning: counts check: X holds fractional values (1 of").stderr_has("X holds a non-integer value (1.5) at cell 0 (cell_0), gene 0 (gene_0)");
    assert!(!ctx.path("lognorm.pca.h5ad").exists());
}

#[test]
fn duplicate_var_names() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(10, 8);
    t.var_names[5] = "gene_1".into();
    t.write(&ctx.path("dups.h5ad"));
    embed_fails(&ctx, "dups.h5ad", &[]).stderr_has("dups.h5ad: var names are not unique: \"gene_1\" appears 2 times").stderr_has("var_names_make_unique");
}

#[test]
fn zero_cells() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(0, 8);
    t.obs_names.clear();
    t.write(&ctx.path("empty.h5ad"));
    embed_fails(&ctx, "empty.h5ad", &[]).stderr_has("empty.h5ad: the data has no cells (X is 0 x 8)");
}

#[test]
fn missing_layer() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    embed_fails(&ctx, "t.h5ad", &["--layer", "counts"]).stderr_has("t.h5ad: layers/counts: is missing").stderr_has("no layers");
}

#[test]
fn unknown_method() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", "scgtp", "--data", "t.h5ad"]);
    r.user_error().stderr_has("unknown method `scgtp`").stderr_has("did you mean `scgpt`?");
}

#[test]
fn integration_method_under_embed_fails_plainly() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    // harmony corrects an embedding: embed refuses it (scgpt_integrated, which fine-tunes, runs
    // under embed as integrate's task: tests/it/scgpt_integrated.rs)
    let r = ctx.run(&["embed", "--method", "harmony", "--data", "t.h5ad"]);
    r.user_error().stderr_has("harmony is an integration method").stderr_has("scfoundry integrate --method harmony").has_hint();
    assert!(!ctx.path("t.harmony.h5ad").exists());
    assert!(!ctx.path("runs").exists(), "no run folder for a refused command");
}

#[test]
fn unknown_option() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "--method", "pca", "--data", "t.h5ad", "--n-components", "5"]);
    r.user_error().stderr_has("unexpected argument '--n-components'").stderr_has("--n-comps");
}

#[test]
fn malformed_option_values() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    ctx.run(&["embed", "--method", "pca", "--data", "t.h5ad", "--n-comps", "abc"]).user_error().stderr_has("invalid value 'abc' for '--n-comps <N>'");
    ctx.run(&["embed", "--method", "pca", "--data", "t.h5ad", "--n-comps", "0"]).user_error().stderr_has("invalid value '0'");
    ctx.run(&["embed", "--method", "pca", "--data", "t.h5ad", "--seed", "-1"]).user_error();
}

#[test]
fn too_many_components() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    embed_fails(&ctx, "t.h5ad", &["--n-comps", "40"]).stderr_has("invalid value for --n-comps: 40 components asked").stderr_has("pass `--n-comps");
}

#[test]
fn out_is_the_input() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    embed_fails(&ctx, "t.h5ad", &["--out", "t.h5ad"]).stderr_has("is the input file").stderr_has("--in-place");
}

/// Hostile pickles through `embed -m genept` (its gene table is a pickle), the child's memory
/// capped at 2 GiB: each fails with exit 1 and a message naming the file and the budget, not
/// killed by the allocator or a stack overflow. Before the budgets, the shared-reference bomb
/// aborted with `memory allocation of 144 bytes failed` and the nested lists overflowed the stack.
#[test]
fn hostile_pickles_fail_cleanly_under_a_memory_cap() {
    use scfoundry::formats::pickle::hostile::{nested_lists, shared_reference_bomb};
    use scfoundry::methods::genept::TABLE_FILE;
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    for (name, bytes, budget) in [("bomb", shared_reference_bomb(40), "budget exceeded: a file this size"), ("deep", nested_lists(1_000_000), "nesting depth")] {
        let dir = ctx.path(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(TABLE_FILE), &bytes).unwrap();
        let r = ctx.run_capped(&["embed", "-m", "genept", "-d", "t.h5ad", "--model-dir", dir.to_str().unwrap()], &[], 2 << 30);
        r.user_error().stderr_has(&format!("{name}/{TABLE_FILE}")).stderr_has(budget).has_hint();
        assert!(!ctx.path("t.genept.h5ad").exists());
    }
}

/// A CSR matrix may legally hold a column twice within a row, or its columns out of order
/// (scipy sums duplicates on conversion): embed reads it as the summed, sorted matrix instead of
/// panicking in the PCA code (exit 101 before).
#[test]
fn csr_with_duplicate_and_unsorted_columns_reads_as_scipy_sums_them() {
    let ctx = TestContext::new();
    let t = Tiny::counts(30, 12);
    t.write(&ctx.path("plain.h5ad"));
    t.write(&ctx.path("dups.h5ad"));
    {
        // split each row's first stored value into two entries of the same column, and reverse
        // the row's column order
        let f = hdf5::File::open_rw(ctx.path("dups.h5ad")).unwrap();
        let g = f.group("X").unwrap();
        let data: Vec<f32> = g.dataset("data").unwrap().read_raw().unwrap();
        let indices: Vec<i32> = g.dataset("indices").unwrap().read_raw().unwrap();
        let indptr: Vec<i32> = g.dataset("indptr").unwrap().read_raw().unwrap();
        let (mut d2, mut i2, mut p2) = (vec![], vec![], vec![0i32]);
        for r in 0..indptr.len() - 1 {
            let (a, b) = (indptr[r] as usize, indptr[r + 1] as usize);
            let mut row: Vec<(i32, f32)> = indices[a..b].iter().copied().zip(data[a..b].iter().copied()).collect();
            if let Some(&(j, v)) = row.first() {
                row[0].1 = v - 1.0;
                row.push((j, 1.0));
            }
            row.reverse();
            for (j, v) in row {
                i2.push(j);
                d2.push(v);
            }
            p2.push(i2.len() as i32);
        }
        for n in ["data", "indices", "indptr"] {
            g.unlink(n).unwrap();
        }
        g.new_dataset::<f32>().shape([d2.len()]).create("data").unwrap().write_raw(&d2).unwrap();
        g.new_dataset::<i32>().shape([i2.len()]).create("indices").unwrap().write_raw(&i2).unwrap();
        g.new_dataset::<i32>().shape([p2.len()]).create("indptr").unwrap().write_raw(&p2).unwrap();
    }
    ctx.run(&["embed", "-m", "pca", "-d", "plain.h5ad", "--n-comps", "4", "-o", "a.h5ad"]).success();
    ctx.run(&["embed", "-m", "pca", "-d", "dups.h5ad", "--n-comps", "4", "-o", "b.h5ad"]).success();
    let (a, _) = crate::common::read_obsm(&ctx.path("a.h5ad"), "X_pca");
    let (b, _) = crate::common::read_obsm(&ctx.path("b.h5ad"), "X_pca");
    assert_eq!(a, b, "duplicates summed and columns sorted give the plain matrix's embedding");
}

/// A truncated file is reported as truncated, not as locked by another process.
#[test]
fn truncated_file_is_not_called_locked() {
    let ctx = TestContext::new();
    let bytes = std::fs::read(crate::common::repo().join("demo/pbmc68k_counts.h5ad")).unwrap();
    std::fs::write(ctx.path("cut.h5ad"), &bytes[..100_000]).unwrap();
    let r = embed_fails(&ctx, "cut.h5ad", &[]);
    r.stderr_has("cut.h5ad: cannot be read as HDF5").stderr_has("truncated");
    assert!(!r.stderr.contains("locked"), "{}", r.stderr);
}

/// X may be None when the counts are in a layer: `--layer counts` reads it; without --layer the
/// error names the layers.
#[test]
fn no_x_but_a_layer() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(20, 8);
    t.write_x = false;
    t.write(&ctx.path("nox.h5ad"));
    {
        let f = hdf5::File::open_rw(ctx.path("nox.h5ad")).unwrap();
        let layers = f.group("layers").or_else(|_| f.create_group("layers")).unwrap();
        let ds = layers.new_dataset::<f32>().shape([20, 8]).create("counts").unwrap();
        ds.write_raw(&t.x).unwrap();
        crate::common::enc(&ds, "array", "0.2.0");
    }
    embed_fails(&ctx, "nox.h5ad", &[]).stderr_has("X: is missing").stderr_has("--layer NAME` (layers: counts)");
    ctx.run(&["embed", "-m", "pca", "-d", "nox.h5ad", "--layer", "counts", "--n-comps", "3"]).success();
}

/// A plain int64 obs column is labels (batch and label keys), as pandas users store them.
#[test]
fn integer_columns_are_labels() {
    let ctx = TestContext::new();
    let t = Tiny::counts(120, 10);
    t.write(&ctx.path("ints.h5ad"));
    {
        let f = hdf5::File::open_rw(ctx.path("ints.h5ad")).unwrap();
        let obs = f.group("obs").unwrap();
        let batch: Vec<i64> = (0..120).map(|i| (i % 2) as i64).collect();
        let label: Vec<i64> = (0..120).map(|i| (i % 3) as i64 + 10).collect();
        for (name, v) in [("batch", &batch), ("label", &label)] {
            let ds = obs.new_dataset::<i64>().shape([120]).create(name).unwrap();
            ds.write_raw(v).unwrap();
            crate::common::enc(&ds, "array", "0.2.0");
        }
        obs.delete_attr("column-order").unwrap();
        let names: Vec<hdf5::types::VarLenUnicode> = ["batch", "label"].iter().map(|s| s.parse().unwrap()).collect();
        obs.new_attr::<hdf5::types::VarLenUnicode>().shape([2]).create("column-order").unwrap().write_raw(&names).unwrap();
    }
    ctx.run(&["embed", "-m", "pca", "-d", "ints.h5ad", "--n-comps", "4", "-o", "p.h5ad"]).success();
    ctx.run(&["integrate", "-m", "harmony", "-d", "p.h5ad", "--batch-key", "batch", "-o", "h.h5ad"]).success();
    ctx.run(&["benchmark", "-d", "h.h5ad", "--embedding", "X_pca,X_harmony", "--label-key", "label", "--batch-key", "batch", "--metrics", "silhouette_label,silhouette_batch", "-o", "bench"]).success();
    ctx.run(&["transfer", "-m", "pca", "-r", "ints.h5ad", "--query", "ints.h5ad", "--label-key", "label", "--n-comps", "4", "-o", "t.h5ad"]).success();
}

/// Numeric options refuse NaN and infinities when the command line is read (before: harmony ran
/// with theta 2, finetune blamed "another version of scfoundry").
#[test]
fn non_finite_option_values_are_refused() {
    let ctx = TestContext::new();
    Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    for args in [
        vec!["integrate", "-m", "harmony", "-d", "t.h5ad", "--batch-key", "b", "--theta", "nan"],
        vec!["finetune", "-m", "pca", "-d", "t.h5ad", "--label-key", "c", "--lr", "nan"],
        vec!["finetune", "-m", "pca", "-d", "t.h5ad", "--label-key", "c", "--weight-decay", "inf"],
    ] {
        ctx.run(&args).user_error().stderr_has("is not a finite number");
    }
}

/// Outputs that resolve to an input are refused before any work, as the OS will resolve them:
/// `nosuchdir/../in.h5ad` is in.h5ad once nosuchdir is made (before: replaced the input), and
/// finetune's --predict-out may not be --predict (before: no check at all).
#[test]
fn outputs_resolving_to_an_input_are_refused() {
    let ctx = TestContext::new();
    let t = Tiny::counts(30, 8).with_obs("cell_type", (0..30).map(|i| format!("t{}", i % 3)).collect()).with_obs("batch", (0..30).map(|i| format!("b{}", i % 2)).collect());
    t.write(&ctx.path("in.h5ad"));
    let before = sha256(&ctx.path("in.h5ad"));
    ctx.run(&["embed", "-m", "pca", "-d", "in.h5ad", "--n-comps", "3", "--out", "nosuchdir/../in.h5ad"]).user_error().stderr_has("is the input file");
    ctx.run(&["embed", "-m", "pca", "-d", "in.h5ad", "--n-comps", "3", "-o", "p.h5ad"]).success();
    let p_before = sha256(&ctx.path("p.h5ad"));
    ctx.run(&["integrate", "-m", "harmony", "-d", "p.h5ad", "--batch-key", "batch", "--out", "x/y/../../p.h5ad"]).user_error().stderr_has("is the input file");
    ctx.run(&["transfer", "-m", "pca", "-r", "in.h5ad", "--query", "p.h5ad", "--label-key", "cell_type", "--n-comps", "3", "--out", "nosuchdir/../p.h5ad"]).failed().stderr_has("is the query file");
    ctx.run(&["finetune", "-m", "pca", "-d", "in.h5ad", "--label-key", "cell_type", "--n-comps", "3", "--epochs", "1", "-o", "ft", "--predict", "p.h5ad", "--predict-out", "p.h5ad"]).user_error().stderr_has("finetune never modifies its inputs");
    ctx.run(&["finetune", "-m", "pca", "-d", "in.h5ad", "--label-key", "cell_type", "--n-comps", "3", "--epochs", "1", "-o", "ft", "--predict", "p.h5ad", "--predict-out", "nosuchdir/../in.h5ad"]).user_error().stderr_has("finetune never modifies its inputs");
    assert_eq!(before, sha256(&ctx.path("in.h5ad")), "in.h5ad was modified");
    assert_eq!(p_before, sha256(&ctx.path("p.h5ad")), "p.h5ad was modified");
}

/// An output of the wrong kind (a folder for a file, a file for a folder) is refused before any
/// work, once (before: after the computation, the I/O error printed twice).
#[test]
fn outputs_of_the_wrong_kind_are_refused_before_any_work() {
    let ctx = TestContext::new();
    Tiny::counts(100, 8).with_obs("cell_type", (0..100).map(|i| format!("t{}", i % 2)).collect()).with_obs("batch", (0..100).map(|i| format!("b{}", i % 3)).collect()).write(&ctx.path("t.h5ad"));
    std::fs::create_dir(ctx.path("adir")).unwrap();
    std::fs::write(ctx.path("afile"), b"keep me").unwrap();
    let r = ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "--n-comps", "3", "-o", "adir"]);
    r.user_error().stderr_has("adir is a folder; --out names the output file");
    assert!(!ctx.path("runs").exists(), "no run was started");
    ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "--n-comps", "3", "-o", "p.h5ad"]).success();
    for cmd in [vec!["benchmark", "-d", "p.h5ad", "--embedding", "X_pca", "--label-key", "cell_type", "--batch-key", "batch", "-o", "afile"], vec!["geometry", "-d", "p.h5ad", "--embedding", "X_pca", "-o", "afile"]] {
        let r = ctx.run(&cmd);
        r.user_error().stderr_has("afile is a file; --out names the folder");
        assert!(!r.stderr.contains("caused by"), "{}", r.stderr);
    }
    assert_eq!(std::fs::read(ctx.path("afile")).unwrap(), b"keep me");
}

/// What a counts-check case does to the geneformer fixture's counts (CSR `X/data`, by row).
#[derive(Clone, Copy)]
enum Values {
    /// log1p(normalize_total(X, 1e4)), scanpy's usual preprocessing.
    LogNormalized,
    /// One value made negative.
    Negative,
    /// Every count x 1.25: fractional, but counts by their size (alevin-fry, CellBender).
    FractionalCounts,
}

/// The counts check on a method that needs raw counts (geneformer, `input_values =
/// "raw_counts"`, on its small committed model): (case, values, extra arguments, expected exit
/// code, text stderr must hold). Log-normalised or negative values stop before any run folder
/// exists, naming the check, the override and, when the file has one, the counts layer;
/// fractional counts only warn; the override lets the run go on.
const COUNTS_CASES: &[(&str, Values, &[&str], i32, &str)] = &[
    ("lognorm", Values::LogNormalized, &[], 1, "counts check: geneformer needs raw counts, but X looks log-transformed"),
    ("lognorm_layer", Values::LogNormalized, &["--with-counts-layer"], 1, "pass `--layer counts` (this file has layers/counts)"),
    ("lognorm_uses_layer", Values::LogNormalized, &["--with-counts-layer", "--layer", "counts"], 0, "wrote"),
    ("negative", Values::Negative, &[], 1, "counts check: geneformer needs raw counts, but X holds a negative value (-3) at cell 7"),
    ("fractional", Values::FractionalCounts, &[], 0, "warning: counts check: X holds fractional values"),
    ("override", Values::LogNormalized, &["--skip-counts-check"], 0, "wrote"),
];

#[test]
fn counts_check_stops_log_normalized_and_negative_input() {
    let mut table = String::from("| case | X holds | arguments | exit | stderr holds |\n|---|---|---|---|---|\n");
    for &(case, values, extra, code, needle) in COUNTS_CASES {
        let values = match values {
            Values::LogNormalized => "log1p(normalize_total(counts, 1e4))",
            Values::Negative => "counts, one of them -3",
            Values::FractionalCounts => "counts x 1.25",
        };
        let args = if extra.is_empty() { "-".to_string() } else { format!("`{}`", extra.join(" ").replace("--with-counts-layer", "(file has layers/counts)")) };
        table.push_str(&format!("| `{case}` | {values} | {args} | {code} | {} |\n", needle.replace('|', "\\|")));
    }
    crate::docs::check_generated("docs/reliability.md", "counts-check", &table);
    let fx = crate::common::repo().join("tests/fixtures/geneformer");
    for &(case, values, extra, code, needle) in COUNTS_CASES {
        let ctx = TestContext::new();
        let data = ctx.path("cells.h5ad");
        std::fs::copy(fx.join("pbmc68k_50.h5ad"), &data).unwrap();
        let with_layer = extra.contains(&"--with-counts-layer");
        {
            let f = hdf5::File::open_rw(&data).unwrap();
            let x = f.group("X").unwrap();
            let counts: Vec<f32> = x.dataset("data").unwrap().read_raw().unwrap();
            let indptr: Vec<i64> = x.dataset("indptr").unwrap().read_raw::<i64>().unwrap();
            if with_layer {
                let layers = f.group("layers").unwrap();
                let g = layers.create_group("counts").unwrap();
                crate::common::enc(&g, "csr_matrix", "0.1.0");
                g.new_attr::<i64>().shape(2).create("shape").unwrap().write(&[50i64, 765]).unwrap();
                g.new_dataset_builder().with_data(&counts).create("data").unwrap();
                g.new_dataset_builder().with_data(&x.dataset("indices").unwrap().read_raw::<i64>().unwrap()).create("indices").unwrap();
                g.new_dataset_builder().with_data(&indptr).create("indptr").unwrap();
            }
            let mut v = counts.clone();
            match values {
                Values::LogNormalized => {
                    for r in 0..indptr.len() - 1 {
                        let (a, b) = (indptr[r] as usize, indptr[r + 1] as usize);
                        let total: f32 = v[a..b].iter().sum();
                        for c in &mut v[a..b] {
                            *c = (*c / total * 1e4).ln_1p();
                        }
                    }
                }
                Values::Negative => v[indptr[7] as usize] = -3.0,
                Values::FractionalCounts => v.iter_mut().for_each(|c| *c *= 1.25),
            }
            x.dataset("data").unwrap().write_raw(&v).unwrap();
        }
        let before = sha256(&data);
        let mut args = vec!["embed", "-m", "geneformer", "-d", "cells.h5ad", "--model-dir"];
        let model = fx.join("v1");
        args.push(model.to_str().unwrap());
        args.extend(extra.iter().filter(|a| **a != "--with-counts-layer"));
        let r = ctx.run(&args);
        assert_eq!(r.code, code, "{case}: {}", r.stderr);
        r.stderr_has(needle);
        assert_eq!(before, sha256(&data), "{case}: the input changed");
        if code != 0 {
            r.user_error().has_hint().stderr_has("--skip-counts-check");
            assert!(!ctx.path("runs").exists(), "{case}: a run folder for a run that cannot start");
            assert!(!ctx.path("cells.geneformer.h5ad").exists(), "{case}: an output was left");
        } else {
            assert!(ctx.path("cells.geneformer.h5ad").exists(), "{case}: no output");
        }
    }
}

/// The same check guards every command that embeds, with one flag: transfer and finetune
/// stop on log-normalised input, and `integrate`'s older `--log-normalized` is the same flag.
#[test]
fn counts_check_guards_transfer_and_finetune_and_shares_one_flag() {
    let ctx = TestContext::new();
    let mut t = Tiny::counts(40, 12).with_obs("cell_type", (0..40).map(|i| format!("t{}", i % 2)).collect());
    for v in &mut t.x {
        *v = (*v * 0.7).ln_1p();
    }
    t.write(&ctx.path("ln.h5ad"));
    ctx.run(&["transfer", "-m", "pca", "--reference", "ln.h5ad", "--query", "ln.h5ad", "--label-key", "cell_type", "-o", "q.h5ad"])
        .user_error()
        .stderr_has("counts check: pca needs raw counts, but X looks log-transformed");
    ctx.run(&["finetune", "-m", "pca", "-d", "ln.h5ad", "--label-key", "cell_type"]).user_error().stderr_has("counts check: pca needs raw counts");
    assert!(!ctx.path("runs").exists());
    for cmd in ["embed", "transfer", "finetune", "integrate"] {
        ctx.run(&[cmd, "--help"]).success();
        let help = ctx.run(&[cmd, "--help"]).stdout;
        assert!(help.contains("--skip-counts-check"), "{cmd} --help lacks the flag:\n{help}");
    }
    let with_old_spelling = ctx.run(&["integrate", "-m", "seurat", "-d", "ln.h5ad", "--batch-key", "cell_type", "--log-normalized", "-o", "x.h5ad"]);
    assert!(!with_old_spelling.stderr.contains("counts check"), "{}", with_old_spelling.stderr);
    assert!(!with_old_spelling.stderr.contains("unexpected argument"), "{}", with_old_spelling.stderr);
}
