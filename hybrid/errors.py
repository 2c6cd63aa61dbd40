"""Errors the CLI turns into one-line messages with exit status 2 (never a traceback)."""


class UsageError(Exception):
    """A bad value given by the user (unknown preset, malformed profile, nonsense token list, ...)."""
