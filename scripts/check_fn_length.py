#!/usr/bin/env python3
"""Fails when a function in crates/*/src is longer than the limit (150 lines).

A function's length is counted from the line of its `fn` to the line of the brace that
closes its body (comments and blank lines inside count: they are read too). Functions in
`#[cfg(test)]` modules inside src count as well; tests/, benches/ and examples/ do not.

    python3 scripts/check_fn_length.py               # exit 1 when one is over
    python3 scripts/check_fn_length.py --top 20      # the longest, whatever the limit

Why: a driver that has grown past a screenful or three does several things at once
(docs/architecture.md, "Shape"); give each concern its own function.
"""
import argparse
import re
import sys

from rust_source import blank_comments_and_literals, crate_sources, crates

FN_RE = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def functions(text):
    """(name, first line, last line) of every function with a body in blanked text."""
    line_starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]

    def line_of(pos):
        lo, hi = 0, len(line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    for m in FN_RE.finditer(text):
        i, depth = m.end(), 0
        while i < len(text):
            c = text[i]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif depth == 0 and c in "{;":
                break
            i += 1
        if i >= len(text) or text[i] == ";":
            continue  # a declaration without a body (a trait's, an extern's)
        body, braces = i, 0
        while i < len(text):
            braces += text[i] == "{"
            braces -= text[i] == "}"
            if braces == 0:
                break
            i += 1
        yield m.group(1), line_of(m.start()), line_of(min(i, len(text) - 1)), body


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="crates")
    ap.add_argument("--max-lines", type=int, default=150)
    ap.add_argument("--top", type=int, help="print the N longest functions")
    args = ap.parse_args()
    found = []
    for crate_dir in crates(args.root):
        for path, _ in crate_sources(crate_dir):
            text = blank_comments_and_literals(path.read_text())
            for name, first, last, _ in functions(text):
                found.append((last - first + 1, f"{path}:{first}", name))
    found.sort(reverse=True)
    if args.top:
        for n, where, name in found[: args.top]:
            print(f"{n:5} {where} {name}")
        return 0
    over = [f for f in found if f[0] > args.max_lines]
    for n, where, name in over:
        print(f"{where}: fn {name} is {n} lines (at most {args.max_lines}): "
              "give each concern a function of its own")
    if over:
        return 1
    print(f"check_fn_length: {len(found)} functions, the longest {found[0][0]} lines "
          f"(at most {args.max_lines})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
