//! The method registry and the weights manifest hold what the product promises.

use scfoundry::registry::Registry;
use scfoundry::weights::Manifest;

use crate::common::TestContext;

const ALL: &[&str] = &[
    "pca", "genept", "scvi", "scimilarity", "scbert", "cellfm", "cellplm", "sccello", "scgpt", "geneformer", "scfoundation", "langcell", "scprint", "uce", "c2s", "cellama", "novae", "harmony", "seurat", "scvi_denovo", "scgpt_integrated",
];

#[test]
fn every_method_is_registered() {
    let reg = Registry::builtin();
    let names: Vec<&str> = reg.methods.keys().map(String::as_str).collect();
    let mut want = ALL.to_vec();
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn batch_defaults_and_options() {
    let reg = Registry::builtin();
    let batch = |m: &str| reg.methods[m].batch.as_ref().map(|b| b.default);
    for m in ["cellama", "scfoundation", "genept", "pca"] {
        assert_eq!(batch(m), None, "{m} has no batch option");
    }
    // Novae's subgraphs per forward pass: upstream's Novae(batch_size=256).
    assert_eq!(batch("novae"), Some(256));
    assert_eq!(batch("c2s"), Some(8));
    assert_eq!(batch("uce"), Some(16));
    assert_eq!(batch("scimilarity"), Some(2048));
    assert_eq!(batch("scgpt"), Some(64));
    for (name, m) in &reg.methods {
        if let Some(b) = &m.batch {
            assert!(!b.source.trim().is_empty(), "{name}: batch default without a source");
        }
    }
    assert!(reg.methods["cellplm"].honoured("finetune").is_empty());
    assert_eq!(reg.methods["cellama"].honoured("finetune"), ["--batch-size", "--predict-batch-size"]);
    assert_eq!(reg.methods["pca"].honoured("finetune"), ["--batch-size", "--predict-batch-size"]);
    assert_eq!(reg.methods["scgpt_integrated"].honoured("integrate"), ["--integration-batch-size"]);
    assert_eq!(reg.methods["scgpt"].honoured("finetune"), ["--batch-size", "--predict-batch-size"]);
    let knob = |m: &str, f: &str| reg.methods[m].knob(f).map(|k| k.default.as_integer().unwrap());
    assert_eq!(knob("scprint", "--max-len"), Some(4000));
    assert_eq!(knob("uce", "--nlayers"), Some(33));
}

#[test]
fn cost_tiers_are_ordered() {
    let reg = Registry::builtin();
    let tiers: [&[&str]; 5] = [&["pca", "genept"], &["scvi", "scimilarity"], &["scbert", "cellfm", "cellplm", "sccello"], &["scgpt", "geneformer", "scfoundation", "langcell"], &["scprint", "uce", "c2s"]];
    for (i, group) in tiers.iter().enumerate() {
        for m in *group {
            assert_eq!(reg.methods[*m].cost_tier as usize, i + 1, "{m}");
        }
    }
}

#[test]
fn weights_referenced_exist_and_belong() {
    let reg = Registry::builtin();
    let man = Manifest::builtin();
    for (name, m) in &reg.methods {
        for id in &m.weights {
            let e = man.weights.get(id).unwrap_or_else(|| panic!("{name} lists weights {id} missing from weights.toml"));
            // a method may reuse another's checkpoint (scgpt_integrated runs scgpt's)
            assert!(e.method == *name || name.starts_with(&e.method), "{id} belongs to {} but {name} lists it", e.method);
        }
    }
    for (id, e) in &man.weights {
        assert!(reg.methods.contains_key(&e.method), "{id}: unknown method {}", e.method);
        assert!(!e.licence.is_empty(), "{id}: no licence");
    }
    assert!(man.weights.len() >= 20);
}

#[test]
fn methods_table_snapshot() {
    let ctx = TestContext::new();
    let r = ctx.run(&["methods"]);
    r.success();
    insta::assert_snapshot!("methods_table", r.stdout);
}

#[test]
fn methods_show_uce_snapshot() {
    let ctx = TestContext::new();
    let r = ctx.run(&["methods", "show", "uce"]);
    r.success();
    assert!(r.stdout.contains("batch size:  16"));
    assert!(r.stdout.contains("--nlayers"));
    insta::assert_snapshot!("methods_show_uce", r.stdout);
}

#[test]
fn methods_show_unknown() {
    let ctx = TestContext::new();
    ctx.run(&["methods", "show", "geneformr"]).user_error().stderr_has("did you mean `geneformer`?");
}

#[test]
fn help_explains_every_command() {
    let ctx = TestContext::new();
    let r = ctx.run(&["--help"]);
    r.success();
    for cmd in ["init", "methods", "weights", "embed", "transfer", "finetune", "integrate", "benchmark", "geometry", "config", "trace"] {
        assert!(r.stdout.contains(&format!("  {cmd} ")), "--help lacks {cmd}:\n{}", r.stdout);
    }
    let r = ctx.run(&["embed", "--help"]);
    r.success();
    for flag in ["--method", "--data", "--out", "--in-place", "--layer", "--seed", "--batch-size", "--n-comps"] {
        assert!(r.stdout.contains(flag), "embed --help lacks {flag}");
    }
}

#[test]
fn finetune_requires_method_and_labels() {
    let ctx = TestContext::new();
    ctx.run(&["finetune", "--data", "x.h5ad"]).user_error().stderr_has("--method").stderr_has("--label-key");
}
