"""The mutation survey's anchors (tools/anchors.py): a fragment is found by its code whatever the layout and
comments around it, exactly once or not at all, and a mutation rewrites only the tokens it changes. The
last test is the survey's --check: every entry's code is still in the sources, once (the survey itself
runs outside CI: `python tools/mutation_survey.py`)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import anchors  # noqa: E402
import mutation_survey  # noqa: E402

PY = '''def limit(items, cap):
    if len(items) > cap:  # one past the cap
        raise ValueError("too many")
    return items
'''
C = '''static int clamp(int value) {
  g_rows = std::min(64, std::max(8, value / 4 * 4));  // whole lines
  return g_rows;
}
'''


def _project(tmp_path, files):
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_found_across_whitespace_line_breaks_and_comments(tmp_path):
    moved = PY.replace("if len(items) > cap:", "if len(\n            items) >  # a comment inside\n            cap:")
    root = _project(tmp_path, {"hybrid/a.py": moved, "cpu_kernels/csrc/k.h": C.replace("8,", "8, /* floor */")})
    m = anchors.find("if len(items) > cap:", root)
    assert m.path == Path("hybrid/a.py")
    m = anchors.find("g_rows = std::min(64, std::max(8, value / 4 * 4));", root)
    assert m.path == Path("cpu_kernels/csrc/k.h")
    # a renamed or moved file still matches: the search is by content over every floor
    (root / "placement").mkdir()
    (root / "hybrid/a.py").rename(root / "placement/b.py")
    assert anchors.find("if len(items) > cap:", root).path == Path("placement/b.py")


def test_refuses_no_match_and_two_matches(tmp_path):
    root = _project(tmp_path, {"hybrid/a.py": PY, "bench/b.py": PY})
    with pytest.raises(anchors.Stale, match="matches 2 places"):
        anchors.find("if len(items) > cap:", root)
    assert anchors.find("if len(items) > cap:", root, where="bench").path == Path("bench/b.py")  # narrowed
    with pytest.raises(anchors.Stale, match="matches nothing"):
        anchors.find("if len(items) >= cap:", root)
    # a word matches only whole: `if x` is not inside `elif x`, and `cap` is not a prefix of `capacity`
    root = _project(tmp_path / "w", {"hybrid/a.py": "elif n > cap:\n    pass\nif n > capacity:\n    pass\n"})
    for fragment in ("if n > cap:", "if n > cap"):
        with pytest.raises(anchors.Stale, match="matches nothing"):
            anchors.find(fragment, root)
    # comments are skipped only by their own language's syntax: `#` is code in C, `//` is floor division in Python
    root = _project(tmp_path / "c", {"cpu_kernels/k.h": "int a = 1; # b\n", "hybrid/d.py": "q = n // d\n"})
    with pytest.raises(anchors.Stale):
        anchors.find("int a = 1; b", root)
    assert anchors.find("q = n // d", root).path == Path("hybrid/d.py")


def test_mutation_rewrites_only_the_changed_tokens(tmp_path):
    text = PY.replace("if len(items) > cap:", "if len(items) >  cap:")  # the source's own spacing
    root = _project(tmp_path, {"hybrid/a.py": text})
    m = anchors.find("if len(items) > cap:", root)
    got = anchors.mutate(text, m, "if len(items) > cap:", "if len(items) >= cap:")
    assert got == text.replace(">  cap", ">=  cap")  # spacing and the comment after it kept
    ge = anchors.find("if len(items) >= cap:", _project(tmp_path / "ge", {"hybrid/a.py": got}))
    back = anchors.mutate(got, ge, "if len(items) >= cap:", "if len(items) > cap:")
    assert back == text  # `>=` is one token, replaced whole
    # an insertion, a deletion of a whole statement, and a change spanning lines keep the indentation
    got = anchors.mutate(text, m, "if len(items) > cap:", "if len(items) > cap + 1:")
    assert "    if len(items) >  cap + 1:  # one past the cap\n" in got
    m = anchors.find('raise ValueError("too many")', root)
    assert anchors.mutate(text, m, 'raise ValueError("too many")', "").count("ValueError") == 0
    m = anchors.find('cap: raise ValueError("too many") return items', root)
    got = anchors.mutate(text, m, 'cap: raise ValueError("too many") return items', "cap:\n    return []")
    assert got.endswith("    if len(items) >  cap:  # one past the cap\n        return []\n")
    with pytest.raises(ValueError, match="changes no token"):
        anchors.mutate(text, m, "a + b", "a  +  b")


def test_every_entry_is_found_once_and_changes_its_code():
    """The survey's --check: an entry whose code was renamed, deleted or duplicated fails here, not silently."""
    texts = {}
    stale = {}
    for m in mutation_survey.MUTATIONS:
        assert [t for t, _, _ in anchors.tokens(m.old)] != [t for t, _, _ in anchors.tokens(m.new)], m.name
        try:
            mutation_survey.locate(m, ROOT, texts)
        except anchors.Stale as e:
            stale[m.name] = str(e)
    assert not stale, stale
