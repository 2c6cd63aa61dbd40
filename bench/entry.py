"""How a bench runs as `python -m bench.<module>`: a user's mistake reads as `hybrid` reports one.

A bad flag value or a model larger than this machine's DRAM is one line on stderr and exit status 2,
never a traceback, the same rule hybrid.cli applies to its commands; anything else is a bug and is raised.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable


def run_main(main: Callable[[], int | None]) -> int:
    """Call main() and return its exit status, printing a user error as `bench.<module>: error: <message>`;
    progress bars are whole lines when stderr is a log (hybrid.loading.progress)."""
    from hybrid.cli import is_user_error
    from hybrid.loading.progress import line_bars_when_redirected

    try:
        with line_bars_when_redirected():
            return int(main() or 0)
    except Exception as exc:  # noqa: BLE001 - only user errors are caught; everything else re-raised
        if not is_user_error(exc):
            raise
        spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m bench.x`: its module name
        print(f"{spec.name if spec else Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        return 2
