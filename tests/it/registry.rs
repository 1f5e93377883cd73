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
    for m in ["scfoundation", "genept", "pca"] {
        assert_eq!(batch(m), None, "{m} has no batch option");
    }
    // Novae's subgraphs per forward pass: upstream's Novae(batch_size=256).
    assert_eq!(batch("novae"), Some(256));
    assert_eq!(batch("c2s"), Some(8));
    // sentence-transformers' encode(batch_size=32)
    assert_eq!(batch("cellama"), Some(32));
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

/// Every implemented method that loads weights takes `--model-dir` (the same flag in embed,
/// transfer and finetune): the model's folder as upstream releases it. The others load none.
#[test]
fn every_method_with_weights_takes_a_model_dir() {
    let reg = Registry::builtin();
    for m in reg.methods.values().filter(|m| m.implemented) {
        let takes = m.knob("--model-dir").is_some();
        if !m.weights.is_empty() {
            assert!(takes, "{} loads weights ({}) but has no --model-dir knob in methods/{}.toml", m.name, m.weights.join(", "), m.name);
        }
        if takes {
            let help = &m.knob("--model-dir").unwrap().help;
            assert!(help.len() > 40, "{}: --model-dir's help should say what the folder holds", m.name);
        }
    }
    // a method without weights says why it ignores the flag
    let ctx = TestContext::new();
    crate::common::Tiny::counts(10, 8).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["embed", "-m", "pca", "-d", "t.h5ad", "--n-comps", "2", "--model-dir", "."]);
    assert!(r.stderr.contains("pca loads no weights, so --model-dir has nothing to replace; ignored"), "{}", r.stderr);
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

/// `--precision`'s help names the methods whose toml lists the option, and no other.
#[test]
fn precision_help_comes_from_the_tomls() {
    let ctx = TestContext::new();
    let r = ctx.run(&["embed", "--help"]);
    r.success();
    let start = r.stdout.find("--precision").expect("embed --help shows --precision");
    let rest = &r.stdout[start..];
    let help = &rest[..rest[2..].find("\n      --").map_or(rest.len(), |i| i + 2)];
    let reg = Registry::builtin();
    let honour: Vec<&str> = reg.methods.values().filter(|m| m.implemented && m.knob("--precision").is_some()).map(|m| m.name.as_str()).collect();
    assert!(honour.len() >= 2, "{honour:?}");
    let words: Vec<String> = help.split(|c: char| !(c.is_alphanumeric() || c == '_')).map(String::from).collect();
    for m in reg.methods.values() {
        let named = words.iter().any(|w| *w == m.name);
        assert_eq!(named, honour.contains(&m.name.as_str()), "{}: --precision help {}:\n{help}", m.name, if named { "names it" } else { "lacks it" });
    }
}

#[test]
fn finetune_requires_method_and_labels() {
    let ctx = TestContext::new();
    ctx.run(&["finetune", "--data", "x.h5ad"]).user_error().stderr_has("--method").stderr_has("--label-key");
}

/// Every toml marked implemented has one entry in the method table, and every entry has such
/// a toml.
#[test]
fn method_table_matches_the_tomls() {
    let reg = Registry::builtin();
    for m in reg.methods.values() {
        assert_eq!(m.implemented, scfoundry::tasks::table::get(&m.name).is_some(), "methods/{}.toml: implemented = {}, but the table {} it", m.name, m.implemented, if m.implemented { "lacks" } else { "has" });
    }
    let mut seen = std::collections::BTreeSet::new();
    for (name, _) in scfoundry::tasks::table::METHODS {
        assert!(seen.insert(*name), "{name} is in the table twice");
        assert!(reg.methods.get(*name).is_some_and(|m| m.implemented), "the table has {name}, but no methods/{name}.toml marked implemented");
    }
}

/// The defaults of a method's toml reach its adapter as its typed options: uce's batch is the
/// toml's 16 (upstream's 25 is not a fallback anywhere).
#[test]
fn toml_defaults_reach_the_methods() {
    use scfoundry::cli::{BatchArgs, KnobArgs};
    use scfoundry::commands::embed::resolve_method_params;
    use scfoundry::tasks::method::params;
    let reg = Registry::builtin();
    let resolve = |name: &str| resolve_method_params(&reg, &reg.methods[name], "embed", &BatchArgs::default(), &KnobArgs::default(), false).unwrap();
    let uce: scfoundry::tasks::embed::uce::Params = params("uce", &resolve("uce")).unwrap();
    assert_eq!((uce.batch_size, uce.nlayers), (16, 33));
    let pca: scfoundry::tasks::embed::pca::Params = params("pca", &resolve("pca")).unwrap();
    assert_eq!((pca.n_comps, pca.n_top_genes), (50, 2000));
    let scgpt: scfoundry::tasks::embed::scgpt::Params = params("scgpt", &resolve("scgpt")).unwrap();
    assert_eq!((scgpt.batch_size, scgpt.max_len), (64, 1200));
    let gf: scfoundry::tasks::embed::geneformer::Params = params("geneformer", &resolve("geneformer")).unwrap();
    assert_eq!((gf.batch_size, gf.emb_layer, gf.emb_mode.as_str()), (100, -1, "cell"));
    // on a GPU, a method's [batch] gpu_default (scvi's result does not depend on the batch)
    let on_gpu = resolve_method_params(&reg, &reg.methods["scvi"], "embed", &BatchArgs::default(), &KnobArgs::default(), true).unwrap();
    let scvi_cpu: scfoundry::tasks::embed::scvi::Params = params("scvi", &resolve("scvi")).unwrap();
    let scvi_gpu: scfoundry::tasks::embed::scvi::Params = params("scvi", &on_gpu).unwrap();
    assert_eq!((scvi_cpu.batch_size, scvi_gpu.batch_size), (128, 8192));
    let given = BatchArgs { batch_size: Some(300) };
    let p = resolve_method_params(&reg, &reg.methods["scvi"], "embed", &given, &KnobArgs::default(), true).unwrap();
    assert_eq!(p["batch_size"], 300, "--batch-size wins over the GPU default");
    // a parameter missing from the task is an error, never a constant in the adapter
    let mut p = resolve("uce");
    p.remove("batch_size");
    assert!(params::<scfoundry::tasks::embed::uce::Params>("uce", &p).is_err());
}

/// The pipeline's CPU-only methods (nextflow.config `cpu_methods`) are the implemented methods
/// whose toml has no CUDA path.
#[test]
fn nextflow_cpu_methods_match_the_tomls() {
    let cfg = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/nextflow.config")).unwrap();
    let line = cfg.lines().find(|l| l.trim_start().starts_with("cpu_methods")).expect("nextflow.config sets cpu_methods");
    let listed: std::collections::BTreeSet<&str> = line.split('\'').nth(1).unwrap().split(',').collect();
    let reg = Registry::builtin();
    let want: std::collections::BTreeSet<&str> = reg.methods.values().filter(|m| m.implemented && !m.cuda).map(|m| m.name.as_str()).collect();
    assert_eq!(listed, want, "nextflow.config cpu_methods");
}

/// scripts/check_registry.py reads the implemented methods from the table, not a copy.
#[test]
fn check_registry_reads_the_table() {
    let py = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/check_registry.py")).unwrap();
    assert!(py.contains("src/tasks/table.rs"), "check_registry.py must read the method table");
    assert!(!py.lines().any(|l| l.starts_with("IMPLEMENTED = {")), "check_registry.py keeps its own list of implemented methods");
}

/// Outside each method's own files (`methods/<name>.rs`, `tasks/embed/<name>.rs`) and the
/// table, no source file names a method as a string literal: the code asks the table.
#[test]
fn no_method_names_outside_their_files() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let reg = Registry::builtin();
    // files shared by some methods, and the methods they belong to
    let shared: &[(&str, &[&str])] = &[("cls_encoder", &["sccello", "langcell"]), ("scvi_pretrained", &["scvi"])];
    let mut found = Vec::new();
    let mut stack = vec![root.join("src")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().and_then(|x| x.to_str()) != Some("rs") {
                continue;
            }
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
            // src/bin/: the benchmark binary, a developer harness outside the product, whose
            // `--arch` values name encoder architectures it times without the table's adapters
            // (no task, no toml defaults): its own command-line vocabulary, not a lookup
            if rel == "src/tasks/table.rs" || rel.starts_with("src/bin/") {
                continue;
            }
            let stem = p.file_stem().unwrap().to_string_lossy().to_string();
            let own: Vec<&str> = shared.iter().find(|(f, _)| *f == stem).map(|(_, m)| m.to_vec()).unwrap_or_else(|| vec![stem.as_str()]);
            let text = std::fs::read_to_string(&p).unwrap();
            for (i, line) in text.lines().enumerate() {
                if line.trim_start().starts_with("#[cfg(test)]") {
                    break;
                }
                // a comment, or a literal that only shares a method's name (scanpy's HVG flavor
                // "seurat"), marked so at the end of its line
                if line.trim_start().starts_with("//") || line.trim_end().ends_with("// not a method name") {
                    continue;
                }
                for name in reg.methods.keys() {
                    if !own.contains(&name.as_str()) && line.contains(&format!("\"{name}\"")) {
                        found.push(format!("{rel}:{}: {name}", i + 1));
                    }
                }
            }
        }
    }
    assert!(found.is_empty(), "method names outside their own files (ask the method table instead):\n{}", found.join("\n"));
}

/// The modules of src/ import each other in one direction only (scripts/import_graph.py finds
/// no two files that import each other, directly or around a circle).
#[test]
fn import_graph_has_no_circles() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/import_graph.py");
    let Ok(out) = std::process::Command::new("python3").arg(script).output() else {
        eprintln!("skipped: no python3");
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
}

/// What adding a method costs (CONTRIBUTING.md, "Add a method"): each entry of the table has its
/// toml, its model file, its adapter, its docs page and its tests under its own name, apart from
/// the exceptions listed here with their reason.
#[test]
fn every_method_has_its_files() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // (method, the file's kind, where it is instead or "" for none, why)
    let exceptions: &[(&str, &str, &str, &str)] = &[
        ("pca", "docs", "", "README.md's method table and BENCHMARKS.md cover it"),
        ("harmony", "docs", "", "README.md's method table and BENCHMARKS.md cover it"),
        ("scvi", "model", "src/methods/scvi_pretrained.rs", "scvi-tools' saved models, beside the de novo model"),
        ("scvi", "tests", "tests/it/scvi_pretrained.rs", "named after its model file"),
        ("scvi_denovo", "model", "src/methods/scvi.rs", "the scVI model it trains"),
        ("sccello", "adapter", "src/tasks/embed/cls_encoder.rs", "one adapter for the two [CLS] encoders"),
        ("langcell", "adapter", "src/tasks/embed/cls_encoder.rs", "one adapter for the two [CLS] encoders"),
    ];
    let mut missing = Vec::new();
    for (name, _) in scfoundry::tasks::table::METHODS {
        let adapter = if root.join(format!("src/tasks/integrate/{name}.rs")).is_file() { format!("src/tasks/integrate/{name}.rs") } else { format!("src/tasks/embed/{name}.rs") };
        let wanted = [
            ("toml", format!("methods/{name}.toml")),
            ("model", format!("src/methods/{name}.rs")),
            ("adapter", adapter),
            ("docs", format!("docs/{name}.md")),
            ("tests", format!("tests/it/{name}.rs")),
        ];
        for (kind, path) in wanted {
            let path = match exceptions.iter().find(|(m, k, _, _)| m == name && *k == kind) {
                Some((_, _, "", _)) => continue,
                Some((_, _, instead, _)) => instead.to_string(),
                None => path,
            };
            if !root.join(&path).is_file() {
                missing.push(format!("{name}: {kind} {path}"));
            }
        }
    }
    // a page excused as missing that now exists makes its exception stale
    for (m, kind, instead, _) in exceptions {
        if *kind == "docs" && instead.is_empty() {
            assert!(!root.join(format!("docs/{m}.md")).is_file(), "docs/{m}.md exists; drop its exception");
        }
    }
    assert!(missing.is_empty(), "methods lacking their files (CONTRIBUTING.md, \"Add a method\"):\n{}", missing.join("\n"));
}
