"""The `hybrid` command line: one sub-command per module in hybrid.commands.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func` (a callable
taking the parsed namespace and returning an exit status), and starts its docstring with "`hybrid NAME`:
summary", the line `hybrid --help` lists. Adding a command = adding its module name to COMMANDS below; nothing
else here changes.

Only the command being run registers its flags: registering may import what the flags need (the runtime,
torch), which takes seconds, and `hybrid --help` lists every command from its module's docstring alone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Iterable

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
    "cache",
]


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (with a hint to --help) and exits with 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def command_module(name: str):
    return importlib.import_module(f"hybrid.commands.{name.replace('-', '_')}")


def summary(module) -> str:
    """The first line of a command module's docstring without its "`hybrid NAME`: " lead and final period."""
    first = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
    return re.sub(r"^`hybrid [^`]*`:\s*", "", first).rstrip(".")


def build_parser(register: Iterable[str] = COMMANDS) -> Parser:
    """The parser with the commands in `register` fully declared; every other command is listed by its summary
    (enough for `hybrid --help` and for naming the choices of a mistyped command)."""
    register = set(register)
    parser = Parser(
        prog="hybrid",
        description="Serve big MoE models on one box: hot experts on the GPU, cold experts on the CPU, "
        "split per batch by a cost model calibrated on this machine. Design: DESIGN.md in the repository.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        module = command_module(name)
        if name in register:
            module.register(sub)
        else:
            sub.add_parser(name, help=summary(module))
    return parser


def is_user_error(exc: BaseException) -> bool:
    """Errors that are the user's input, not a bug: printed in one line. IsaUnavailable is a bad or
    unrunnable HYBRID_CPU_ISA, BadKnob any other bad HYBRID_* variable (checked only if their modules were
    ever imported)."""
    if isinstance(exc, UsageError):
        return True
    native = sys.modules.get("cpu_kernels._native")
    knobs = sys.modules.get("cpu_kernels.knobs")
    return ((native is not None and isinstance(exc, native.IsaUnavailable))
            or (knobs is not None and isinstance(exc, knobs.BadKnob)))


# PyTorch's CUDA allocator maps memory in growable segments instead of fixed blocks, so a long prefill's
# activations of changing sizes do not leave VRAM stranded in half-used blocks (a DeepSeek-V3 cut with int4 GPU
# weights under --gpu-budget 24GiB peaked 2.2 GiB lower, H100, nvidia-smi). Read when CUDA first allocates; a
# value the user set is kept.
ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    command = argv[0] if argv else "hybrid"
    from hybrid.loading.progress import line_bars_when_redirected

    try:
        with line_bars_when_redirected():
            return _run(argv)
    except BrokenPipeError:
        # `hybrid ... | head`: the reader left. Point stdout at /dev/null so the interpreter's final flush
        # does not raise again, and exit as a C tool killed by SIGPIPE would (128 + 13), silently.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - only user errors are caught; everything else re-raised
        if not is_user_error(exc):
            raise
        prefix = f"hybrid {command}" if command in COMMANDS else "hybrid"
        print(f"{prefix}: error: {exc}", file=sys.stderr)
        return 2


def _run(argv: list[str]) -> int:
    parser = build_parser(register=argv[:1])
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from cpu_kernels.knobs import knobs

    knobs()  # every HYBRID_* variable checked once, before the command starts work
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
