"""Errors the CLI turns into one-line messages with exit status 2 (never a traceback).

UsageError is defined on the placement floor, which raises it too; this module re-exports that same class."""

from placement.errors import UsageError

__all__ = ["TooLarge", "UsageError"]


class TooLarge(UsageError, ValueError):
    """A size that cannot fit this machine (a KV cache beyond free memory, ...), refused before allocating."""
