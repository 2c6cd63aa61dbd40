"""The `hybrid` command line: one sub-command per module in hybrid.commands.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func` (a callable
taking the parsed namespace and returning an exit status). Adding a command = adding its module name to
COMMANDS below; nothing else here changes.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hybrid.errors import UsageError

COMMANDS = [
    "cost",
    "generate",
    "chat",
    "calibrate",
    "bench",
    "serve",
    "profile-routing",
    "plan",
]


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (with a hint to --help) and exits with 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> Parser:
    parser = Parser(
        prog="hybrid",
        description="Serve big MoE models on one box: hot experts on the GPU, cold experts on the CPU, "
        "split per batch by a cost model calibrated on this machine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"hybrid.commands.{name.replace('-', '_')}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench":
        from hybrid.commands.bench import FORWARDED, run_module

        if argv[1] in FORWARDED:
            return run_module(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"hybrid {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
