//! langcell against the committed fixture (tests/fixtures/langcell/, made by
//! scripts/langcell_reference.py from upstream's own functions; CI never installs torch): a
//! small random cell encoder in LangCell's checkpoint layout (cell_bert/config.json,
//! cell_bert/pytorch_model.bin, cell_proj.bin), the V1-format dictionaries, and the 50 demo
//! cells of tests/fixtures/geneformer/pbmc68k_50.h5ad. Token ids must be identical for every
//! cell; embeddings within 1e-4 relative error and of unit length.

use std::path::PathBuf;

use scfoundry::tasks::embed::cls_encoder::load;
use scfoundry::nn::cls_encoder::Arch;

use crate::common::{repo, TestContext};
use crate::common::read_obsm;
use crate::sccello::{cells_h5ad, check, matrix, max_rel, reference, MAX_REL};

fn fx() -> PathBuf {
    repo().join("tests/fixtures/langcell")
}

#[test]
fn langcell_cell_encoder_matches_upstream() {
    check(Arch::Langcell, &fx(), &fx(), 32);
    check(Arch::Langcell, &fx(), &fx(), 7);
    let m = load(Arch::Langcell, &fx(), candle_core::Device::Cpu).unwrap();
    assert_eq!(m.dim(), 256);
    assert!(m.weights_path.ends_with("cell_bert/pytorch_model.bin"));
    // the embedding is L2-normalised, as the Pooler's F.normalize
    let tokens = crate::sccello::our_tokens(&m);
    let rows = m.embed(&tokens[..4], 4, |_| {}).unwrap();
    for r in rows.chunks(256) {
        let n: f32 = r.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((n - 1.0).abs() < 1e-5, "{n}");
    }
}

#[test]
fn langcell_embed_command_with_model_dir() {
    let ctx = TestContext::new();
    std::fs::copy(cells_h5ad(), ctx.path("cells.h5ad")).unwrap();
    let r = ctx.run(&["embed", "-m", "langcell", "-d", "cells.h5ad", "--model-dir", fx().to_str().unwrap(), "--batch-size", "5"]);
    r.success();
    crate::common::assert_shards_equal(&ctx, &["embed", "-m", "langcell", "-d", "cells.h5ad", "--model-dir", fx().to_str().unwrap(), "--batch-size", "1"], &[], "X_langcell", 2, 0);
    assert!(r.stderr.contains("were truncated"), "{}", r.stderr);
    let (got, dim) = read_obsm(&ctx.path("cells.langcell.h5ad"), "X_langcell");
    assert_eq!(dim, 256);
    let err = max_rel(&got, &matrix(&reference(&fx())["embeddings"]), dim);
    assert!(err < MAX_REL, "{err}");
}

#[test]
fn langcell_bad_checkpoints_name_the_file() {
    let ctx = TestContext::new();
    std::fs::copy(cells_h5ad(), ctx.path("cells.h5ad")).unwrap();
    let dir = ctx.path("ckpt");
    std::fs::create_dir_all(dir.join("cell_bert")).unwrap();
    for f in ["token_dictionary.pkl", "gene_median_dictionary.pkl", "cell_bert/config.json", "cell_bert/pytorch_model.bin"] {
        std::fs::copy(fx().join(f), dir.join(f)).unwrap();
    }
    // no cell_proj.bin
    let r = ctx.run(&["embed", "-m", "langcell", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap()]);
    r.failed().stderr_has("cell_proj.bin").stderr_has("<cls> state");
    // a cell_proj.bin that is not an nn.Linear state dict (here: a whole BertModel's)
    std::fs::copy(fx().join("cell_bert/pytorch_model.bin"), dir.join("cell_proj.bin")).unwrap();
    let r = ctx.run(&["embed", "-m", "langcell", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap()]);
    r.failed().stderr_has("cell_proj.bin").stderr_has("nn.Linear");
    // a projection for another hidden size
    std::fs::copy(repo().join("tests/fixtures/geneformer/v1/pytorch_model.bin"), dir.join("cell_bert/pytorch_model.bin")).unwrap();
    std::fs::copy(fx().join("cell_proj.bin"), dir.join("cell_proj.bin")).unwrap();
    let r = ctx.run(&["embed", "-m", "langcell", "-d", "cells.h5ad", "--model-dir", dir.to_str().unwrap()]);
    r.failed().stderr_has("pytorch_model.bin");
    // without pinned weights the run stops before it starts, naming the entries
    let r = ctx.run(&["embed", "-m", "langcell", "-d", "cells.h5ad", "--weights-dir", ctx.path("w").to_str().unwrap()]);
    r.user_error().stderr_has("langcell-cell-bert-model").stderr_has("langcell-cell-proj");
}

/// `__bench-encoder --arch langcell` (LangCell's encoder and projection at the released shape,
/// random weights) on the CPU in bf16, as `embed --precision bf16` loads it: the encoder in bf16,
/// the projection in float32 (built in bf16, it met the float32 `<cls>` rows and failed), and the
/// cells batched by tokens.
#[test]
fn bench_encoder_langcell_runs_in_bf16_in_token_batches() {
    let t = TestContext::new();
    let lengths = t.path("lengths.txt");
    // 6 cells: 2 of 11 tokens (10 genes + <cls>), 4 of 3
    std::fs::write(&lengths, "10\n10\n2\n2\n2\n2\n").unwrap();
    let args = ["__bench-encoder", "--arch", "langcell", "--device", "cpu", "--dtype", "bf16", "--cells", "6", "--batch", "1", "--repeat", "1", "--lengths", lengths.to_str().unwrap()];
    let run = t.run(&args);
    run.success();
    let v: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", run.stdout));
    assert_eq!((v["arch"].as_str(), v["dtype"].as_str(), v["embedding_dim"].as_u64()), (Some("langcell"), Some("bf16"), Some(256)), "{v}");
    assert!(v["cells_per_s"].as_f64().unwrap() > 0.0, "{v}");
    // a budget of 1 x 11 tokens: [11], [11], then the four 3-token cells (3 fit a batch, at most 8)
    assert_eq!(v["batches"].as_u64().unwrap(), 4, "{v}");
    let by_cells = t.run(&[&args[..], &["--batching", "cells"]].concat());
    by_cells.success();
    assert_eq!(serde_json::from_str::<serde_json::Value>(by_cells.stdout.trim()).unwrap()["batches"].as_u64().unwrap(), 6);
}
