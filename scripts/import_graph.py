#!/usr/bin/env python3
"""The file-level import graph of src/ and its circles.

Every `crate::a::b::...` path in a source file (use lines and inline paths) is an edge to the
deepest module file it names (src/a/b.rs or src/a/b/mod.rs); `super::` paths likewise. A circle
is a set of files that import each other (a strongly connected component of more than one
file). Exit status 1 when there is one.

    python3 scripts/import_graph.py            # the circles
    python3 scripts/import_graph.py --edges    # every edge
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"


def module_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def file_of(parts: list[str]):
    """The deepest module file for a path of names, or None."""
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for cand in (base.with_suffix(".rs"), base / "mod.rs"):
            if cand.is_file():
                return cand
    return None


def strip_comments(text: str) -> str:
    """The code before the file's test module (where `super::` means the file itself),
    without comment lines."""
    lines = []
    for l in text.splitlines():
        if l.lstrip().startswith("#[cfg(test)]"):
            break
        if not l.lstrip().startswith("//"):
            lines.append(l)
    return "\n".join(lines)


def edges(path: Path) -> set[Path]:
    text = strip_comments(path.read_text())
    me = module_of(path)
    out = set()
    # crate::a::{b, c::d} and crate::a::b
    for m in re.finditer(r"\bcrate((?:::\w+)+)(::\{[^;]*?\})?", text):
        base = [p for p in m.group(1).split("::") if p]
        groups = [base]
        if m.group(2):
            for item in re.split(r",", m.group(2)[3:-1]):
                item = re.sub(r"\s+as\s+\w+", "", item).strip().strip("{}").strip()
                if item and item != "self":
                    groups.append(base + [p for p in item.split("::") if p and p != "{"])
        for g in groups:
            f = file_of(g)
            if f and f != path:
                out.add(f)
    for m in re.finditer(r"\bsuper((?:::\w+)+)", text):
        parent = me[:-1] if path.name != "mod.rs" else me[:-1]
        f = file_of(parent + [p for p in m.group(1).split("::") if p])
        if f and f != path:
            out.add(f)
    return out


def main() -> int:
    files = [p for p in ROOT.rglob("*.rs") if "bin" not in p.relative_to(ROOT).parts[:1]]
    graph = {f: edges(f) for f in files}
    if "--edges" in sys.argv:
        for f in sorted(graph):
            for t in sorted(graph[f]):
                print(f"{f.relative_to(ROOT)} -> {t.relative_to(ROOT)}")
    # Tarjan's strongly connected components
    index, low, stack, on, sccs = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    for c in sccs:
        print("circle: " + ", ".join(str(p.relative_to(ROOT)) for p in c))
    print(f"{len(files)} files, {sum(len(e) for e in graph.values())} imports, {len(sccs)} circles")
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main())
