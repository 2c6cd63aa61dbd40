"""CLI sub-commands; each module has `register(subparsers)`."""
