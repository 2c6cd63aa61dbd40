"""`hybrid calibrate`: measure this machine and write its HardwareProfile JSON."""

from __future__ import annotations

import json

from hybrid.commands.cost import add_shape_args, shape_from_args
from hybrid.errors import UsageError
from placement.hardware import default_profile_path


def run(args) -> int:
    from placement.calibrate import calibrate, summary  # imports torch: keep `hybrid --help` fast

    shape = shape_from_args(args)
    if args.experts < 1:
        raise UsageError(f"--experts must be >= 1, got {args.experts}")
    backends = [b.strip() for b in args.backends.split(",")] if args.backends else None
    profile, raw = calibrate(shape, quick=args.quick, experts=args.experts, backends=backends)
    out = profile.save(args.out or default_profile_path())
    if args.raw:
        with open(args.raw, "w") as f:
            json.dump(raw, f, indent=2)
    print(f"\nprofile {profile.name} written to {out}")
    print(summary(profile))
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Measures DRAM read bandwidth, the CPU expert throughput C_C(m) of every "
                       "CPU backend present (compiled kernels per ISA, torch) at an expert shape, and, with "
                       "CUDA, the pinned link (alpha + bytes/B_L fitted from 8 KiB to 256 MiB), HBM bandwidth "
                       "and GPU expert throughput. Writes a JSON profile the cost model reads.")
    add_shape_args(p)
    p.add_argument("--experts", type=int, default=8, help="experts per measurement (weights >> cache); default 8")
    p.add_argument("--backends", help="comma-separated CPU backends to measure (default: all present)")
    p.add_argument("--quick", action="store_true", help="fewer token counts and sizes (about a minute)")
    p.add_argument("--out", help=f"profile path (default {default_profile_path()}; HYBRID_CACHE moves it)")
    p.add_argument("--raw", help="also write the raw measurements as JSON to this path")
    p.set_defaults(func=run)
