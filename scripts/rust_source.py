"""Reading Rust source as the shape checks need it: comments and literals blanked out (so a
brace or a `crate::` path inside a string or a doc comment is not code), with every line
kept where it was, and each source file's module path inside its crate.

Used by scripts/check_imports.py and scripts/check_fn_length.py (`make lint`). Standard
library only: the checks run before the test venv exists.
"""
import pathlib
import re


def blank_comments_and_literals(text):
    """The text with comments, string, byte-string, raw-string and char literals replaced
    by spaces (newlines kept, so line numbers hold). Lifetimes (`'a`) are left alone."""
    out = []
    i, n = 0, len(text)

    def blank(s):
        return "".join(c if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and not _ident_before(text, i):
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append(blank(text[i:j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and not _ident_before(text, i)):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(blank(text[i : j + 1]))
            i = j + 1
        elif c == "'":
            m = re.compile(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'").match(text, i)
            if m:
                out.append(blank(m.group(0)))
                i = m.end()
            else:  # a lifetime or a label
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_before(text, i):
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")


def crate_sources(crate_dir):
    """(path, module path) for each .rs file below crate_dir/src: `lib.rs` and `main.rs`
    are the root (), `a.rs` and `a/mod.rs` are ("a",), `a/b.rs` is ("a", "b"). Binaries in
    src/bin/ are crates of their own and are left out."""
    src = pathlib.Path(crate_dir) / "src"
    for path in sorted(src.rglob("*.rs")):
        rel = path.relative_to(src)
        if rel.parts[0] == "bin":
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts.pop()
        yield path, tuple(parts)


def crates(root="crates"):
    """Every crate directory with a src/ below root, sorted."""
    return sorted(p for p in pathlib.Path(root).iterdir() if (p / "src").is_dir())
