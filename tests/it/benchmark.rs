//! `scfoundry benchmark` and `scfoundry geometry`: outputs on the demo data, bad input
//! (each a clear error or scib-metrics' NaN with a warning), and agreement with
//! scib-metrics on the demo data's PCA (tests/fixtures/scib/demo_wu2020_pca.json).

use crate::common::{repo, TestContext, Tiny};
use serde_json::Value;

/// Cells in 3 types (i % 3) and 2 batches (first/second half), with an embedding that
/// separates the types (`X_good`) and one that does not (`X_noise`).
fn tiny_bench(n: usize) -> Tiny {
    let mut s = 12345u64;
    let mut u = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let d = 6;
    let mut good = vec![0f32; n * d];
    let mut noise = vec![0f32; n * d];
    for i in 0..n {
        for j in 0..d {
            good[i * d + j] = u() + if j == i % 3 { 4.0 } else { 0.0 } + if i >= n / 2 { 0.3 } else { 0.0 };
            noise[i * d + j] = u();
        }
    }
    Tiny::counts(n, 20)
        .with_obs("cell_type", (0..n).map(|i| format!("type_{}", i % 3)).collect())
        .with_obs("batch", (0..n).map(|i| if i < n / 2 { "b1".into() } else { "b2".into() }).collect())
        .with_obsm("X_good", good, d)
        .with_obsm("X_noise", noise, d)
}

fn bench_args<'a>(file: &'a str, emb: &'a str) -> Vec<&'a str> {
    vec!["benchmark", "--data", file, "--embedding", emb, "--label-key", "cell_type", "--batch-key", "batch"]
}

fn read_json(p: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

#[test]
fn benchmark_ranks_embeddings_and_writes_outputs() {
    let ctx = TestContext::new();
    tiny_bench(150).write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_noise,X_good");
    args.extend(["--per-cell", "--out", "res"]);
    let r = ctx.run(&args);
    r.success();
    // ranked: the embedding that separates the types first
    let first = r.stdout.lines().nth(1).unwrap();
    assert!(first.starts_with("1") && first.contains("X_good"), "{}", r.stdout);
    let dir = ctx.path("res");
    for f in ["results.tsv", "results.json", "results.svg", "results.png", "lisi_per_cell.tsv"] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let png = std::fs::read(dir.join("results.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let j = read_json(&dir.join("results.json"));
    assert_eq!(j["implementation"], "scfoundry-metrics 0.1.0 (scib-metrics 0.6.1 definitions)");
    assert_eq!(j["neighbors"]["k"], 90);
    assert_eq!(j["seed"], 0);
    let res = j["results"].as_array().unwrap();
    assert_eq!(res.len(), 2);
    assert_eq!(res[0]["embedding"], "X_good");
    for e in res {
        let m = e["metrics"].as_object().unwrap();
        assert_eq!(m.len(), 10, "the Benchmarker's default metric rows");
        for (_, v) in m {
            assert_eq!(v["implementation"], j["implementation"]);
        }
        assert_eq!(e["aggregates"]["Total"]["implementation"], j["implementation"]);
    }
    // KMeans over seeds 0..4 beside the one-run value (default --kmeans-seeds 5)
    assert_eq!(j["kmeans_seeds"], serde_json::json!([0, 1, 2, 3, 4]));
    for e in res {
        let sp = &e["kmeans_seed_spread"];
        assert_eq!(sp["seeds"].as_array().unwrap().len(), 5);
        for w in ["nmi", "ari"] {
            let s = &sp[format!("{w}_summary")];
            let (lo, mean, hi) = (s["min"].as_f64().unwrap(), s["mean"].as_f64().unwrap(), s["max"].as_f64().unwrap());
            assert!(lo <= mean && mean <= hi, "{w}: {s}");
            // seed 0 of the spread is the headline run
            let key = format!("nmi_ari_cluster_labels_kmeans_{w}");
            assert_eq!(sp[w][0].as_f64().unwrap(), e["metrics"][&key]["value"].as_f64().unwrap());
        }
        let r = sp["ranking_score_range"].as_array().unwrap();
        assert!(r[0].as_f64().unwrap() <= e["aggregates"]["Total"]["value"].as_f64().unwrap() + 1e-12);
        assert!(r[1].as_f64().unwrap() >= e["aggregates"]["Total"]["value"].as_f64().unwrap() - 1e-12);
    }
    assert!(r.stdout.contains("KMeans over seeds 0..4"), "{}", r.stdout);
    // the O(n²) passes, each timed, on the CPU without --device cuda, none fell back
    let dense = &j["dense_passes"];
    assert_eq!(dense["device"], "cpu");
    assert_eq!(j["neighbors"]["device"], "cpu");
    assert_eq!(dense["fallbacks"].as_array().unwrap().len(), 0);
    let passes = dense["passes"].as_array().unwrap();
    for what in ["90-NN", "label silhouette distances", "kBET diffusion map", "kBET diffusion kNN"] {
        let p: Vec<&Value> = passes.iter().filter(|p| p["what"] == what).collect();
        assert!(!p.is_empty(), "no {what} pass in {dense}");
        assert!(p.iter().all(|p| p["device"] == "cpu" && p["seconds"].as_f64().unwrap() >= 0.0), "{dense}");
    }
    // one 90-NN and one label silhouette an embedding, of every cell
    let count = |what: &str| passes.iter().filter(|p| p["what"] == what && p["cells"] == 150).count();
    assert_eq!((count("90-NN"), count("label silhouette distances")), (2, 2), "{dense}");
    let tsv = std::fs::read_to_string(dir.join("results.tsv")).unwrap();
    assert_eq!(tsv.lines().count(), 3);
    assert!(tsv.lines().next().unwrap().ends_with("implementation"));
    let per_cell = std::fs::read_to_string(dir.join("lisi_per_cell.tsv")).unwrap();
    assert_eq!(per_cell.lines().count(), 151);
    assert!(per_cell.starts_with("cell\tX_noise_ilisi\tX_noise_clisi\tX_good_ilisi\tX_good_clisi"));
    let svg = std::fs::read_to_string(dir.join("results.svg")).unwrap();
    assert!(svg.contains("Bio conservation") && svg.contains("X_good") && svg.contains("t.h5ad"));
}

/// A file whose X is a placeholder (n x 1) scores every other default metric and leaves PCR
/// out with a warning; `--pre-integrated KEY` scores PCR against that embedding instead, and X
/// is then not read at all (a file without X scores too).
#[test]
fn benchmark_pcr_left_out_without_usable_x_and_scored_with_pre_integrated() {
    let ctx = TestContext::new();
    let mut t = tiny_bench(150);
    t.n_vars = 1;
    t.var_names.truncate(1);
    t.x = (0..150).map(|i| (i % 5) as f32).collect();
    let pre: Vec<f32> = t.obsm[0].1.iter().enumerate().map(|(i, v)| v + if (i / 6) >= 75 { 2.0 } else { 0.0 }).collect();
    t = t.with_obsm("X_unintegrated", pre, 6);
    t.write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--out", "no_pcr"]);
    let r = ctx.run(&args);
    r.success();
    assert!(r.stderr.contains("PCR comparison left out") && r.stderr.contains("too small for a PCA") && r.stderr.contains("--pre-integrated"), "{}", r.stderr);
    let j = read_json(&ctx.path("no_pcr/results.json"));
    let m = j["results"][0]["metrics"].as_object().unwrap();
    assert_eq!(m.len(), 9, "every default metric but PCR");
    assert!(!m.contains_key("pcr_comparison"));
    assert!(j["x_pre"]["left_out"].as_str().unwrap().contains("too small"));

    assert!(j["results"][0]["kmeans_seed_spread"].is_object());
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--pre-integrated", "X_unintegrated", "--kmeans-seeds", "1", "--out", "pcr"]);
    let r = ctx.run(&args);
    r.success();
    assert!(!r.stderr.contains("left out"), "{}", r.stderr);
    let j = read_json(&ctx.path("pcr/results.json"));
    assert_eq!(j["x_pre"]["source"], "obsm/X_unintegrated");
    assert!(j["kmeans_seeds"].is_null() && j["results"][0]["kmeans_seed_spread"].is_null(), "--kmeans-seeds 1 is off");
    let pcr = j["results"][0]["metrics"]["pcr_comparison"]["value"].as_f64().unwrap();
    assert!(pcr > 0.0 && pcr <= 1.0, "the pre-integrated embedding carries a batch shift the integrated one mostly lacks: {pcr}");

    // no X at all: --pre-integrated needs none
    let mut nox = tiny_bench(150);
    nox.write_x = false;
    let pre: Vec<f32> = nox.obsm[0].1.clone();
    nox.with_obsm("X_unintegrated", pre, 6).write(&ctx.path("nox.h5ad"));
    let mut args = bench_args("nox.h5ad", "X_good");
    args.extend(["--pre-integrated", "X_unintegrated", "--metrics", "pcr,ilisi", "--out", "nox"]);
    ctx.run(&args).success();
    // a wrong key is an error naming the key
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--pre-integrated", "X_nope"]);
    ctx.run(&args).user_error().stderr_has("X_nope");
}

#[test]
fn benchmark_batch_subsample_is_recorded() {
    let ctx = TestContext::new();
    tiny_bench(150).write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--batch-max-cells", "120", "--seed", "7", "--metrics", "bio,bras,ilisi,graph_connectivity"]);
    ctx.run(&args).success();
    let j = read_json(&ctx.path("t.benchmark/results.json"));
    assert_eq!(j["subsample"]["batch_metric_cells"], 120);
    assert_eq!(j["subsample"]["bio_metric_cells"], 150);
    assert_eq!(j["subsample"]["seed"], 7);
    assert_eq!(j["kmeans_seeds"], serde_json::json!([7, 8, 9, 10, 11]), "the spread's seeds start at --seed");
    assert_eq!(j["results"][0]["metrics"].as_object().unwrap().len(), 8);
}

#[test]
fn benchmark_missing_embedding_names_file_key_and_what_exists() {
    let ctx = TestContext::new();
    tiny_bench(120).write(&ctx.path("t.h5ad"));
    ctx.run(&bench_args("t.h5ad", "X_good,X_scvi"))
        .user_error()
        .stderr_has("t.h5ad: obsm/X_scvi")
        .has_hint()
        .stderr_has("X_good, X_noise");
}

#[test]
fn benchmark_missing_label_key_lists_obs_columns() {
    let ctx = TestContext::new();
    tiny_bench(120).write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_good");
    args[6] = "celltype";
    ctx.run(&args).user_error().stderr_has("t.h5ad: obs/celltype: is missing").stderr_has("cell_type, batch");
}

#[test]
fn benchmark_embedding_with_nan() {
    let ctx = TestContext::new();
    let mut t = tiny_bench(120);
    t.obsm[0].1[5 * 6 + 2] = f32::NAN;
    t.write(&ctx.path("t.h5ad"));
    ctx.run(&bench_args("t.h5ad", "X_good"))
        .user_error()
        .stderr_has("t.h5ad: obsm/X_good: holds 1 non-finite value(s); the first is NaN at cell 5 (cell_5), column 2")
        .has_hint();
}

#[test]
fn benchmark_one_label_category() {
    let ctx = TestContext::new();
    let mut t = tiny_bench(120);
    t.obs_cols[0].1 = vec!["T cell".into(); 120];
    t.write(&ctx.path("t.h5ad"));
    ctx.run(&bench_args("t.h5ad", "X_good"))
        .user_error()
        .stderr_has("obs/cell_type: has a single category (\"T cell\")")
        .stderr_has("--metrics batch");
    // the batch metrics alone are defined
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--metrics", "batch"]);
    ctx.run(&args).success();
}

#[test]
fn benchmark_one_batch() {
    let ctx = TestContext::new();
    let mut t = tiny_bench(120);
    t.obs_cols[1].1 = vec!["only".into(); 120];
    t.write(&ctx.path("t.h5ad"));
    ctx.run(&bench_args("t.h5ad", "X_good")).user_error().stderr_has("obs/batch: has a single batch").stderr_has("--metrics bio");
}

#[test]
fn benchmark_fewer_cells_than_k() {
    let ctx = TestContext::new();
    tiny_bench(60).write(&ctx.path("t.h5ad"));
    ctx.run(&bench_args("t.h5ad", "X_good")).user_error().stderr_has("has 60 cells").stderr_has("90 neighbours").has_hint();
}

#[test]
fn benchmark_kbet_nan_warns_like_scib() {
    // every label has fewer than 10 cells: kBET is NaN for each, as in scib-metrics
    let ctx = TestContext::new();
    let mut t = tiny_bench(120);
    t.obs_cols[0].1 = (0..120).map(|i| format!("type_{}", i % 15)).collect();
    t.write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--metrics", "kbet,ilisi,clisi"]);
    let r = ctx.run(&args);
    r.success().stderr_has("warning: KBET is NaN for X_good: every label has fewer than 10 cells");
    let j = read_json(&ctx.path("t.benchmark/results.json"));
    assert!(j["results"][0]["metrics"]["kbet_per_label"]["value"].is_null());
}

/// `--device cuda` on a build without CUDA is a clear error before any run folder, and the
/// pipeline's CPU process is refused for it with the executors that can take a GPU.
#[test]
fn benchmark_device_cuda_errors_say_what_to_do() {
    let ctx = TestContext::new();
    tiny_bench(150).write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--device", "cuda", "--out", "res"]);
    let r = ctx.run(&args);
    if !cfg!(feature = "cuda") {
        r.user_error().has_hint().stderr_has("--device cuda");
        assert!(!ctx.path("res").exists());
    }
    args.extend(["--executor", "nextflow"]);
    let r = ctx.run(&args);
    r.user_error().stderr_has("BENCHMARK process runs on CPU nodes").stderr_has("--executor local or slurm");
    // GPU options without --device cuda are not silently dropped
    let r = ctx.run(&["benchmark", "--data", "t.h5ad", "--embedding", "X_good", "--label-key", "cell_type", "--batch-key", "batch", "--gpu", "0", "--metrics", "graph_connectivity", "--out", "res2"]);
    r.success();
    assert!(r.stderr.contains("--gpu applies with --device cuda; ignored on the CPU"), "{}", r.stderr);
    // a list from SCFOUNDRY_GPUS (set for a whole shell, or by the pipeline) is not warned about
    let r = ctx.run_env(
        &["benchmark", "--data", "t.h5ad", "--embedding", "X_good", "--label-key", "cell_type", "--batch-key", "batch", "--metrics", "graph_connectivity", "--out", "res3"],
        &[("SCFOUNDRY_GPUS", std::path::Path::new("0"))],
    );
    r.success();
    assert!(!r.stderr.contains("--gpu applies"), "{}", r.stderr);
}

#[test]
fn benchmark_unknown_metric() {
    let ctx = TestContext::new();
    tiny_bench(120).write(&ctx.path("t.h5ad"));
    let mut args = bench_args("t.h5ad", "X_good");
    args.extend(["--metrics", "kbett"]);
    ctx.run(&args).user_error().stderr_has("unknown metric `kbett`").stderr_has("did you mean `kbet`");
}

#[test]
fn geometry_writes_table_and_figure() {
    let ctx = TestContext::new();
    tiny_bench(150).write(&ctx.path("t.h5ad"));
    let r = ctx.run(&["geometry", "--data", "t.h5ad", "--embedding", "X_good", "--max-cells", "120", "--out", "geo"]);
    r.success();
    for f in ["geometry.tsv", "geometry.json", "geometry.svg", "geometry.png"] {
        assert!(ctx.path("geo").join(f).exists(), "{f} missing");
    }
    let tsv = std::fs::read_to_string(ctx.path("geo/geometry.tsv")).unwrap();
    for k in ["5", "15", "50"] {
        assert!(tsv.contains(&format!("neighbourhood_preservation\t{k}\t")), "{tsv}");
    }
    assert!(tsv.contains("cells_used\t\t120.000000"));
    assert!(tsv.contains("intrinsic_dim_mle\t20\t"));
}

#[test]
fn geometry_fewer_cells_than_k() {
    let ctx = TestContext::new();
    tiny_bench(40).write(&ctx.path("t.h5ad"));
    ctx.run(&["geometry", "--data", "t.h5ad", "--embedding", "X_good"]).user_error().stderr_has("40 cells").has_hint();
}

/// scfoundry benchmark on the demo data's PCA agrees with scib-metrics' Benchmarker run on
/// the same embedding (fixture written by scripts/scib_demo_reference.py).
#[test]
fn benchmark_agrees_with_scib_on_demo() {
    let fx = read_json(&repo().join("tests/fixtures/scib/demo_wu2020_pca.json"));
    let ctx = TestContext::new();
    let data = ctx.demo("wu2020_tcells.h5ad");
    let n = fx["n"].as_u64().unwrap() as usize;
    let d = fx["d"].as_u64().unwrap() as usize;
    let emb: Vec<f32> = fx["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    assert_eq!(emb.len(), n * d);
    {
        crate::common::no_hdf5_locking();
        let f = hdf5::File::open_rw(&data).unwrap();
        crate::common::write_obsm(&f.group("obsm").unwrap(), "X_pca_scanpy", &emb, d);
    }
    let r = ctx.run(&["benchmark", "--data", "wu2020_tcells.h5ad", "--embedding", "X_pca_scanpy", "--label-key", "cell_type", "--batch-key", "batch", "--out", "res"]);
    r.success();
    let ours = read_json(&ctx.path("res/results.json"));
    let ours = &ours["results"][0]["metrics"];
    let scib = fx["benchmarker"].as_object().unwrap();
    // KMeans: JAX's k-means++ stream cannot be replayed (ChaCha8 here). On 200 cells and
    // 16 labels scib-metrics' own NMI moves between 0.26 and 0.38 over seeds 0..9, so ours
    // must lie within scib's range over those seeds, +-0.02. Every other value: 1e-3.
    let mut n_checked = 0;
    for (key, want) in scib {
        let got = ours[key]["value"].as_f64().unwrap_or(f64::NAN);
        let want = want.as_f64().unwrap_or(f64::NAN);
        eprintln!("{key:40} scfoundry {got:.6}  scib-metrics {want:.6}  |diff| {:.2e}", (got - want).abs());
        if key.contains("kmeans") {
            let which = if key.ends_with("nmi") { "nmi" } else { "ari" };
            let seeds: Vec<f64> = fx["kmeans_seed_values"][which].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            let (lo, hi) = seeds.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
            assert!(got >= lo - 0.02 && got <= hi + 0.02, "{key}: ours {got} outside scib-metrics' seed range [{lo}, {hi}] +- 0.02");
        } else if want.is_nan() {
            assert!(got.is_nan(), "{key}: scib NaN, ours {got}");
        } else {
            assert!((got - want).abs() <= 1e-3, "{key}: ours {got} vs scib-metrics {want}");
        }
        n_checked += 1;
    }
    assert_eq!(n_checked, 10);
}

#[test]
fn benchmark_approx_neighbors_records_seed_and_stays_close_to_exact() {
    let ctx = TestContext::new();
    tiny_bench(600).write(&ctx.path("t.h5ad"));
    let metrics = "clisi,ilisi,graph_connectivity,kbet,silhouette_label";
    let mut exact = bench_args("t.h5ad", "X_good");
    exact.extend(["--metrics", metrics, "--out", "exact"]);
    ctx.run(&exact).success();
    let mut approx = bench_args("t.h5ad", "X_good");
    approx.extend(["--metrics", metrics, "--neighbors", "approx", "--seed", "5", "--out", "approx"]);
    ctx.run(&approx).success();
    let (e, a) = (read_json(&ctx.path("exact/results.json")), read_json(&ctx.path("approx/results.json")));
    assert_eq!(e["neighbors"]["search"], "exact");
    assert_eq!(a["neighbors"]["search"], "approx");
    assert_eq!(a["neighbors"]["seed"], 5);
    assert_eq!(a["neighbors"]["params"]["seed"], 5);
    assert!(a["neighbors"]["runs"][0]["report"]["iterations"].as_u64().unwrap() >= 1);
    for (key, v) in e["results"][0]["metrics"].as_object().unwrap() {
        let (ve, va) = (v["value"].as_f64().unwrap(), a["results"][0]["metrics"][key]["value"].as_f64().unwrap());
        assert!((ve - va).abs() <= 0.01, "{key}: exact {ve} vs approx {va}");
    }
    let mut bad = bench_args("t.h5ad", "X_good");
    bad.extend(["--neighbors", "fast"]);
    ctx.run(&bad).stderr_has("exact").stderr_has("approx");
}

/// A file with a large dense X (30,000 x 8,000 float32: 960 MB once read, about 1 MB on disk as
/// compressed zeros) and an obs column in an encoding scfoundry does not read: `benchmark`
/// (with `--pre-integrated`), `geometry` and `transfer --embedding` read only the obs columns
/// and obsm keys they use, so each runs with its data segment capped at 500 MB and never opens
/// the odd column. Without `--pre-integrated`, PCR reads X and the cap stops it.
#[test]
fn scoring_reads_only_the_obs_columns_and_obsm_keys_it_needs() {
    let ctx = TestContext::new();
    let (n, genes) = (30_000usize, 8_000usize);
    let mut t = tiny_bench(n);
    t.write_x = false;
    t.n_vars = genes;
    t.var_names = (0..genes).map(|j| format!("gene_{j}")).collect();
    let pre: Vec<f32> = t.obsm[0].1.iter().enumerate().map(|(i, v)| v + if (i / 6) >= n / 2 { 2.0 } else { 0.0 }).collect();
    t = t.with_obsm("X_unintegrated", pre, 6);
    let path = ctx.path("big.h5ad");
    t.write(&path);
    {
        crate::common::no_hdf5_locking();
        let f = hdf5::File::open_rw(&path).unwrap();
        // X: zeros, compressed about 1000:1, so the file stays small
        let x = f.new_dataset::<f32>().shape([n, genes]).chunk([256, genes]).deflate(1).create("X").unwrap();
        x.write_raw(&vec![0f32; n * genes]).unwrap();
        crate::common::enc(&x, "array", "0.2.0");
        // an obs column in an encoding from the future
        let obs = f.group("obs").unwrap();
        let odd = obs.create_group("spatial_polygons").unwrap();
        crate::common::enc(&odd, "awkward-array", "0.1.0");
        let order: Vec<hdf5::types::VarLenUnicode> = ["cell_type", "batch", "spatial_polygons"].iter().map(|s| s.parse().unwrap()).collect();
        obs.delete_attr("column-order").unwrap();
        obs.new_attr::<hdf5::types::VarLenUnicode>().shape([3]).create("column-order").unwrap().write_raw(&order).unwrap();
    }
    assert!(std::fs::metadata(&path).unwrap().len() < 20 << 20, "X compresses");
    let cap = 500u64 << 20;
    let mut args = bench_args("big.h5ad", "X_good");
    args.extend(["--pre-integrated", "X_unintegrated", "--metrics", "pcr,ilisi,graph_connectivity", "--kmeans-seeds", "1", "--out", "res"]);
    let r = ctx.run_capped(&args, &[], cap);
    r.success();
    let j = read_json(&ctx.path("res/results.json"));
    assert_eq!(j["n_cells"].as_u64(), Some(n as u64));
    assert_eq!(j["x_pre"]["source"], "obsm/X_unintegrated");
    assert!(j["results"][0]["metrics"]["pcr_comparison"]["value"].as_f64().is_some(), "{j}");
    ctx.run_capped(&["geometry", "--data", "big.h5ad", "--embedding", "X_good", "--out", "geo"], &[], cap).success();
    ctx.run_capped(&["transfer", "--embedding", "X_good", "--reference", "big.h5ad", "--query", "big.h5ad", "--label-key", "cell_type", "--pred-key", "pred", "-o", "labelled.h5ad"], &[], cap).success();
    // PCR without --pre-integrated needs X: the cap shows that X is then read
    let mut args = bench_args("big.h5ad", "X_good");
    args.extend(["--metrics", "pcr", "--out", "with_x"]);
    let r = ctx.run_capped(&args, &[], cap);
    assert!(r.code != 0, "reading X (960 MB) fits no 500 MB cap, so the runs above did not read it: {}", r.stderr);
    assert!(!ctx.path("with_x/results.json").exists());
}
