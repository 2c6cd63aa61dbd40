"""The error every floor above cpu_kernels raises for a bad user input; the CLI prints it in one line with exit
status 2, never a traceback. It lives on the lowest floor that raises it (placement validates profiles, plans,
shapes and budgets), and hybrid.errors re-exports the same class, so one `except UsageError` catches both."""


class UsageError(Exception):
    """A bad value given by the user (unknown preset, malformed profile, nonsense token list, ...)."""
