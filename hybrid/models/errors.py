"""Errors raised while reading a checkpoint; the CLI prints them in one line with exit status 2."""

from hybrid.errors import UsageError


class ModelLoadError(UsageError):
    """A checkpoint that cannot be loaded: missing file, missing/unexpected tensor, wrong shape,
    unsupported architecture, missing config field, truncated safetensors. The message names the culprit."""
