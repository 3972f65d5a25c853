#!/usr/bin/env python3
"""File-level import circles inside each crate of the workspace.

Usage: python3 scripts/import-circles.py [workspace_root]   (default: this script's repository)
Exits 1 when a crate has a circle (CI runs it: issue 52 asks for none).

Graph: node = .rs module file reachable from the crate root (lib.rs / main.rs) via
non-test `mod foo;` declarations. Edge A -> B when A contains a path reference that
resolves (longest module prefix) into B's module: `use crate::..`, `super::..`,
`self::..`, `child::..` (a module declared in A), `$crate::..`, in `use`/`pub use`
or inline code. `mod foo;` itself is not an edge. Comments, string/char literals and
items under `#[cfg(test)]` / `#[cfg(all(test, ..))]` are ignored.
Prints every strongly connected component of size > 1 with, for each edge inside it,
the file:line of each reference creating it.
"""
import os
import re
import sys
from collections import defaultdict

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- lexer
def lex(src):
    """Tokens (kind, text, line); comments and literals are dropped (literals -> 'lit')."""
    toks = []
    i, n, line = 0, len(src), 1
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
            continue
        if c.isspace():
            i += 1
            continue
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
            continue
        if src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth += 1
                    i += 2
                elif src.startswith("*/", i):
                    depth -= 1
                    i += 2
                else:
                    if src[i] == "\n":
                        line += 1
                    i += 1
            continue
        # raw strings r"..", r#".."#, br#".."#
        m = re.match(r'b?r(#*)"', src[i:i + 300])
        if m:
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            line += src.count("\n", i, j)
            toks.append(("lit", "", line))
            i = j
            continue
        if c == '"' or (c == "b" and i + 1 < n and src[i + 1] == '"'):
            j = i + (2 if c == "b" else 1)
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            line += src.count("\n", i, j + 1)
            toks.append(("lit", "", line))
            i = j + 1
            continue
        if c == "'" or (c == "b" and i + 1 < n and src[i + 1] == "'"):
            k = i + (1 if c == "b" else 0)
            m = re.match(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", src[k:k + 16])
            if m:
                toks.append(("lit", "", line))
                i = k + m.end()
                continue
            # lifetime / label
            m = re.match(r"'[A-Za-z_]\w*", src[i:])
            if m:
                i += m.end()
                continue
        m = re.match(r"\$?[A-Za-z_]\w*", src[i:i + 200])
        if m:
            toks.append(("id", m.group(0), line))
            i += m.end()
            continue
        if src.startswith("::", i):
            toks.append(("p", "::", line))
            i += 2
            continue
        toks.append(("p", c, line))
        i += 1
    return toks


def match_close(toks, i):
    """Index of the bracket closing toks[i]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    o, cl = toks[i][1], pairs[toks[i][1]]
    d = 0
    for j in range(i, len(toks)):
        if toks[j][1] == o:
            d += 1
        elif toks[j][1] == cl:
            d -= 1
            if d == 0:
                return j
    return len(toks) - 1


def is_test_cfg(attr_toks):
    txt = " ".join(t[1] for t in attr_toks)
    return bool(re.match(r"^cfg \( (test|all \( test\b)", txt))


def item_end(toks, i):
    """End index of the item starting at i (after its attributes): first ';' at depth 0 or
    the close of the first '{' block at depth 0."""
    j = i
    while j < len(toks):
        t = toks[j][1]
        if t in ("(", "["):
            j = match_close(toks, j) + 1
            continue
        if t == ";":
            return j
        if t == "{":
            return match_close(toks, j)
        j += 1
    return len(toks) - 1


def strip_test_items(toks):
    out, i = [], 0
    while i < len(toks):
        if toks[i][1] == "#" and i + 1 < len(toks) and toks[i + 1][1] == "[":
            close = match_close(toks, i + 1)
            if is_test_cfg(toks[i + 2:close]):
                j = close + 1
                while j + 1 < len(toks) and toks[j][1] == "#" and toks[j + 1][1] == "[":
                    j = match_close(toks, j + 1) + 1
                i = item_end(toks, j) + 1
                continue
            # keep other attributes out of the stream (cfg(feature) etc. are not paths)
            i = close + 1
            continue
        if toks[i][1] == "#" and i + 2 < len(toks) and toks[i + 1][1] == "!" and toks[i + 2][1] == "[":
            i = match_close(toks, i + 2) + 1
            continue
        out.append(toks[i])
        i += 1
    return out


# ---------------------------------------------------------------- use-tree expansion
def parse_use_tree(toks, i, prefix):
    """Parse a use tree at toks[i]; return (list of (segments, line), next index)."""
    res = []
    segs = list(prefix)
    line = toks[i][2] if i < len(toks) else 0
    while i < len(toks):
        k, t, ln = toks[i]
        if t == "{":
            close = match_close(toks, i)
            j = i + 1
            while j < close:
                sub, j = parse_use_tree(toks, j, segs)
                res.extend(sub)
                if j < close and toks[j][1] == ",":
                    j += 1
            return res, close + 1
        if t == "*":
            res.append((segs + ["*"], ln))
            return res, i + 1
        if k == "id" and t != "as":
            segs.append(t)
            line = ln
            i += 1
            if i < len(toks) and toks[i][1] == "::":
                i += 1
                continue
            if i < len(toks) and toks[i][1] == "as":
                i += 2
            res.append((segs, line))
            return res, i
        if t == "::":  # leading ::
            i += 1
            segs.append("::")
            continue
        break
    if segs != list(prefix):
        res.append((segs, line))
    return res, i


# ---------------------------------------------------------------- crate model
class Crate:
    def __init__(self, name, root_file):
        self.name = name
        self.modfile = {}      # module path tuple -> file
        self.children = defaultdict(set)  # module path -> child names
        self.file_toks = {}
        self.load(root_file, (), os.path.dirname(root_file))

    def load(self, path, modpath, childdir):
        if path in self.file_toks:
            return
        src = open(path, encoding="utf-8").read()
        toks = strip_test_items(lex(src))
        self.file_toks[path] = (toks, modpath, childdir)
        self.modfile[modpath] = path
        self.scan_mods(toks, 0, len(toks), path, modpath, childdir)

    def scan_mods(self, toks, a, b, path, modpath, childdir):
        i = a
        while i < b:
            if toks[i][1] == "mod" and i + 1 < b and toks[i + 1][0] == "id":
                name = toks[i + 1][1]
                nxt = toks[i + 2][1] if i + 2 < b else ""
                if nxt == ";":
                    self.children[modpath].add(name)
                    cand = [os.path.join(childdir, name + ".rs"), os.path.join(childdir, name, "mod.rs")]
                    f = next((c for c in cand if os.path.exists(c)), None)
                    if f is None:
                        print(f"warn: {path}: mod {name}; not found", file=sys.stderr)
                    else:
                        sub = os.path.join(childdir, name)
                        self.load(f, modpath + (name,), sub)
                    i += 3
                    continue
                if nxt == "{":
                    close = match_close(toks, i + 2)
                    self.children[modpath].add(name)
                    self.modfile[modpath + (name,)] = path  # inline module lives in this file
                    self.scan_mods(toks, i + 3, close, path, modpath + (name,), os.path.join(childdir, name))
                    i = close + 1
                    continue
            i += 1

    def resolve(self, cur, segs):
        """Module path tuple referenced by segs as written in module `cur`, or None."""
        if not segs or segs[0] == "::":
            return None
        s = list(segs)
        if s[0] in ("crate", "$crate"):
            base, s = (), s[1:]
        elif s[0] == "self":
            base, s = cur, s[1:]
        elif s[0] == "super":
            base = cur
            while s and s[0] == "super":
                base = base[:-1]
                s = s[1:]
        elif s[0] in self.children[cur]:
            base = cur
        else:
            return None
        mp = base
        for seg in s:
            if seg in ("*", "self"):
                break
            if mp + (seg,) in self.modfile:
                mp = mp + (seg,)
            else:
                break
        return mp

    def edges(self):
        """{(fileA, fileB): [line,...]}"""
        E = defaultdict(list)
        for path, (toks, modpath, _) in self.file_toks.items():
            self.scan_refs(toks, 0, len(toks), path, modpath, E)
        return E

    def scan_refs(self, toks, a, b, path, cur, E):
        def add(segs, line):
            mp = self.resolve(cur, segs)
            if mp is None:
                return
            tgt = self.modfile[mp]
            if tgt != path:
                E[(path, tgt)].append(line)

        i = a
        while i < b:
            k, t, ln = toks[i]
            if t == "mod" and i + 2 < b and toks[i + 1][0] == "id" and toks[i + 2][1] == "{":
                close = match_close(toks, i + 2)
                self.scan_refs(toks, i + 3, close, path, cur + (toks[i + 1][1],), E)
                i = close + 1
                continue
            if t == "use" and (i == a or toks[i - 1][1] != "::"):
                trees, j = parse_use_tree(toks, i + 1, [])
                for segs, line in trees:
                    add(segs, line)
                i = j
                continue
            if k == "id" and i + 1 < b and toks[i + 1][1] == "::" and (i == a or toks[i - 1][1] != "::"):
                segs, j = [t], i + 1
                while j + 1 < b and toks[j][1] == "::" and toks[j + 1][0] == "id":
                    segs.append(toks[j + 1][1])
                    j += 2
                if j < b and toks[j][1] == "::" and j + 1 < b and toks[j + 1][1] == "{":
                    # inline grouped path (rare outside `use`)
                    trees, j2 = parse_use_tree(toks, j + 1, segs)
                    for s2, l2 in trees:
                        add(s2, l2)
                    i = j2
                    continue
                add(segs, ln)
                i = j
                continue
            i += 1


# ---------------------------------------------------------------- SCC
def tarjan(nodes, adj):
    idx, low, on, st, out, c = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def sc(v):
        idx[v] = low[v] = c[0]
        c[0] += 1
        st.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in idx:
                sc(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in nodes:
        if v not in idx:
            sc(v)
    return out


def crates(root):
    res = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("target", "node_modules") and not d.startswith(".")]
        if "Cargo.toml" in files:
            src = os.path.join(dirpath, "src")
            for r in ("lib.rs", "main.rs"):
                f = os.path.join(src, r)
                if os.path.exists(f):
                    res.append((os.path.relpath(dirpath, root) + ":" + r, f))
    return sorted(res)


def main():
    total = 0
    for name, rootf in crates(ROOT):
        cr = Crate(name, rootf)
        E = cr.edges()
        adj = defaultdict(set)
        for (x, y) in E:
            adj[x].add(y)
        comps = [c for c in tarjan(sorted(cr.file_toks), adj) if len(c) > 1]
        rel = lambda p: os.path.relpath(p, ROOT)
        if comps:
            print(f"== crate {name}: {len(cr.file_toks)} files, {len(E)} edges, {len(comps)} circle(s)")
        for comp in comps:
            total += 1
            cs = set(comp)
            print(f"  CIRCLE ({len(comp)} files): " + ", ".join(sorted(rel(f) for f in comp)))
            for (x, y), lines in sorted(E.items()):
                if x in cs and y in cs:
                    ls = sorted(set(lines))
                    print(f"    {rel(x)} -> {rel(y)}: " + ", ".join(f"{rel(x)}:{l}" for l in ls))
    print(f"import circles: {total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
