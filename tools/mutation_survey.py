"""Hand-picked mutations that the tests must catch: a check that the tests can fail where it matters.

    python tools/mutation_survey.py            # every mutation (C++ ones rebuild the kernels: ~1 min each)
    python tools/mutation_survey.py --python   # only the mutations of Python files (seconds each)
    python tools/mutation_survey.py --only int4
    python tools/mutation_survey.py --check    # only that every entry's code is still there, once (seconds)

Each mutation (tools/mutations.py) is a one-line change a plausible bug would make (an off-by-one at a
limit, a dropped term, a wrong lane index) and the test files that should see it. Its code is found by
content, not by file and line (tools/anchors.py), so renames, moves and comment edits do not stale it. The
survey copies the repository into a temporary directory, applies one mutation at a time there (the working
tree is never touched), rebuilds the compiled kernels when a C or C++ file changed, and runs the tests. A
mutation the tests do not fail is a gap, and an entry whose code is gone or no longer unique is STALE: for
either the survey names it and exits 1.

This is not part of the CI command (the C++ half needs ~15 minutes on two cores); its --check is, through
tests/test_mutation_tool.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import anchors
from mutations import MUTATIONS

ROOT = Path(__file__).resolve().parents[1]


def locate(m, root: Path, texts: dict | None = None):
    """m's one match in root's sources; anchors.Stale if its code or one of its test files is gone."""
    missing = [t for t in m.tests if not (root / t).is_file()]
    if missing:
        raise anchors.Stale(f"test file {', '.join(missing)} is gone")
    return anchors.find(m.old, root, m.where, texts)


def is_compiled(path: Path) -> bool:
    return path.suffix in anchors.C_SUFFIXES


def build(tree: Path) -> bool:
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                          capture_output=True).returncode == 0


def survey_one(m, tree: Path) -> str:
    """Apply m in tree, run its tests, restore the file: 'killed ...', 'SURVIVED' or 'STALE ...'."""
    try:
        match = locate(m, tree)
    except anchors.Stale as e:
        return f"STALE ({e}: update the entry)"
    path = tree / match.path
    orig = path.read_text()
    path.write_text(anchors.mutate(orig, match, m.old, m.new))
    try:
        if is_compiled(match.path) and not build(tree):
            return "killed (does not compile)"
        env = dict(os.environ, PYTHONPATH=str(tree))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return "killed (tests hang)"
        return "killed" if r.returncode else "SURVIVED"
    finally:
        path.write_text(orig)
        if is_compiled(match.path):  # back to the unmutated kernels for the next entry
            build(tree)


def check(todo) -> list:
    """The entries whose code is not found exactly once here (printed with the reason)."""
    texts = {}
    stale = []
    for m in todo:
        try:
            locate(m, ROOT, texts)
        except anchors.Stale as e:
            print(f"{m.name:36} STALE ({e})", flush=True)
            stale.append(m.name)
    return stale


def mutates_compiled(m, texts: dict) -> bool:
    """Whether m changes a C or C++ file (known once its code is found; an unfound entry counts as Python)."""
    try:
        return is_compiled(locate(m, ROOT, texts).path)
    except anchors.Stale:
        return False


def select(python_only: bool, only: str | None) -> list:
    todo = [m for m in MUTATIONS if not only or only in m.name]
    if python_only:
        texts = {}
        todo = [m for m in todo if not mutates_compiled(m, texts)]
    return todo


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", action="store_true", help="only the mutations of Python files")
    p.add_argument("--only", help="only mutations whose name contains this")
    p.add_argument("--check", action="store_true", help="only check that every entry's code is found exactly once")
    a = p.parse_args(argv)
    todo = select(a.python, a.only)
    if not todo:
        print("no mutation selected")
        return 1
    if a.check:
        stale = check(todo)
        print(f"{len(todo) - len(stale)} of {len(todo)} entries found once" +
              (f"; stale: {', '.join(stale)}" if stale else ""))
        return 1 if stale else 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
        texts = {}
        if any(mutates_compiled(m, texts) for m in todo) and not build(tree):
            print("the unmutated kernels do not build")
            return 1
        bad = []
        for m in todo:
            verdict = survey_one(m, tree)
            print(f"{m.name:36} {verdict}", flush=True)
            if not verdict.startswith("killed"):
                bad.append(m.name)
    print(f"{len(todo) - len(bad)} of {len(todo)} killed" + (f"; gaps or stale: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
