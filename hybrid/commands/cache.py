"""`hybrid cache`: list or remove the packed-expert caches that make a restart skip converting the experts.

`generate`, `chat`, `serve` and `profile-routing` with the hybrid flags write each checkpoint's CPU expert bytes,
as the executor packs them, under $HYBRID_CACHE/packed/<key>/ and copy them back at the next start with the
same checkpoint, CPU dtype and machine layout (hybrid/offload/packed_cache.py); --no-cache turns that off.
A cache is as large as the experts in DRAM, so old ones are worth removing: `hybrid cache rm KEY` or `--all`.
"""

from __future__ import annotations

import time

from hybrid.errors import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser("cache", help="list or remove the packed-expert caches",
                              description="The packed-expert caches under $HYBRID_CACHE/packed: one per checkpoint, "
                              "CPU dtype and machine layout, each as large as the experts in DRAM.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    ls = actions.add_parser("list", help="key, model folder, dtype, size and last use of each cache")
    ls.set_defaults(func=run_list)
    rm = actions.add_parser("rm", help="remove one cache (KEY, or a unique prefix of 6+ characters) or --all")
    rm.add_argument("key", nargs="?", metavar="KEY", help="a key `hybrid cache list` shows")
    rm.add_argument("--all", action="store_true", help="remove every cache")
    rm.set_defaults(func=run_rm)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def run_list(args) -> int:
    from hybrid.offload.packed_cache import cache_root, list_caches

    caches = list_caches()
    if not caches:
        print(f"no packed caches under {cache_root()}")
        return 0
    rows = [("KEY", "MODEL", "DTYPE", "SIZE", "LAST USED")]
    rows += [(c.key, c.model, c.dtype, _gb(c.bytes), time.strftime("%Y-%m-%d %H:%M", time.localtime(c.last_used)))
             for c in caches]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[4])
    print(f"{len(caches)} cache(s), {_gb(sum(c.bytes for c in caches))} under {cache_root()}")
    return 0


def run_rm(args) -> int:
    from hybrid.offload.packed_cache import cache_root, list_caches, remove_cache

    if args.all == (args.key is not None):
        raise UsageError("give a KEY or --all, not both (`hybrid cache list` shows the keys)")
    if args.all:
        gone = list_caches()
        for c in gone:
            remove_cache(c.key)
        print(f"removed {len(gone)} cache(s), {_gb(sum(c.bytes for c in gone))}")
        return 0
    try:
        c = remove_cache(args.key)
    except KeyError as exc:
        raise UsageError(f"{exc.args[0]} under {cache_root()} (`hybrid cache list` shows them)") from None
    print(f"removed {c.key} ({c.model}, {c.dtype}, {_gb(c.bytes)})")
    return 0
