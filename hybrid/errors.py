"""Errors the CLI turns into one-line messages with exit status 2 (never a traceback)."""


class UsageError(Exception):
    """A bad value given by the user (unknown preset, malformed profile, nonsense token list, ...)."""


class TooLarge(UsageError, ValueError):
    """A size that cannot fit this machine (a KV cache beyond free memory, ...), refused before allocating."""
