"""Progress bars that suit where stderr goes: tqdm's bar on a terminal, whole lines in a log.

A redirected tqdm bar writes carriage returns, and nested bars (loading a checkpoint while its experts are
packed) write cursor-movement escapes, so a log file fills with control codes and one very long line. In a
log, LineBar prints one plain line at the start, at each tenth of the total (or every 30 s without a total)
and at the end.

The loader, the expert packer and the checkpoint writer make their bars with `from tqdm import tqdm` when they
run; `line_bars_when_redirected()` (entered by `hybrid` and the benches' entry point) swaps that name for
LineBar while stderr is not a terminal, so each of them gets the right kind without knowing about terminals.
"""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm

UNTOTALLED_EVERY_S = 30.0  # a bar without a total prints a line this often


class LineBar(tqdm):
    """tqdm's counting and formatting, printed as whole lines: no carriage returns, no cursor moves."""

    def __init__(self, *args, **kwargs):
        self._printed_step, self._printed_n, self._printed_at = -1, None, 0.0  # display() runs inside __init__
        kwargs.setdefault("ncols", 0)  # statistics only: a bar of block characters says nothing in a log
        super().__init__(*args, **kwargs)

    def _due(self) -> bool:
        if self.total:
            return min(10, int(10 * self.n / self.total)) > self._printed_step
        return self._printed_n is None or time.monotonic() - self._printed_at >= UNTOTALLED_EVERY_S

    def _write_line(self) -> None:
        self.fp.write(self.format_meter(**self.format_dict) + "\n")
        self.fp.flush()
        self._printed_step = min(10, int(10 * self.n / self.total)) if self.total else 0
        self._printed_n, self._printed_at = self.n, time.monotonic()

    def display(self, msg=None, pos=None):  # noqa: ARG002 - tqdm's signature; a line has no position
        """tqdm's refresh: a line only when one is due; a request to clear (msg '') writes nothing."""
        if msg == "" or not self._due():
            return False
        self._write_line()
        return True

    def clear(self, nolock=False):  # noqa: ARG002 - a printed line is never erased
        return None

    def close(self):
        """The last line holds the final count, once; tqdm's own close then has nothing left to write."""
        if not getattr(self, "disable", True) and self._printed_n != self.n:
            self._write_line()
        self.leave = False
        super().close()


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def progress_bar(*args, **kwargs) -> tqdm:
    """A tqdm bar on a terminal, a LineBar otherwise (on the stream given as file=, stderr by default)."""
    cls = tqdm if is_terminal(kwargs.get("file") or sys.stderr) else LineBar
    return cls(*args, **kwargs)


@contextlib.contextmanager
def line_bars_when_redirected():
    """While stderr is not a terminal, every `from tqdm import tqdm` made inside this block gets LineBar."""
    import tqdm as package

    if is_terminal(sys.stderr) or package.tqdm is LineBar:
        yield
        return
    saved, package.tqdm = package.tqdm, LineBar
    try:
        yield
    finally:
        package.tqdm = saved
