//! `weights import` (a file or folder the user downloaded, checked against the manifest and
//! placed in the weights folder) and `weights list`'s pin states, against a small manifest in
//! $SCFOUNDRY_MANIFEST whose entries point at share pages (no server: nothing is downloaded).
//! Also: docs/weights.md's table is the manifest's.

use std::path::{Path, PathBuf};

use crate::common::{repo, sha256, TestContext};

const MODEL: &[u8] = b"toy model weights, pinned in the manifest";
const VOCAB: &[u8] = b"{\"<pad>\": 0, \"CD3E\": 1}";

fn hex_sha(b: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(b))
}

/// A test folder with a manifest of four toy entries of `pca` (any method name resolves):
/// one pinned by sha256, three unpinned behind share pages.
struct Import {
    ctx: TestContext,
    manifest: PathBuf,
}

impl Import {
    fn new() -> Import {
        let ctx = TestContext::new();
        let manifest = ctx.path("manifest.toml");
        let text = format!(
            r#"[weights."toy-model"]
method = "pca"
file = "toy/release/model.bin"
url = "https://example.org/toy/model.bin"
revision = "r1"
size = {}
sha256 = "{}"
licence = "MIT"

[weights."toy-vocab"]
method = "pca"
file = "toy/release/vocab.json"
url = "https://drive.google.com/drive/folders/toy"
revision = "unpinned"
licence = "MIT"

[weights."toy-args"]
method = "pca"
file = "toy/release/args.json"
url = "https://www.dropbox.com/scl/fo/toy/h?dl=0"
revision = "unpinned"
licence = "MIT"

[weights."toy-extra"]
method = "pca"
file = "toy/extra.bin"
url = "https://huggingface.co/toy/model/tree/main"
revision = "unpinned"
licence = "MIT"
"#,
            MODEL.len(),
            hex_sha(MODEL)
        );
        std::fs::write(&manifest, text).unwrap();
        Import { ctx, manifest }
    }

    fn run(&self, args: &[&str]) -> crate::common::Run {
        self.ctx.run_env(args, &[("SCFOUNDRY_MANIFEST", self.manifest.as_path())])
    }

    fn weights(&self, rel: &str) -> PathBuf {
        self.ctx.path("weights-cache").join(rel)
    }

    /// A file outside the weights folder, as a browser would have saved it.
    fn download(&self, rel: &str, bytes: &[u8]) -> PathBuf {
        let p = self.ctx.path("Downloads").join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn weights_import_checks_a_pinned_file_and_refuses_a_mismatch() {
    let t = Import::new();
    // the wrong bytes under the right name: refused, naming the file, both hashes and the fix
    let bad = t.download("bad/model.bin", b"toy model weights, but another release of them");
    let r = t.run(&["weights", "import", "toy-model", s(&bad)]);
    r.user_error()
        .stderr_has(&format!("toy-model: {} has sha256 {}, but weights.toml pins {}", bad.display(), hex_sha(b"toy model weights, but another release of them"), hex_sha(MODEL)))
        .stderr_has("hint: this is not the file pinned for toy-model (revision r1): download it again from https://example.org/toy/model.bin")
        .stderr_has("nothing was placed");
    assert!(!t.weights("toy/release/model.bin").exists(), "nothing placed");
    assert!(!t.weights("local-pins.toml").exists(), "a pinned entry gets no local pin");
    // the right bytes: verified, placed, and found by verify and list
    let good = t.download("good/model.bin", MODEL);
    let r = t.run(&["weights", "import", "toy-model", s(&good)]);
    r.success();
    assert!(r.stderr.contains("toy-model: verified against weights.toml, placed at"), "{}", r.stderr);
    assert_eq!(sha256(&t.weights("toy/release/model.bin")), hex_sha(MODEL));
    t.run(&["weights", "verify", "toy-model"]).success();
    assert!(!t.weights("local-pins.toml").exists());
    // again: already there, nothing changes
    t.run(&["weights", "import", "toy-model", s(&good)]).success();
    // by method name, a file is matched to its entry by its name
    std::fs::remove_file(t.weights("toy/release/model.bin")).unwrap();
    let r = t.run(&["weights", "import", "pca", s(&good)]);
    r.success();
    assert!(r.stderr.contains("toy-model: verified against weights.toml"), "{}", r.stderr);
    // a name that is no entry's file: the entries to choose from
    let odd = t.download("odd.bin", MODEL);
    t.run(&["weights", "import", "pca", s(&odd)]).user_error().stderr_has("none of pca's entries by its name `odd.bin`").stderr_has("toy-model (toy/release/model.bin)");
}

#[test]
fn weights_import_pins_an_unpinned_file_locally() {
    let t = Import::new();
    let vocab = t.download("vocab.json", VOCAB);
    let r = t.run(&["weights", "import", "toy-vocab", s(&vocab)]);
    r.success();
    assert!(r.stderr.contains(&format!("toy-vocab: cannot be verified: weights.toml pins no sha256 (revision unpinned); its sha256 {} is now pinned in", hex_sha(VOCAB))), "{}", r.stderr);
    // the same record a first download writes, with the file imported as its source
    let pins = scfoundry::weights::LocalPins::load(&t.ctx.path("weights-cache")).unwrap();
    let pin = pins.get("toy-vocab").expect("a local pin");
    assert_eq!((pin.sha256.as_str(), pin.size), (hex_sha(VOCAB).as_str(), VOCAB.len() as u64));
    assert_eq!(pin.source, vocab.display().to_string());
    assert_eq!(std::fs::read(t.weights("toy/release/vocab.json")).unwrap(), VOCAB);
    let r = t.run(&["weights", "verify", "toy-vocab"]);
    r.success();
    assert!(r.stdout.contains("toy-vocab: verified"), "{}", r.stdout);
    // another file for the same entry is refused against the local pin, then accepted with --repin
    let other = t.download("new/vocab.json", b"{\"<pad>\": 0}");
    let r = t.run(&["weights", "import", "toy-vocab", s(&other)]);
    r.user_error()
        .stderr_has(&format!("but this weights folder's {}", t.weights("local-pins.toml").display()))
        .stderr_has(&format!("pins {}", hex_sha(VOCAB)))
        .stderr_has("`scfoundry weights import --repin toy-vocab");
    assert_eq!(std::fs::read(t.weights("toy/release/vocab.json")).unwrap(), VOCAB, "nothing replaced");
    let r = t.run(&["weights", "import", "--repin", "toy-vocab", s(&other)]);
    r.success();
    assert!(r.stderr.contains(&format!("(replacing {})", hex_sha(VOCAB))), "{}", r.stderr);
    t.run(&["weights", "verify", "toy-vocab"]).success();
    // a pinned entry whose place holds another file: refused unless --force
    std::fs::create_dir_all(t.weights("toy/release")).unwrap();
    std::fs::write(t.weights("toy/release/model.bin"), b"placed by hand, some other file").unwrap();
    let good = t.download("model.bin", MODEL);
    t.run(&["weights", "import", "toy-model", s(&good)]).user_error().stderr_has("already holds a different file").stderr_has("--force");
    t.run(&["weights", "import", "--force", "toy-model", s(&good)]).success();
    assert_eq!(sha256(&t.weights("toy/release/model.bin")), hex_sha(MODEL));
}

#[test]
fn weights_import_takes_a_release_folder_and_a_hugging_face_cache_entry() {
    let t = Import::new();
    // an upstream release folder: each entry's file found by the tail of its path
    let dir = t.ctx.path("Downloads/release");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.bin"), MODEL).unwrap();
    std::fs::write(dir.join("vocab.json"), VOCAB).unwrap();
    let r = t.run(&["weights", "import", "pca", s(&dir)]);
    r.success();
    assert!(r.stderr.contains("toy-model: verified against weights.toml"), "{}", r.stderr);
    assert!(r.stderr.contains("toy-vocab: cannot be verified"), "{}", r.stderr);
    assert!(r.stderr.contains(&format!("toy-args: not in {}", dir.display())), "{}", r.stderr);
    assert!(t.weights("toy/release/model.bin").is_file() && t.weights("toy/release/vocab.json").is_file());
    // a Hugging Face cache entry: refs/main names the snapshot, whose files link into blobs/
    let hf = t.ctx.path("hub/models--toy--model");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(hf.join("blobs")).unwrap();
    std::fs::create_dir_all(hf.join("refs")).unwrap();
    std::fs::create_dir_all(hf.join("snapshots").join(rev)).unwrap();
    std::fs::write(hf.join("refs/main"), rev).unwrap();
    std::fs::write(hf.join("blobs/feedbeef"), b"{\"nlayers\": 2}").unwrap();
    std::os::unix::fs::symlink("../../blobs/feedbeef", hf.join("snapshots").join(rev).join("args.json")).unwrap();
    let r = t.run(&["weights", "import", "--link", "pca", s(&hf)]);
    r.success();
    assert!(r.stderr.contains("toy-args: cannot be verified"), "{}", r.stderr);
    let placed = t.weights("toy/release/args.json");
    assert_eq!(std::fs::read_link(&placed).unwrap(), std::fs::canonicalize(hf.join("blobs/feedbeef")).unwrap(), "--link links the blob itself");
    t.run(&["weights", "verify", "pca"]).success();
    // a cache entry without refs/main, and a folder with none of the files: clear errors
    std::fs::remove_file(hf.join("refs/main")).unwrap();
    t.run(&["weights", "import", "pca", s(&hf)]).user_error().stderr_has("without refs/main").stderr_has(&format!("snapshots: {rev}"));
    let empty = t.ctx.path("Downloads/empty");
    std::fs::create_dir_all(&empty).unwrap();
    t.run(&["weights", "import", "pca", s(&empty)]).user_error().stderr_has("holds none of the files of pca's entries").stderr_has("toy-model (toy/release/model.bin)");
}

#[test]
fn weights_list_states_who_pins_what() {
    let t = Import::new();
    // toy-model: pinned by weights.toml, present and verified; toy-vocab: pinned locally by an
    // import; toy-args: unpinned, placed by hand; toy-extra: unpinned, missing
    t.run(&["weights", "import", "toy-model", s(&t.download("model.bin", MODEL))]).success();
    t.run(&["weights", "import", "toy-vocab", s(&t.download("vocab.json", VOCAB))]).success();
    std::fs::write(t.weights("toy/release/args.json"), b"{}").unwrap();
    let r = t.run(&["weights", "list"]);
    r.success();
    let out = r.stdout.replace(&t.ctx.path("weights-cache").display().to_string(), "[WEIGHTS]");
    insta::assert_snapshot!("weights_list_states", out);
    // a wrong file under a pinned entry is shown as such
    std::fs::write(t.weights("toy/release/model.bin"), b"changed").unwrap();
    let r = t.run(&["weights", "list", "--hash"]);
    assert!(r.stdout.lines().any(|l| l.starts_with("toy-model") && l.contains("pinned (weights.toml)") && l.contains("WRONG SIZE")), "{}", r.stdout);
}

/// docs/weights.md carries the manifest's table (`scfoundry weights list --markdown`) between
/// its markers: every entry, whether weights.toml pins its sha256, and how to get it.
#[test]
fn weights_doc_table_is_the_manifest() {
    let doc = std::fs::read_to_string(repo().join("docs/weights.md")).unwrap();
    let (begin, end) = ("<!-- weights table: `scfoundry weights list --markdown` -->\n", "<!-- end of weights table -->");
    let at = doc.find(begin).expect("the table's begin marker in docs/weights.md") + begin.len();
    let to = at + doc[at..].find(end).expect("the table's end marker");
    let want = scfoundry::commands::weights::manifest_table(&scfoundry::weights::Manifest::builtin(), None);
    assert!(doc[at..to] == want, "docs/weights.md's table is not the manifest's: replace it with the output of `scfoundry weights list --markdown`\n--- manifest's table ---\n{want}");
    // and the binary prints the same
    let ctx = TestContext::new();
    let r = ctx.run(&["weights", "list", "--markdown"]);
    r.success();
    assert_eq!(r.stdout, want);
    // nothing claims a pin that is not there: every `yes` row has a sha256 in weights.toml
    let m = scfoundry::weights::Manifest::builtin();
    for line in want.lines().skip(2) {
        let id = line.split('`').nth(1).unwrap();
        assert_eq!(line.contains("| yes |"), m.weights[id].sha256.is_some(), "{line}");
    }
    // the share pages are counted in the doc's prose as they are in the manifest
    let pages = m.weights.values().filter(|e| !scfoundry::weights::Fetch::of(&e.url).pullable()).count();
    assert!(doc.contains(&format!("{pages} of the {} entries", m.weights.len())), "docs/weights.md should say `{pages} of the {} entries` point at pages", m.weights.len());
}
