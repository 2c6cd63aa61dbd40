"""`hybrid bench crossover`: the crossover sweep by tokens per expert on this machine.

The other benchmarks are developer tools run from a checkout as `python -m bench.<module>`; the installed
package does not carry them. A sweep takes minutes on a small CPU (one point at m = 4096 alone can take a
minute), so every line is stamped with the elapsed time and a quiet point is named every 30 s.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from hybrid.commands.cost import add_shape_args, parse_tokens, shape_from_args
from hybrid.errors import UsageError
from placement.hardware import default_profile_path, pricing_profile


def sweep_profile(name: str | None):
    """The profile of the predictions (placement.hardware.pricing_profile, as every command resolves it), or None
    (measure only) when none is named and none calibrated: a built-in CPU's predictions beside this CPU's
    measurements would only mislead."""
    if name is None and not default_profile_path().exists():
        print(f"note: no calibrated profile at {default_profile_path()} and no --profile: measuring only, every "
              "prediction column is '-' (run `hybrid calibrate` first)")
        return None
    return pricing_profile(name, note=lambda line: print(f"note: {line}"))


def say_cpu_only(profile) -> None:
    """Without CUDA nothing crosses a link: T_G is not measured, and its prediction is the profile's GPU."""
    from hybrid.runtime.device_role import is_cuda

    if is_cuda(None):
        return
    pred = ("its prediction is the profile's GPU figures (a hypothetical GPU)" if profile is not None
            else "nor predicted")
    print(f"note: no CUDA device: T_G (ship weights to the GPU) is not measured, {pred}; the winner column is '-'")


def sweep_log(progress, points: list[int], table: io.StringIO):
    """log(line) for the sweep: each line to the table file as it is, and to the terminal stamped with the elapsed
    time and numbered by point; the heartbeat names the point being measured."""
    done = 0

    def log(line: str) -> None:
        nonlocal done
        table.write(line + "\n")
        if line.startswith("  m=") and done < len(points):
            done += 1
            line = f"{line}   [{done}/{len(points)}]"
        progress(line)
        if done < len(points):
            progress.step = f"point m={points[done]} ({done + 1}/{len(points)})"

    return log


def run_crossover(args) -> int:
    from hybrid.commands.calibrate import Progress
    from placement import crossover

    shape = shape_from_args(args)
    if args.experts < 1:
        raise UsageError(f"--experts must be >= 1, got {args.experts}")
    sweep = parse_tokens(args.tokens) if args.tokens else None
    profile = sweep_profile(args.profile)
    say_cpu_only(profile)
    table = io.StringIO()

    def log(line: str) -> None:
        print(line, flush=True)
        table.write(line + "\n")

    with Progress(out=sys.stdout) as progress:
        res = crossover.run_sweep(shape, profile, experts=args.experts, sweep=sweep, backend=args.backend,
                                  reps=args.reps, refine=not args.no_refine,
                                  log=sweep_log(progress, sorted(sweep or crossover.DEFAULT_SWEEP), table))
    log("")
    crossover.print_table(res, log=log)
    tag = shape.name if args.tag is None else args.tag
    paths = crossover.write_outputs(res, Path(args.out), tag)
    path = Path(args.out) / f"crossover_{tag}.txt"
    path.write_text(table.getvalue())
    print("wrote " + ", ".join(str(p) for p in [*paths, path]))
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
    c.add_argument("--profile", help="profile for the predictions (default: this machine's calibrated profile; one "
                   "calibrated without a GPU borrows the built-in GPU figures; none: measure only)")
    c.add_argument("--backend", help="CPU backend (a compiled ISA or 'torch'; default: the best present)")
    c.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median); default 3")
    c.add_argument("--no-refine", action="store_true", help="do not bisect the measured crossover")
    c.add_argument("--out", default="bench/results", help="output folder; default %(default)s")
    c.add_argument("--tag", help="file name tag (default: the shape name)")
    c.set_defaults(func=run_crossover)
