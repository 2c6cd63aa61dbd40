"""Anchors of the mutation survey: find a code fragment in the project's sources and rewrite it.

A fragment is matched token by token, so it survives what does not change the code: re-indentation,
re-wrapped lines, edited or added comments, a moved function, a renamed file. Tokens are words
([A-Za-z0-9_]+), operators of two or three characters (`>=`, `//`, `->`, ...) and single other characters;
between two tokens the source may hold any whitespace and comments (`#` in Python; `//` and `/* */` in C
and C++), and two words need at least one of them. A match
must be the only one in the searched files, since a second match would make the mutated spot a guess.

The mutation rewrites only the tokens where the mutated fragment differs from the original one (their
common first and last tokens stay as the source spells them), so the source's own layout and comments
around the change are kept.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

FLOORS = ("cpu_kernels", "placement", "hybrid", "bench")  # where the product and its benches live
C_SUFFIXES = (".h", ".hpp", ".c", ".cc", ".cpp")
SUFFIXES = (".py",) + C_SUFFIXES
SKIP_DIRS = {"__pycache__", "build", "results"}

_OPERATORS = ["<<=", ">>=", "**=", "//=", "->", "::", "<=", ">=", "==", "!=", "+=", "-=", "*=", "/=", "%=", "&=", "|=",
              "^=", "<<", ">>", "**", "//", "&&", "||", "++", "--"]
_TOKEN = re.compile(r"[A-Za-z0-9_]+|" + "|".join(re.escape(o) for o in _OPERATORS) + r"|\S")
_WORD = re.compile(r"[A-Za-z0-9_]")
_GAP = {"py": r"(?:\s|#[^\n]*)", "c": r"(?:\s|//[^\n]*|/\*.*?\*/)"}


class Stale(Exception):
    """The fragment matches no place, or more than one: the entry must be updated."""


@dataclass(frozen=True)
class Match:
    path: Path  # the file, relative to the searched root
    spans: tuple  # (start, end) in the file's text of each token of the fragment


def tokens(text: str) -> list:
    """The fragment's tokens with their (start, end) in text."""
    return [(m.group(), m.start(), m.end()) for m in _TOKEN.finditer(text)]


def pattern(fragment: str, lang: str) -> re.Pattern:
    """A regex matching fragment's tokens in order with whitespace or comments between them; token i is group i + 1."""
    toks = [t for t, _, _ in tokens(fragment)]
    if not toks:
        raise ValueError("an empty fragment anchors nothing")
    gap = _GAP[lang]
    parts = [r"(?<![A-Za-z0-9_])" if _WORD.match(toks[0]) else ""]
    for i, t in enumerate(toks):
        if i:
            both_words = _WORD.match(toks[i - 1]) and _WORD.match(t)
            parts.append(gap + ("+" if both_words else "*"))
        parts.append(f"({re.escape(t)})")
    if _WORD.match(toks[-1]):
        parts.append(r"(?![A-Za-z0-9_])")
    return re.compile("".join(parts), re.S)


def language(path: Path) -> str:
    return "c" if path.suffix in C_SUFFIXES else "py"


def source_files(root: Path, where: str = "") -> list:
    """The project's source files under root (relative paths), narrowed to those under `where` if given."""
    out = []
    for floor in FLOORS:
        for folder, dirs, files in os.walk(root / floor):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(files):
                rel = (Path(folder) / name).relative_to(root)
                if rel.suffix in SUFFIXES and (not where or rel.as_posix().startswith(where.rstrip("/") + "/")):
                    out.append(rel)
    return out


def find(fragment: str, root: Path, where: str = "", texts: dict | None = None) -> Match:
    """The one place in the project's sources where fragment is; Stale if none or several.

    texts: an optional cache {relative path: text} shared between calls.
    """
    words = sorted((t for t, _, _ in tokens(fragment) if _WORD.match(t)), key=len)
    key = words[-1] if words else None
    pats = {}
    found = []
    for rel in source_files(root, where):
        if texts is None or rel not in texts:
            text = (root / rel).read_text(errors="replace")
            if texts is not None:
                texts[rel] = text
        else:
            text = texts[rel]
        if key is not None and key not in text:
            continue
        lang = language(rel)
        if lang not in pats:
            pats[lang] = pattern(fragment, lang)
        for m in pats[lang].finditer(text):
            found.append(Match(rel, tuple(m.span(i + 1) for i in range(len(m.groups())))))
    if len(found) != 1:
        places = ", ".join(f"{m.path}:{_line(texts, root, m)}" for m in found[:4])
        raise Stale("matches nothing" if not found else f"matches {len(found)} places ({places})")
    return found[0]


def _line(texts, root, m: Match) -> int:
    text = texts[m.path] if texts and m.path in texts else (root / m.path).read_text(errors="replace")
    return text.count("\n", 0, m.spans[0][0]) + 1


def mutate(text: str, match: Match, old: str, new: str) -> str:
    """text with the matched fragment `old` rewritten as `new`: only the differing tokens' stretch changes."""
    a, b = tokens(old), tokens(new)
    if [t for t, _, _ in a] == [t for t, _, _ in b]:
        raise ValueError("the mutation changes no token")
    pre = 0
    while pre < min(len(a), len(b)) and a[pre][0] == b[pre][0]:
        pre += 1
    suf = 0
    while suf < min(len(a), len(b)) - pre and a[-1 - suf][0] == b[-1 - suf][0]:
        suf += 1
    spans = match.spans
    if pre + suf < len(a) and pre + suf < len(b):
        # tokens replaced: from the first changed token to the last one, the layout around them kept
        start, end = spans[pre][0], spans[len(a) - suf - 1][1]
        new_start, new_end = b[pre][1], b[len(b) - suf - 1][2]
    else:
        # tokens only inserted or only deleted: the stretch between the unchanged neighbours, in both texts
        start = spans[pre - 1][1] if pre else spans[0][0]
        end = spans[len(a) - suf][0] if suf else spans[-1][1]
        new_start = b[pre - 1][2] if pre else (b[0][1] if b else 0)
        new_end = b[len(b) - suf][1] if suf else (b[-1][2] if b else 0)
    return text[:start] + new[new_start:new_end] + text[end:]
