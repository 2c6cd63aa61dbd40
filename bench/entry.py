"""How a bench runs as `python -m bench.<module>`: a user's mistake reads as `hybrid` reports one.

A bad flag value or a profile without the figures a bench needs is one line on stderr and exit status 2,
never a traceback, the same rule hybrid.cli applies to its commands; anything else is a bug and is raised.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


def run_main(main: Callable[[], int | None]) -> int:
    """Call main() and return its exit status, printing a user error as `bench.<module>: error: <message>`."""
    from hybrid.cli import is_user_error

    try:
        return int(main() or 0)
    except Exception as exc:  # noqa: BLE001 - only user errors are caught; everything else re-raised
        if not is_user_error(exc):
            raise
        spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m bench.x`: its module name
        print(f"{spec.name if spec else Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        return 2
