#!/usr/bin/env python3
"""Fails when the files of a crate import each other in a circle.

Reads every `crate::`, `super::` and `self::` path in crates/*/src (in `use` trees and in
code, after comments and literals are blanked out), and paths that start with a child
module's name, resolves each to the file that defines the module it names (through `pub use`
re-exports, so `crate::Config` counts as an import of the file that defines `Config`), and
reports every strongly connected set of more than one file. A module's imports of the
modules below it (`lib.rs` or a `mod.rs` composing its children) are not counted: a file
below may use what its parent defines, and the parent may drive its children, but two files
may not lean on each other any other way.

    python3 scripts/check_imports.py            # every crate; exit 1 on a circle
    python3 scripts/check_imports.py --edges shoal-net   # the graph of one crate

Why: a circle between files means no file can be read, moved or tested without the others
(docs/architecture.md, "Shape"); layering is kept by `make lint`, not by memory.
"""
import argparse
import re
import sys

from rust_source import blank_comments_and_literals, crate_sources, crates

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
USE_RE = re.compile(r"\buse\s+([^;]*);")
PATH_RE = re.compile(rf"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:\s*::\s*{IDENT})+)")
MOD_OPEN_RE = re.compile(rf"\bmod\s+({IDENT})\s*\{{")


def expand_use_tree(tree):
    """`a::{b::X, c::{d, e}}` -> [a::b::X, a::c::d, a::c::e] (as lists of segments)."""
    tree = re.sub(r"\s+", "", tree)
    tree = re.sub(rf"\bas{IDENT}", "", tree)  # `X as Y` (spaces are gone: `XasY`)
    out = []

    def walk(prefix, s):
        if s.startswith("{") and s.endswith("}"):
            for part in split_top(s[1:-1]):
                walk(prefix, part)
            return
        i = s.find("{")
        if i >= 0:
            head = s[:i].rstrip(":")
            walk(prefix + [p for p in head.split("::") if p], s[i:])
        elif s:
            out.append(prefix + [p for p in s.split("::") if p])

    walk([], tree)
    return out


def split_top(s):
    parts, depth, cur = [], 0, ""
    for c in s:
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += c == "{"
        depth -= c == "}"
        cur += c
    parts.append(cur)
    return [p for p in parts if p]


def inline_modules(text):
    """(position, inline module path) changes: `mod tests { ... }` inside a file."""
    events, stack, depth = [(0, ())], [], 0
    opens = {m.end() - 1: m.group(1) for m in MOD_OPEN_RE.finditer(text)}
    for i, c in enumerate(text):
        if c == "{":
            depth += 1
            if i in opens:
                stack.append((depth, opens[i]))
                events.append((i, tuple(name for _, name in stack)))
        elif c == "}":
            if stack and stack[-1][0] == depth:
                stack.pop()
                events.append((i, tuple(name for _, name in stack)))
            depth -= 1
    return events


def scope_at(events, pos):
    scope = ()
    for p, s in events:
        if p > pos:
            break
        scope = s
    return scope


class Crate:
    def __init__(self, crate_dir):
        self.name = crate_dir.name
        self.files = {}  # module path -> file name
        self.texts = {}
        for path, module in crate_sources(crate_dir):
            self.files[module] = str(path)
            self.texts[module] = blank_comments_and_literals(path.read_text())
        self.reexports = {m: self._reexports(m) for m in self.files}

    def _reexports(self, module):
        out = {}
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]*);", self.texts[module]):
            for segs in expand_use_tree(m.group(1)):
                absolute = self.absolute(module, (), segs)
                if absolute and segs[-1] != "*":
                    out[segs[-1]] = absolute
        return out

    def absolute(self, file_module, inline, segs):
        """The absolute module path of `segs` seen from inside `file_module::inline`, or
        None for a path into another crate."""
        here = list(file_module) + list(inline)
        if not segs:
            return None
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] in ("super", "self"):
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    if not here:
                        return None
                    here.pop()
                segs = segs[1:]
            return here + segs
        child = tuple(list(file_module) + [segs[0]])
        if child in self.files and not inline:
            return list(file_module) + segs
        return None

    def file_of(self, absolute, depth=0):
        """The file that defines what `absolute` names (the longest module prefix that is a
        file), followed through a re-export there."""
        for n in range(len(absolute), -1, -1):
            module = tuple(absolute[:n])
            if module in self.files:
                rest = absolute[n:]
                if rest and depth < 4 and rest[0] in self.reexports.get(module, {}):
                    return self.file_of(self.reexports[module][rest[0]], depth + 1)
                return module
        return None

    def edges(self):
        graph = {m: set() for m in self.files}
        for module, text in self.texts.items():
            events = inline_modules(text)
            paths = []
            for m in USE_RE.finditer(text):
                inline = scope_at(events, m.start())
                paths += [(inline, segs) for segs in expand_use_tree(m.group(1))]
            rest = USE_RE.sub(lambda m: " " * len(m.group(0)), text)
            for m in PATH_RE.finditer(rest):
                segs = [s.strip() for s in m.group(1).split("::")]
                paths.append((scope_at(events, m.start()), segs))
            for inline, segs in paths:
                absolute = self.absolute(module, inline, [s for s in segs if s != "*"])
                target = None if absolute is None else self.file_of(absolute)
                # A module composing the modules below it (`mod.rs` re-exporting or
                # driving its children) is how Rust lays a folder out, not a circle.
                if target is not None and target[: len(module)] != module:
                    graph[module].add(target)
        return graph


def circles(graph):
    """Strongly connected sets of more than one node (Tarjan, iteratively)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="crates")
    ap.add_argument("--edges", metavar="CRATE", help="print one crate's file graph")
    args = ap.parse_args()
    found = 0
    for crate_dir in crates(args.root):
        crate = Crate(crate_dir)
        graph = crate.edges()
        if args.edges == crate.name:
            for m in sorted(graph):
                targets = ", ".join(crate.files[t] for t in sorted(graph[m]))
                print(f"{crate.files[m]} -> {targets}")
        for group in circles(graph):
            found += 1
            print(f"{crate.name}: files import each other in a circle: "
                  + ", ".join(crate.files[m] for m in group))
            for m in group:
                inside = sorted(t for t in graph[m] if t in group)
                print(f"  {crate.files[m]} imports " + ", ".join(crate.files[t] for t in inside))
    if found:
        print(f"{found} file circle(s): move what both sides need into a module below them")
        return 1
    print("check_imports: no file circles in", len(crates(args.root)), "crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
