//! Compile every `methods/*.toml` into the binary so the registry works from any folder.
use std::fmt::Write;

fn main() {
    println!("cargo:rerun-if-changed=methods");
    let mut entries: Vec<_> = std::fs::read_dir("methods")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "toml")).collect())
        .unwrap_or_default();
    entries.sort();
    let mut out = String::from("/// (file stem, TOML text) of every method in methods/.\npub static BUILTIN: &[(&str, &str)] = &[\n");
    for p in entries {
        println!("cargo:rerun-if-changed={}", p.display());
        let stem = p.file_stem().unwrap().to_string_lossy().to_string();
        let abs = std::fs::canonicalize(&p).unwrap();
        writeln!(out, "    ({stem:?}, include_str!({:?})),", abs.display().to_string()).unwrap();
    }
    out.push_str("];\n");
    let dest = std::path::Path::new(&std::env::var("OUT_DIR").unwrap()).join("methods_builtin.rs");
    std::fs::write(dest, out).unwrap();
    println!("cargo:rerun-if-changed=weights.toml");
}
