#!/usr/bin/env python3
"""Check the method registry (methods/*.toml) and the weights manifest (weights.toml).

Mirrors the strict schema the Rust loader expects, so a broken descriptor is caught
before `cargo test`. Standard library only (Python >= 3.11 for tomllib).

    python3 scripts/check_registry.py            # from the repository root
    python3 scripts/check_registry.py --root DIR

Exit status 0 when everything holds, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

KINDS = {"embedding", "integration"}
FAMILIES = {
    "baseline", "transformer", "mlp", "vae", "text-embedding",
    "language-model", "graph", "integration",
}
INPUT_VALUES = {"raw_counts", "log_normalized"}
INPUT_GENES = {"symbols", "ensembl", "any"}
COMMANDS = ("embed", "transfer", "finetune", "integrate")
BATCH_OPTIONS = {"--batch-size", "--predict-batch-size", "--integration-batch-size"}

# key -> (required, accepted types)
METHOD_KEYS = {
    "name": (True, (str,)),
    "display_name": (True, (str,)),
    "kind": (True, (str,)),
    "family": (True, (str,)),
    "description": (True, (str,)),
    "paper": (True, (str,)),
    "repository": (True, (str,)),
    "cuda": (True, (bool,)),
    "parameters": (True, (int,)),
    "parameters_note": (False, (str,)),
    "cost_tier": (True, (int,)),
    "embedding_dim": (True, (int,)),
    "input_values": (True, (str,)),
    "input_genes": (True, (str,)),
    "weights": (True, (list,)),
    "implemented": (True, (bool,)),
    "advice": (True, (str,)),
    "batch": (False, (dict,)),
    "honours": (True, (dict,)),
    "knobs": (False, (list,)),
    "precision": (False, (dict,)),
}
PRECISION_KEYS = {"gpu_default": (True, (str,)), "fidelity": (True, (dict,))}
FIDELITY_KEYS = {
    "lowest_cosine": (True, (float,)),
    "largest_rel_error": (True, (float,)),
    "scib_total_f32": (False, (float,)),
    "scib_total_bf16": (False, (float,)),
    "cells": (True, (str,)),
    "source": (True, (str,)),
    "machine": (True, (str,)),
    "date": (True, (str,)),
    "commit": (True, (str,)),
}
BATCH_KEYS = {"default": (True, (int,)), "source": (True, (str,)), "gpu_default": (False, (int,)), "gpu_source": (False, (str,))}
KNOB_KEYS = {
    "flag": (True, (str,)),
    "default": (True, (int, float, str, bool)),
    "help": (True, (str,)),
}
WEIGHT_KEYS = {
    "method": (True, (str,)),
    "file": (True, (str,)),
    "url": (True, (str,)),
    "revision": (True, (str,)),
    "size": (False, (int,)),
    "sha256": (False, (str,)),
    "licence": (True, (str,)),
    "archive": (False, (str,)),
    "member": (False, (str,)),
    "note": (False, (str,)),
    "upstream_path": (False, (str,)),
}
ARCHIVES = {"tar.gz", "zip"}
REVISION_RE = re.compile(
    r"^(?:[0-9a-f]{40}|zenodo:\d+|figshare:\d+|pypi:[A-Za-z0-9._-]+==[A-Za-z0-9._+!-]+|unpinned)$"
)
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

# Product-spec rules that must hold exactly.
EXPECTED_COST_TIER = {
    "pca": 1, "genept": 1, "scvi": 2, "scimilarity": 2, "scbert": 3, "cellfm": 3,
    "cellplm": 3, "sccello": 3, "scgpt": 4, "geneformer": 4, "scfoundation": 4,
    "langcell": 4, "scprint": 5, "uce": 5, "c2s": 5, "cellama": 2, "novae": 2,
    "harmony": 1, "seurat": 2, "scvi_denovo": 2, "scgpt_integrated": 4,
}
NO_BATCH_DEFAULT = {"scfoundation", "genept", "pca", "harmony", "seurat"}
FIXED_BATCH_DEFAULT = {"cellama": 32, "c2s": 8, "uce": 16, "scimilarity": 2048, "scgpt": 64, "novae": 256}
# Methods with code: the entries of the method table (src/tasks/table.rs), one per line.
TABLE = Path(__file__).resolve().parent.parent / "src" / "tasks" / "table.rs"
IMPLEMENTED = set(re.findall(r'^\s*\("([a-z0-9_]+)",', TABLE.read_text(), re.M))

EXPECTED_KNOBS = {
    ("novae", "--radius"): 0,
    ("scprint", "--max-len"): 4000,
    ("uce", "--nlayers"): 33,
    ("pca", "--n-comps"): 50,
    ("pca", "--n-top-genes"): 2000,
    ("cellama", "--top-genes"): 30,
    ("c2s", "--top-genes"): 100,
}


def check_table(table: dict, spec: dict, where: str, problems: list[str]) -> None:
    for key in table:
        if key not in spec:
            problems.append(f"{where}: unknown key '{key}'")
    for key, (required, types) in spec.items():
        if key not in table:
            if required:
                problems.append(f"{where}: missing required key '{key}'")
            continue
        value = table[key]
        # bool is an int subclass in Python; keep integer fields strictly integer.
        if bool not in types and isinstance(value, bool):
            problems.append(f"{where}: '{key}' must not be a boolean")
        elif not isinstance(value, types):
            names = "/".join(t.__name__ for t in types)
            problems.append(f"{where}: '{key}' must be {names}, got {type(value).__name__}")


def check_method(path: Path, m: dict, problems: list[str]) -> None:
    where = str(path)
    check_table(m, METHOD_KEYS, where, problems)
    name = m.get("name")
    if name != path.stem:
        problems.append(f"{where}: name '{name}' differs from the file stem '{path.stem}'")
    if isinstance(name, str) and name != name.lower():
        problems.append(f"{where}: name must be lowercase")
    for key, allowed in (("kind", KINDS), ("family", FAMILIES),
                         ("input_values", INPUT_VALUES), ("input_genes", INPUT_GENES)):
        if key in m and m[key] not in allowed:
            problems.append(f"{where}: {key} '{m[key]}' not one of {sorted(allowed)}")
    tier = m.get("cost_tier")
    if isinstance(tier, int) and not 1 <= tier <= 5:
        problems.append(f"{where}: cost_tier {tier} outside 1..5")
    if name in EXPECTED_COST_TIER and tier != EXPECTED_COST_TIER[name]:
        problems.append(f"{where}: cost_tier {tier}, spec says {EXPECTED_COST_TIER[name]}")
    for key in ("parameters", "embedding_dim"):
        value = m.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            problems.append(f"{where}: {key} must be >= 0")
    if m.get("parameters") == 0 and "parameters_note" not in m:
        problems.append(f"{where}: parameters = 0 needs a parameters_note saying why")
    if m.get("implemented") is True and name not in IMPLEMENTED:
        problems.append(f"{where}: implemented = true, but src/tasks/table.rs has no entry for {name}")
    if m.get("implemented") is False and name in IMPLEMENTED:
        problems.append(f"{where}: implemented = false, but src/tasks/table.rs has an entry for {name}")
    if name == "pca" and m.get("implemented") is not True:
        problems.append(f"{where}: pca must be implemented = true")
    for w in m.get("weights", []):
        if not isinstance(w, str):
            problems.append(f"{where}: weights entries must be strings")

    batch = m.get("batch")
    if isinstance(batch, dict):
        check_table(batch, BATCH_KEYS, f"{where} [batch]", problems)
        default = batch.get("default")
        if isinstance(default, int) and default <= 0:
            problems.append(f"{where} [batch]: default must be positive")
    if name in NO_BATCH_DEFAULT and batch is not None:
        problems.append(f"{where}: spec says no batch default, remove [batch]")
    if name in FIXED_BATCH_DEFAULT:
        got = batch.get("default") if isinstance(batch, dict) else None
        if got != FIXED_BATCH_DEFAULT[name]:
            problems.append(f"{where}: batch default {got}, spec says {FIXED_BATCH_DEFAULT[name]}")

    honours = m.get("honours")
    if isinstance(honours, dict):
        for key in honours:
            if key not in COMMANDS:
                problems.append(f"{where} [honours]: unknown command '{key}'")
        for cmd in COMMANDS:
            opts = honours.get(cmd)
            if opts is None:
                problems.append(f"{where} [honours]: missing '{cmd}'")
                continue
            if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
                problems.append(f"{where} [honours]: '{cmd}' must be a list of strings")
                continue
            for o in opts:
                if o not in BATCH_OPTIONS:
                    problems.append(f"{where} [honours]: '{cmd}' has unknown option '{o}'")
        if batch is None:
            for cmd in ("embed", "transfer"):
                if honours.get(cmd):
                    problems.append(f"{where}: no [batch] default but {cmd} honours {honours[cmd]}")
        elif m.get("kind") == "embedding":
            for cmd in ("embed", "transfer"):
                if honours.get(cmd) != ["--batch-size"]:
                    problems.append(f"{where}: has a batch default, so {cmd} must honour --batch-size")
        special = {
            # finetune trains a head in batches on every method it runs (pca included) and
            # predicts in batches of --predict-batch-size
            "pca": {"embed": [], "transfer": [], "finetune": ["--batch-size", "--predict-batch-size"], "integrate": []},
            "cellplm": {"finetune": []},
            "scgpt_integrated": {"integrate": ["--integration-batch-size"]},
        }
        for cmd, want in special.get(name, {}).items():
            if honours.get(cmd) != want:
                problems.append(f"{where}: honours.{cmd} = {honours.get(cmd)}, spec says {want}")

    knobs = m.get("knobs", [])
    flags = {}
    if isinstance(knobs, list):
        for i, knob in enumerate(knobs):
            if not isinstance(knob, dict):
                problems.append(f"{where} knobs[{i}]: must be a table")
                continue
            check_table(knob, KNOB_KEYS, f"{where} knobs[{i}]", problems)
            flag = knob.get("flag")
            if isinstance(flag, str):
                if not flag.startswith("--"):
                    problems.append(f"{where} knobs[{i}]: flag must start with --")
                if flag in flags:
                    problems.append(f"{where}: duplicate knob {flag}")
                flags[flag] = knob.get("default")
    for (method, flag), default in EXPECTED_KNOBS.items():
        if method == name and flags.get(flag) != default:
            problems.append(f"{where}: knob {flag} default {flags.get(flag)}, spec says {default}")

    # --precision auto resolves to [precision] gpu_default on a GPU: the two come together
    precision = m.get("precision")
    if ("--precision" in flags) != isinstance(precision, dict):
        problems.append(f"{where}: a --precision knob and a [precision] table (gpu_default, fidelity) come together")
    if "--precision" in flags and flags["--precision"] != "auto":
        problems.append(f"{where}: knob --precision default {flags['--precision']!r}, must be 'auto'")
    if isinstance(precision, dict):
        check_table(precision, PRECISION_KEYS, f"{where} [precision]", problems)
        if precision.get("gpu_default") not in ("f32", "bf16"):
            problems.append(f"{where} [precision]: gpu_default must be 'f32' or 'bf16'")
        fidelity = precision.get("fidelity")
        if isinstance(fidelity, dict):
            check_table(fidelity, FIDELITY_KEYS, f"{where} [precision.fidelity]", problems)


def check_weight(wid: str, w: dict, methods: set[str], problems: list[str]) -> None:
    where = f"weights.toml [weights.\"{wid}\"]"
    if not isinstance(w, dict):
        problems.append(f"{where}: must be a table")
        return
    check_table(w, WEIGHT_KEYS, where, problems)
    if w.get("method") not in methods:
        problems.append(f"{where}: method '{w.get('method')}' is not a registered method")
    rev = w.get("revision")
    if isinstance(rev, str) and not REVISION_RE.match(rev):
        problems.append(f"{where}: revision '{rev}' has an unknown form")
    sha = w.get("sha256")
    if isinstance(sha, str) and not SHA256_RE.match(sha):
        problems.append(f"{where}: sha256 must be 64 lowercase hex characters")
    size = w.get("size")
    if isinstance(size, int) and not isinstance(size, bool) and size <= 0:
        problems.append(f"{where}: size must be positive")
    if "archive" in w and w["archive"] not in ARCHIVES:
        problems.append(f"{where}: archive '{w['archive']}' not one of {sorted(ARCHIVES)}")
    url = w.get("url", "")
    if isinstance(url, str) and not url.startswith("https://"):
        problems.append(f"{where}: url must be https")
    if isinstance(rev, str) and re.fullmatch(r"[0-9a-f]{40}", rev) and rev not in url:
        problems.append(f"{where}: url does not contain the pinned revision {rev}")
    if rev == "unpinned" and "note" not in w:
        problems.append(f"{where}: unpinned entries need a note saying why")
    if ("sha256" not in w or "size" not in w) and "note" not in w:
        problems.append(f"{where}: missing size/sha256 needs a note saying where they would be published")
    f = w.get("file", "")
    if isinstance(f, str) and (f.startswith("/") or ".." in Path(f).parts):
        problems.append(f"{where}: file must be a relative path inside the weights folder")
    up = w.get("upstream_path", "")
    if isinstance(up, str) and (up.startswith("/") or ".." in Path(up).parts):
        problems.append(f"{where}: upstream_path must be a relative path inside upstream's folder")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    root: Path = args.root
    problems: list[str] = []

    methods: dict[str, dict] = {}
    for path in sorted((root / "methods").glob("*.toml")):
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            problems.append(f"{path}: TOML error: {e}")
            continue
        check_method(path, data, problems)
        methods[path.stem] = data
    if not methods:
        problems.append(f"{root / 'methods'}: no method descriptors found")

    wpath = root / "weights.toml"
    try:
        manifest = tomllib.loads(wpath.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        problems.append(f"{wpath}: {e}")
        manifest = {}
    for key in manifest:
        if key != "weights":
            problems.append(f"{wpath}: unknown top-level key '{key}'")
    entries = manifest.get("weights", {})
    for wid, w in entries.items():
        check_weight(wid, w, set(methods), problems)

    referenced: set[str] = set()
    for name, m in methods.items():
        for wid in m.get("weights", []):
            if not isinstance(wid, str):
                continue
            referenced.add(wid)
            if wid not in entries:
                problems.append(f"methods/{name}.toml: weights id '{wid}' is not defined in weights.toml")
    for wid in sorted(set(entries) - referenced):
        problems.append(f"weights.toml: entry '{wid}' is not referenced by any method")

    files = {}
    for wid, w in entries.items():
        f = w.get("file") if isinstance(w, dict) else None
        if f in files:
            problems.append(f"weights.toml: '{wid}' and '{files[f]}' share file '{f}'")
        files[f] = wid

    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"ok: {len(methods)} methods, {len(entries)} weights entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
