"""Reading and writing the project's JSON files (plans, routing statistics, hardware profiles)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybrid.errors import UsageError


def write_json(path: str | os.PathLike, data, indent: int | None = None) -> Path:
    """Write `data` to `path` (parents created); returns the expanded path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def read_json(path: str | os.PathLike, flag: str):
    """The JSON in `path`; a missing or unreadable file is a UsageError naming the command-line `flag`."""
    path = Path(path).expanduser()
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{flag}: no such file: {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{flag} {path}: cannot read it as JSON ({exc})") from None
