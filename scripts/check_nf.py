#!/usr/bin/env python3
"""Check scfoundry's Nextflow DSL2 files with reftrace (a Nextflow-aware parser) plus rules of
our own for what neither reftrace nor Groovy catches (see shared notes in docs/orchestration.md):

- every file parses (reftrace);
- no unknown process directive (a misspelt `lable` or `maxFork`);
- every module process has `tag "${meta.id}"`, one device label (process_gpu / process_cpu),
  one size label (process_low / _medium / _high), an `emit: versions` output and a `stub:` block;
- `tuple` inputs and outputs separate their elements with commas;
- every `include { X }` / `include { X as Y }` names a process that the included file defines.

usage: check_nf.py FILE.nf...     (exit 1 on any problem)
"""
import os
import re
import sys

try:
    import reftrace
except ImportError:
    sys.exit("check_nf.py: the reftrace package is missing: pip install -r ci/requirements-nextflow.txt")

DEVICE = {"process_gpu", "process_cpu"}
SIZE = {"process_low", "process_medium", "process_high"}


def main(paths):
    problems = []
    defined = {}
    parsed = {}
    for path in paths:
        m = reftrace.Module.from_file(path)
        if isinstance(m, reftrace.ParseError) or not hasattr(m, "processes"):
            problems.append(f"{path}: does not parse: {getattr(m, 'error', m)}")
            continue
        parsed[path] = m
        defined[os.path.realpath(path)] = {p.name for p in m.processes} | {getattr(w, "name", None) for w in m.workflows}
    for path, m in parsed.items():
        text = open(path).read()
        for p in m.processes:
            where = f"{path}:{p.line}: process {p.name}"
            for u in p.unknowns:
                problems.append(f"{where}: unknown directive {getattr(u, 'name', u)!r}")
            if "modules/" in path.replace(os.sep, "/"):
                labels = {getattr(l, "value", str(l)) for l in p.labels}
                if not labels & DEVICE:
                    problems.append(f"{where}: needs a device label ({' or '.join(sorted(DEVICE))}), has {sorted(labels)}")
                if not labels & SIZE:
                    problems.append(f"{where}: needs a size label ({', '.join(sorted(SIZE))}), has {sorted(labels)}")
                if 'tag "${meta.id}"' not in text:
                    problems.append(f"{where}: needs tag \"${{meta.id}}\"")
                if not re.search(r"emit:\s*versions\b", text):
                    problems.append(f"{where}: needs a versions.yml output with `emit: versions`")
                if not re.search(r"^\s*stub:\s*$", text, re.M):
                    problems.append(f"{where}: needs a stub: block")
        for n, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            if re.match(r"tuple\b", s) and re.search(r"\)\s+(val|path|env|stdin)\(", s):
                problems.append(f"{path}:{n}: tuple elements need commas between them: {s}")
        for inc in m.includes:
            src = os.path.normpath(os.path.join(os.path.dirname(path), inc.from_module))
            if not src.endswith(".nf"):
                src += ".nf"
            names = defined.get(os.path.realpath(src))
            if names is None:
                if not os.path.isfile(src):
                    problems.append(f"{path}: includes {inc.from_module}, which does not exist")
                continue
            for item in inc.items:
                name = getattr(item, "name", str(item))
                if name not in names:
                    problems.append(f"{path}: includes {name} from {inc.from_module}, which defines {sorted(names)}")
    for path in parsed:
        print(f"ok   {path} (reftrace)" if not any(p.startswith(path) for p in problems) else f"FAIL {path}")
    for p in problems:
        print(f"  {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
