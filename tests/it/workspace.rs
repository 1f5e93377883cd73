//! Workspaces: init, shared weights folders, overrides, and the weights listing.

use crate::common::{sha256, TestContext};

#[test]
fn init_creates_a_workspace_and_runs_go_there() {
    let ctx = TestContext::new();
    ctx.run(&["init", "ws"]).success();
    assert!(ctx.path("ws/scfoundry.toml").is_file());
    assert!(ctx.path("ws/runs").is_dir());
    assert!(ctx.path("ws/weights").is_dir());
    ctx.demo("pbmc68k_counts.h5ad");
    ctx.run(&["--workspace", "ws", "embed", "-m", "pca", "-d", "pbmc68k_counts.h5ad", "--n-comps", "3"]).success();
    assert_eq!(std::fs::read_dir(ctx.path("ws/runs")).unwrap().count(), 1);
    assert!(!ctx.path("runs").exists());
}

#[test]
fn init_with_shared_weights_folder() {
    let ctx = TestContext::new();
    ctx.run(&["--weights-dir", "shared-w", "init", "ws1"]).success();
    ctx.run(&["--weights-dir", "shared-w", "init", "ws2"]).success();
    let c1 = std::fs::read_to_string(ctx.path("ws1/scfoundry.toml")).unwrap();
    let shared = std::path::absolute(ctx.path("shared-w")).unwrap();
    assert!(c1.contains(&shared.display().to_string()), "{c1}");
    assert!(!ctx.path("ws1/weights").exists());
    // both workspaces resolve to the same weights folder (environment cleared for this)
    for ws in ["ws1", "ws2"] {
        let out = std::process::Command::new(crate::common::BIN)
            .args(["--workspace", ws, "weights", "list", "--method", "geneformer"])
            .current_dir(ctx.dir.path())
            .env_remove("SCFOUNDRY_WEIGHTS_DIR")
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(s.contains(&shared.display().to_string()) && s.contains("workspace"), "{s}");
    }
}

#[test]
fn workspace_overrides_a_batch_default() {
    let ctx = TestContext::new();
    ctx.run(&["init", "ws"]).success();
    let cfg = ctx.path("ws/scfoundry.toml");
    let text = std::fs::read_to_string(&cfg).unwrap() + "\n[methods.uce]\nbatch_size = 8\n";
    std::fs::write(&cfg, text).unwrap();
    let r = ctx.run(&["--workspace", "ws", "methods", "show", "uce"]);
    r.success();
    assert!(r.stdout.contains("batch size:  8 (set by"), "{}", r.stdout);
    let r = ctx.run(&["--workspace", "ws", "methods"]);
    assert!(r.stdout.lines().any(|l| l.starts_with("uce ") && l.contains(" 8* ")), "{}", r.stdout);
}

#[test]
fn bad_workspace_config_names_file_and_field() {
    let ctx = TestContext::new();
    ctx.run(&["init", "ws"]).success();
    std::fs::write(ctx.path("ws/scfoundry.toml"), "[methods.ucee]\nbatch_size = 8\n").unwrap();
    ctx.run(&["--workspace", "ws", "methods"]).user_error().stderr_has("scfoundry.toml: [methods.ucee]: unknown method").stderr_has("did you mean [methods.uce]?");
    std::fs::write(ctx.path("ws/scfoundry.toml"), "[weights]\ndirectory = \"w\"\n").unwrap();
    ctx.run(&["--workspace", "ws", "methods"]).user_error().stderr_has("unknown field `directory`").has_hint();
}

#[test]
fn weights_list_shows_every_entry() {
    let ctx = TestContext::new();
    let r = ctx.run(&["weights", "list"]);
    r.success();
    let man = scfoundry::weights::Manifest::builtin();
    for id in man.weights.keys() {
        assert!(r.stdout.contains(id.as_str()), "missing {id}");
    }
    assert!(r.stdout.contains("missing"));
}

#[test]
fn weights_verify_reports_a_bad_file_and_keeps_it() {
    let ctx = TestContext::new();
    let man = scfoundry::weights::Manifest::builtin();
    let (id, e) = man.weights.iter().find(|(_, e)| e.sha256.is_some() && e.size.is_some()).expect("a pinned entry");
    let path = ctx.path("weights-cache").join(&e.file);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, vec![b'x'; e.size.unwrap() as usize]).unwrap();
    let before = sha256(&path);
    let r = ctx.run(&["weights", "verify", id]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("WRONG SHA256"), "{}", r.stdout);
    assert!(r.stderr.contains("nothing was deleted"));
    assert_eq!(before, sha256(&path), "the file must be kept");
    ctx.run(&["weights", "verify", "nosuch"]).user_error().has_hint();
}
