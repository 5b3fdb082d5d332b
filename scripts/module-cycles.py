#!/usr/bin/env python3
"""Import circles between the top-level modules of a crate.

Reads every `crate::MODULE` path in the crate's `src/` (the `use` lines and
paths written inline), builds the graph "module A names module B", and
prints each strongly connected component with more than one module: those
are the import circles. Exit status 1 when there is one.

    python3 scripts/module-cycles.py crates/engine-core
"""
import os
import re
import sys


def top_module(src, path):
    rel = os.path.relpath(path, src)
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".rs") else first


def graph(crate):
    src = os.path.join(crate, "src")
    edges = {}
    pattern = re.compile(r"\bcrate::(\w+)|\bcrate::\{([^}]*)\}")
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            module = top_module(src, path)
            if module in ("lib", "main"):
                continue
            text = open(path, encoding="utf-8").read()
            # Test modules may name anything; only the library's own paths count.
            text = text.split("#[cfg(test)]\nmod tests")[0]
            # Comments (doc links among them) import nothing.
            text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))
            for m in pattern.finditer(text):
                names = [m.group(1)] if m.group(1) else re.findall(r"(\w+)\s*(?:::|,|$|\})", m.group(2) + ",")
                for n in names:
                    if n and n != module and n not in ("self", "super"):
                        edges.setdefault(module, set()).add(n)
    modules = {top_module(src, os.path.join(root, f)) for root, _, fs in os.walk(src) for f in fs if f.endswith(".rs")}
    return {m: {n for n in ns if n in modules} for m, ns in edges.items()}


def components(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    crate = sys.argv[1] if len(sys.argv) > 1 else "crates/engine-core"
    edges = graph(crate)
    circles = [c for c in components(edges) if len(c) > 1]
    modules = {m for m in edges} | {n for s in edges.values() for n in s}
    print(f"{crate}: {len(modules)} top-level modules, {len(circles)} import circle(s)")
    for c in sorted(circles, key=len, reverse=True):
        print(f"  {len(c)} modules: {' <-> '.join(c)}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
