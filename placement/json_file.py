"""Reading and writing the project's JSON files (plans, routing statistics, hardware profiles)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from placement.errors import UsageError


def write_json(path: str | os.PathLike, data, indent: int | None = None) -> Path:
    """Write `data` to `path` (parents created); returns the expanded path. The text goes to a temporary file
    beside `path` that is renamed over it once complete, so a full or read-only disk, a size limit or a
    signal never leaves a truncated profile, plan or statistics file behind: the old file stays intact, and
    the failure is one UsageError line."""
    import tempfile

    path = Path(path).expanduser()
    text = json.dumps(data, indent=indent) + "\n"
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}; any previous file there is unchanged") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def read_json(path: str | os.PathLike, flag: str):
    """The JSON in `path`; a missing or unreadable file is a UsageError naming the command-line `flag`."""
    path = Path(path).expanduser()
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{flag}: no such file: {path}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    except (OSError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{flag} {path}: cannot read it as JSON ({exc})") from None


def check_writable(path: str | os.PathLike | None, flag: str) -> None:
    """Fails now, not after minutes of measuring, if `path` cannot be written (its folder is created)."""
    if path is None:
        return
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None
