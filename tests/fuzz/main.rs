//! Fuzzing on the stable toolchain: seeded mutation of real inputs, for a bounded time each.
//!
//! Targets: the pickle reader (`formats::pickle`), the archive extractor (`download::extract`:
//! nothing may land outside its folder), the .h5ad reader at the structure level (groups,
//! datasets and attributes with random shapes, types and encodings, built through the hdf5 crate),
//! and the torch.save reader (`formats::torch_zip`: the zip mutated whole, or its data.pkl and
//! storage records mutated and packed again; every object in data.pkl rebuilt as a tensor).
//! Each target starts from the repository's fixtures, mutates them with a seeded generator and
//! checks that the reader returns (Ok or an error) without panicking; a panic prints the seed and
//! the input's path, which then becomes a committed regression case.
//!
//! `cargo test --release --test fuzz -- --ignored --nocapture` runs every target for
//! $SCFOUNDRY_FUZZ_SECONDS (default 60) and prints its executions; `.ci/run` does so. Without
//! `--ignored` each target runs its committed regression inputs only.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// xorshift64*: a small seeded generator (the fuzzer needs speed and repeatability, not quality).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// One mutation of `b`: flip bits, overwrite with interesting bytes, insert, delete, duplicate
/// or splice a slice, as AFL's havoc stage does.
fn mutate(rng: &mut Rng, b: &mut Vec<u8>, other: &[u8]) {
    const INTERESTING: [u8; 8] = [0, 1, 0x7f, 0x80, 0xff, b'(', b'.', b'q'];
    for _ in 0..1 + rng.below(4) {
        let len = b.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                b[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                b[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(8);
                for _ in 0..n {
                    b.insert(i, rng.next() as u8);
                }
            }
            3 if len > 1 => {
                let i = rng.below(len);
                let n = (1 + rng.below(16)).min(len - i);
                b.drain(i..i + n);
            }
            4 if len > 1 => {
                let i = rng.below(len);
                let n = (1 + rng.below(32)).min(len - i);
                let piece: Vec<u8> = b[i..i + n].to_vec();
                let at = rng.below(b.len() + 1);
                b.splice(at..at, piece);
            }
            5 if !other.is_empty() => {
                let i = rng.below(other.len());
                let n = (1 + rng.below(64)).min(other.len() - i);
                let at = rng.below(b.len() + 1);
                let cut = (at + n).min(b.len());
                b.splice(at..cut, other[i..i + n].iter().copied());
            }
            _ if len > 0 => b.truncate(rng.below(len)),
            _ => b.push(rng.next() as u8),
        }
    }
}

fn budget() -> Duration {
    Duration::from_secs(std::env::var("SCFOUNDRY_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60))
}

fn seed() -> u64 {
    std::env::var("SCFOUNDRY_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5CF0_0D12)
}

fn files_with(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            files_with(&p, exts, out);
        } else if p.extension().and_then(|x| x.to_str()).is_some_and(|x| exts.contains(&x)) {
            out.push(p);
        }
    }
}

/// Run `check` on mutations of `seeds` until the time budget is spent; a panic saves the input
/// under target/fuzz-crashes and fails with its seed. Returns the executions.
fn fuzz(name: &str, seeds: &[Vec<u8>], check: impl Fn(&[u8])) -> u64 {
    assert!(!seeds.is_empty(), "{name}: no seeds");
    fuzz_with(
        name,
        |rng| {
            let mut input = seeds[rng.below(seeds.len())].clone();
            let other = &seeds[rng.below(seeds.len())];
            mutate(rng, &mut input, other);
            input
        },
        check,
    )
}

/// As `fuzz`, with the inputs made by `next` (a target that mutates the parts of a container
/// and packs them again).
fn fuzz_with(name: &str, mut next: impl FnMut(&mut Rng) -> Vec<u8>, check: impl Fn(&[u8])) -> u64 {
    let mut rng = Rng(seed() ^ name.bytes().fold(0u64, |h, c| h.wrapping_mul(31).wrapping_add(c as u64)));
    let start = Instant::now();
    let mut execs = 0u64;
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    while start.elapsed() < budget() {
        let input = next(&mut rng);
        if catch_unwind(AssertUnwindSafe(|| check(&input))).is_err() {
            std::panic::set_hook(prev);
            let dir = repo().join("target/fuzz-crashes");
            std::fs::create_dir_all(&dir).unwrap();
            let p = dir.join(format!("{name}-{execs}.bin"));
            std::fs::write(&p, &input).unwrap();
            panic!("{name}: panic after {execs} executions (seed {}); input saved to {}: commit it under tests/fuzz/regressions/{name}/", seed(), p.display());
        }
        execs += 1;
    }
    std::panic::set_hook(prev);
    println!("fuzz {name}: {execs} executions in {:.0} s, no panic (seed {})", start.elapsed().as_secs_f64(), seed());
    execs
}

/// Committed inputs that once crashed a target: each must now return without panicking.
fn regressions(name: &str, check: impl Fn(&[u8])) {
    let mut files = Vec::new();
    files_with(&repo().join("tests/fuzz/regressions").join(name), &["bin"], &mut files);
    for f in files {
        let b = std::fs::read(&f).unwrap();
        check(&b);
    }
}

// ---- pickle -------------------------------------------------------------------------------

fn pickle_check(b: &[u8]) {
    let _ = scfoundry::formats::pickle::read_pickle(b);
    let _ = scfoundry::formats::pickle::read_pickle_with(b, scfoundry::formats::pickle::PickleOptions { opaque: &["torch."], persistent_ids: true, budget: None });
}

fn pickle_seeds() -> Vec<Vec<u8>> {
    let mut files = Vec::new();
    files_with(&repo().join("tests/fixtures"), &["pkl", "pickle"], &mut files);
    files.into_iter().map(|p| std::fs::read(p).unwrap()).filter(|b| b.len() < 1 << 20).collect()
}

#[test]
fn pickle_regressions() {
    regressions("pickle", pickle_check);
}

#[test]
#[ignore = "bounded-time fuzzing: .ci/run runs it with --ignored"]
fn fuzz_pickle() {
    assert!(fuzz("pickle", &pickle_seeds(), pickle_check) > 0);
}

// ---- archives -----------------------------------------------------------------------------

/// Extract into a fresh folder inside a sandbox folder; nothing may appear in the sandbox
/// outside that folder.
fn archive_check(kind: &str, b: &[u8]) {
    let sandbox = tempfile::tempdir().unwrap();
    let archive = sandbox.path().join(format!("a.{kind}"));
    std::fs::write(&archive, b).unwrap();
    let into = sandbox.path().join("into");
    std::fs::create_dir(&into).unwrap();
    let _ = scfoundry::download::extract(kind, &archive, &into);
    let mut names: Vec<String> = std::fs::read_dir(sandbox.path()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
    names.sort();
    assert_eq!(names, [format!("a.{kind}"), "into".to_string()], "an archive member landed outside its folder");
}

fn tar_seed(entries: &[(&str, Option<&str>, &[u8])]) -> Vec<u8> {
    let mut raw = Vec::new();
    {
        let mut t = tar::Builder::new(&mut raw);
        for (name, link, data) in entries {
            let mut h = tar::Header::new_gnu();
            match link {
                Some(l) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    h.set_mode(0o777);
                    t.append_link(&mut h, name, l).unwrap();
                }
                None => {
                    h.set_size(data.len() as u64);
                    h.set_mode(0o644);
                    t.append_data(&mut h, name, *data).unwrap();
                }
            }
        }
        t.finish().unwrap();
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &raw).unwrap();
    gz.finish().unwrap()
}

fn archive_seeds() -> Vec<Vec<u8>> {
    vec![
        tar_seed(&[("m/a/file.txt", None, b"hello"), ("m/a/link", Some("file.txt"), b""), ("m/b/c.bin", None, &[1, 2, 3, 4])]),
        tar_seed(&[("m/a/b/c/d/up", Some("../../../.."), b""), ("m/a/b/c/d/up2", Some("up/../../../.."), b""), ("m/a/b/c/d/up2/outside/target.txt", None, b"x")]),
        tar_seed(&[("x", Some("y"), b""), ("y", Some("x"), b""), ("z/w", None, b"loop")]),
    ]
}

#[test]
fn archive_regressions() {
    regressions("archive", |b| archive_check("tar.gz", b));
}

#[test]
#[ignore = "bounded-time fuzzing: .ci/run runs it with --ignored"]
fn fuzz_archive() {
    // mutate the uncompressed tar (gzip's checksum would reject nearly every mutation)
    let seeds: Vec<Vec<u8>> = archive_seeds()
        .into_iter()
        .map(|gz| {
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut out).unwrap();
            out
        })
        .collect();
    let n = fuzz("archive", &seeds, |raw| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, raw).unwrap();
        archive_check("tar.gz", &gz.finish().unwrap());
    });
    assert!(n > 0);
}

// ---- h5ad at the structure level ----------------------------------------------------------

/// A random AnnData-like file: obs/var as groups or datasets, indexes of random encodings and
/// lengths, X dense or sparse with random shapes and offsets, categorical and nullable columns
/// with random codes, attributes that lie. The input bytes drive every choice.
fn build_h5ad(path: &Path, b: &[u8]) {
    use hdf5::types::VarLenUnicode;
    let mut i = 0usize;
    let mut take = || {
        let v = b.get(i).copied().unwrap_or(0);
        i += 1;
        v as usize
    };
    let f = hdf5::File::create(path).unwrap();
    let set = |loc: &hdf5::Location, k: &str, v: &str| {
        let v: VarLenUnicode = v.parse().unwrap();
        let _ = loc.new_attr::<VarLenUnicode>().shape(()).create(k).and_then(|a| a.write_scalar(&v));
    };
    let n_obs = take() % 12;
    let n_vars = take() % 9;
    let encodings = ["string-array", "nullable-string-array", "categorical", "array", "nullable-integer", "dict", "csr_matrix", "weird"];
    for (name, n) in [("obs", n_obs), ("var", n_vars)] {
        if take() % 9 == 0 {
            // a legacy compound table, or a plain dataset
            let _ = f.new_dataset::<i32>().shape([n]).create(name);
            continue;
        }
        let g = f.create_group(name).unwrap();
        set(&g, "encoding-type", "dataframe");
        set(&g, "_index", "_index");
        let len = if take() % 5 == 0 { take() % 14 } else { n };
        match take() % 4 {
            0 => {
                let v: Vec<VarLenUnicode> = (0..len).map(|k| format!("{name}{k}").parse().unwrap()).collect();
                let _ = g.new_dataset::<VarLenUnicode>().shape([len]).create("_index").and_then(|d| d.write_raw(&v));
            }
            1 => {
                let ig = g.create_group("_index").unwrap();
                set(&ig, "encoding-type", encodings[take() % encodings.len()]);
                let v: Vec<VarLenUnicode> = (0..len).map(|k| format!("c{k}").parse().unwrap()).collect();
                let _ = ig.new_dataset::<VarLenUnicode>().shape([len]).create("values").and_then(|d| d.write_raw(&v));
                let m: Vec<bool> = (0..(len + take() % 2)).map(|_| take() % 7 == 0).collect();
                let _ = ig.new_dataset::<bool>().shape([m.len()]).create("mask").and_then(|d| d.write_raw(&m));
                let c: Vec<i64> = (0..len).map(|_| take() as i64 - 3).collect();
                let _ = ig.new_dataset::<i64>().shape([len]).create("codes").and_then(|d| d.write_raw(&c));
                let _ = ig.new_dataset::<VarLenUnicode>().shape([2]).create("categories").and_then(|d| d.write_raw(&["a".parse::<VarLenUnicode>().unwrap(), "b".parse().unwrap()]));
            }
            2 => {
                let v: Vec<i64> = (0..len).map(|k| k as i64).collect();
                let _ = g.new_dataset::<i64>().shape([len]).create("_index").and_then(|d| d.write_raw(&v));
            }
            _ => {
                // claims rows it does not store
                let _ = g.new_dataset::<i64>().chunk(1024).shape([1usize << (10 + take() % 30)]).create("_index");
            }
        }
        // one column of a random encoding
        let order: Vec<VarLenUnicode> = vec!["col".parse().unwrap()];
        let _ = g.new_attr::<VarLenUnicode>().shape([1]).create("column-order").and_then(|a| a.write_raw(&order));
        let cg = g.create_group("col").unwrap();
        set(&cg, "encoding-type", encodings[take() % encodings.len()]);
        let clen = if take() % 4 == 0 { take() % 14 } else { len };
        let codes: Vec<i8> = (0..clen).map(|_| (take() % 7) as i8 - 2).collect();
        let _ = cg.new_dataset::<i8>().shape([clen]).create("codes").and_then(|d| d.write_raw(&codes));
        let _ = cg.new_dataset::<VarLenUnicode>().shape([take() % 4]).create("categories");
        let _ = cg.new_dataset::<i64>().shape([clen]).create("values");
        let _ = cg.new_dataset::<bool>().shape([clen]).create("mask");
    }
    match take() % 4 {
        0 => {
            let r = if take() % 5 == 0 { take() % 14 } else { n_obs };
            let c = if take() % 5 == 0 { take() % 14 } else { n_vars };
            let v: Vec<f32> = (0..r * c).map(|_| take() as f32 - 2.0).collect();
            let _ = f.new_dataset::<f32>().shape([r, c]).create("X").and_then(|d| d.write_raw(&v));
        }
        1 | 2 => {
            let g = f.create_group("X").unwrap();
            set(&g, "encoding-type", if take() % 2 == 0 { "csr_matrix" } else { "csc_matrix" });
            let shape = [(if take() % 5 == 0 { take() % 14 } else { n_obs }) as i64, (if take() % 5 == 0 { take() % 14 } else { n_vars }) as i64];
            let _ = g.new_attr::<i64>().shape([2]).create("shape").and_then(|a| a.write_raw(&shape));
            let nnz = take() % 20;
            let data: Vec<f32> = (0..nnz).map(|_| take() as f32).collect();
            let idx: Vec<i32> = (0..nnz + take() % 2).map(|_| take() as i32 - 3).collect();
            let np = take() % 14;
            let mut ptr: Vec<i64> = (0..np).map(|_| (take() % (nnz + 2)) as i64).collect();
            if take() % 2 == 0 {
                ptr.sort();
            }
            let _ = g.new_dataset::<f32>().shape([data.len()]).create("data").and_then(|d| d.write_raw(&data));
            let _ = g.new_dataset::<i32>().shape([idx.len()]).create("indices").and_then(|d| d.write_raw(&idx));
            let _ = g.new_dataset::<i64>().shape([ptr.len()]).create("indptr").and_then(|d| d.write_raw(&ptr));
        }
        _ => {}
    }
    if take() % 3 == 0 {
        let u = f.create_group("uns").unwrap();
        let e = u.create_group("e").unwrap();
        set(&e, "encoding-type", encodings[take() % encodings.len()]);
        let _ = e.new_dataset::<i64>().chunk(64).shape([1usize << (8 + take() % 30)]).create("values");
    }
}

fn h5ad_check(b: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f.h5ad");
    build_h5ad(&p, b);
    let _silence = hdf5::silence_errors(true);
    if let Ok(ad) = scfoundry::anndata::AnnData::open(&p) {
        let _ = ad.obs();
        let _ = ad.var();
        let _ = ad.uns();
        let _ = ad.check_usable();
        if let Ok(m) = ad.matrix(None) {
            for (s, e) in m.blocks(7) {
                let _ = m.read_rows(s, e);
            }
        }
    }
}

#[test]
fn h5ad_regressions() {
    regressions("h5ad", h5ad_check);
}

#[test]
#[ignore = "bounded-time fuzzing: .ci/run runs it with --ignored"]
fn fuzz_h5ad() {
    let seeds: Vec<Vec<u8>> = (0u8..16).map(|k| (0..64).map(|j| k.wrapping_mul(17).wrapping_add(j)).collect()).collect();
    assert!(fuzz("h5ad", &seeds, h5ad_check) > 0);
}

// ---- torch.save zips -----------------------------------------------------------------------

/// Every prefix the callers of `formats::torch_zip` keep opaque.
const TORCH_OPAQUE: &[&str] = &["torch.", "lightning.", "lightning_fabric.", "pytorch_lightning.", "pathlib.", "omegaconf.", "builtins.slice", "datetime.", "functools.partial", "pandas.", "scvi.", "numpy.random."];

/// Open the zip, read data.pkl, and rebuild every object in it as a tensor (most are not one:
/// their errors are fine, a panic is not).
fn torch_zip_check(b: &[u8]) {
    rebuild_all(b);
}

/// The tensors `torch_zip_check` rebuilt.
fn rebuild_all(b: &[u8]) -> usize {
    use scfoundry::formats::pickle::Py;
    let Ok(mut tz) = scfoundry::formats::torch_zip::TorchZip::new(std::io::Cursor::new(b)) else { return 0 };
    let Ok(root) = tz.read_pickle(TORCH_OPAQUE) else { return 0 };
    let mut stack = vec![&root];
    let mut rebuilt = 0;
    while let Some(v) = stack.pop() {
        match v {
            Py::Object { args, state, .. } => {
                rebuilt += tz.tensor(v).is_ok() as usize;
                stack.extend(args);
                stack.extend(state.as_deref());
            }
            Py::List(items) | Py::Tuple(items) | Py::Array { items, .. } => stack.extend(items),
            Py::Dict(pairs) => {
                for (k, v) in pairs {
                    stack.push(k);
                    stack.push(v);
                }
            }
            _ => {}
        }
    }
    rebuilt
}

/// The repository's torch.save files (scfoundation, scprint, scvi, geneformer, ... fixtures).
fn torch_zip_seeds() -> Vec<Vec<u8>> {
    let mut files = Vec::new();
    files_with(&repo().join("tests/fixtures"), &["ckpt", "pt", "bin", "pth", "torch"], &mut files);
    files.sort();
    files.into_iter().map(|p| std::fs::read(p).unwrap()).filter(|b| b.len() < 1 << 20 && b.starts_with(b"PK")).collect()
}

/// A zip's records, in order.
fn unzip(b: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(b)).unwrap();
    (0..z.len())
        .map(|i| {
            let mut f = z.by_index(i).unwrap();
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut out).unwrap();
            (f.name().to_string(), out)
        })
        .collect()
}

fn rezip(entries: &[(String, Vec<u8>)], method: zip::CompressionMethod) -> Vec<u8> {
    let mut z = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let o = zip::write::SimpleFileOptions::default().compression_method(method);
    for (name, data) in entries {
        if z.start_file(name.as_str(), o).is_ok() {
            std::io::Write::write_all(&mut z, data).unwrap();
        }
    }
    z.finish().unwrap().into_inner()
}

#[test]
fn torch_zip_regressions() {
    regressions("torch_zip", torch_zip_check);
}

#[test]
fn torch_zip_seeds_rebuild_tensors() {
    // the check reaches the tensors of the readers' own fixtures (else the target would fuzz
    // the zip alone)
    for f in ["scfoundation/models.ckpt", "scprint/tiny.ckpt", "scvi_pretrained/default/model.pt", "geneformer/v1/pytorch_model.bin"] {
        let b = std::fs::read(repo().join("tests/fixtures").join(f)).unwrap();
        assert!(rebuild_all(&b) > 0, "{f}: no tensor rebuilt");
    }
    assert!(torch_zip_seeds().len() >= 4);
}

#[test]
#[ignore = "bounded-time fuzzing: .ci/run runs it with --ignored"]
fn fuzz_torch_zip() {
    // Mutations of the zip as a whole reach the central directory; mutations of data.pkl and of
    // the storage records, packed again, reach the unpickler and the tensor rebuild.
    let raw = torch_zip_seeds();
    let parts: Vec<Vec<(String, Vec<u8>)>> = raw.iter().map(|b| unzip(b)).collect();
    let pkl = |p: &[(String, Vec<u8>)]| p.iter().position(|(n, _)| n.ends_with("data.pkl")).unwrap();
    let n = fuzz_with(
        "torch_zip",
        |rng| {
            let k = rng.below(raw.len());
            let other = rng.below(raw.len());
            match rng.below(8) {
                0 | 1 => {
                    let mut b = raw[k].clone();
                    mutate(rng, &mut b, &raw[other]);
                    b
                }
                2..=5 => {
                    let mut e = parts[k].clone();
                    let i = pkl(&e);
                    let o = &parts[other][pkl(&parts[other])].1;
                    mutate(rng, &mut e[i].1, o);
                    rezip(&e, zip::CompressionMethod::Stored)
                }
                6 => {
                    let mut e = parts[k].clone();
                    let records: Vec<usize> = (0..e.len()).filter(|&i| e[i].0.contains("/data/")).collect();
                    if !records.is_empty() {
                        let i = records[rng.below(records.len())];
                        let o = e[records[rng.below(records.len())]].1.clone();
                        mutate(rng, &mut e[i].1, &o);
                    }
                    rezip(&e, zip::CompressionMethod::Stored)
                }
                _ => {
                    // records dropped, or the archive compressed (a record's declared size then
                    // rests on deflate's ratio)
                    let mut e = parts[k].clone();
                    if rng.below(2) == 0 && e.len() > 1 {
                        e.remove(rng.below(e.len()));
                        rezip(&e, zip::CompressionMethod::Stored)
                    } else {
                        let mut b = rezip(&e, zip::CompressionMethod::Deflated);
                        mutate(rng, &mut b, &raw[other]);
                        b
                    }
                }
            }
        },
        torch_zip_check,
    );
    assert!(n > 0);
}
