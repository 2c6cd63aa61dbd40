"""`hybrid bench crossover`: the crossover sweep by tokens per expert (placement.crossover) on this machine.

The other benchmarks are developer tools run from a checkout as `python -m bench.<module>`; the installed
package does not carry them."""

from __future__ import annotations

import io
from pathlib import Path

from hybrid.commands.cost import add_shape_args, parse_tokens, shape_from_args
from hybrid.errors import UsageError
from placement.hardware import default_profile_path, resolve_profile


def run_crossover(args) -> int:
    from placement import crossover

    shape = shape_from_args(args)
    if args.experts < 1:
        raise UsageError(f"--experts must be >= 1, got {args.experts}")
    sweep = parse_tokens(args.tokens) if args.tokens else None
    if args.profile is None and not default_profile_path().exists():
        print(f"note: no calibrated profile at {default_profile_path()} and no --profile: measuring only, no "
              "predictions (run `hybrid calibrate` first)")
        profile = None
    else:
        profile = resolve_profile(args.profile)
    buf = io.StringIO()

    def log(line: str) -> None:
        print(line, flush=True)
        buf.write(line + "\n")

    res = crossover.run_sweep(shape, profile, experts=args.experts, sweep=sweep, backend=args.backend,
                              reps=args.reps, refine=not args.no_refine, log=log)
    log("")
    crossover.print_table(res, log=log)
    tag = shape.name if args.tag is None else args.tag
    paths = crossover.write_outputs(res, Path(args.out), tag)
    table = Path(args.out) / f"crossover_{tag}.txt"
    table.write_text(buf.getvalue())
    print("wrote " + ", ".join(str(p) for p in [*paths, table]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="the crossover sweep (other benchmarks: python -m bench.<module> in a checkout)")
    inner = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p), required=True)
    c = inner.add_parser("crossover", help="measured vs predicted T_C and T_G over tokens per expert",
                         description="Measures, per tokens-per-expert m, shipping activations to the CPU (T_C) "
                         "and shipping weights to the GPU (T_G) end to end, beside the cost model's "
                         "predictions from the calibrated profile; writes a table, JSON and a PNG plot.")
    add_shape_args(c)
    c.add_argument("--experts", type=int, default=8, help="experts run back to back; default 8")
    c.add_argument("--tokens", help="comma-separated sweep of m (default 1,2,4,...,4096)")
    c.add_argument("--profile", help="profile for the predictions (default: this machine's calibrated profile)")
    c.add_argument("--backend", help="CPU backend (a compiled ISA or 'torch'; default: the best present)")
    c.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median); default 3")
    c.add_argument("--no-refine", action="store_true", help="do not bisect the measured crossover")
    c.add_argument("--out", default="bench/results", help="output folder; default %(default)s")
    c.add_argument("--tag", help="file name tag (default: the shape name)")
    c.set_defaults(func=run_crossover)
