"""Every HYBRID_* environment variable the project reads, in one list, parsed once per process.

The variables are for what differs between deployments (an ISA to force, a cache folder, a shared machine);
everything else is a command-line option. `knobs()` parses os.environ on its first call and caches the
result, so a setting never changes half way through a run and hot paths read a field, not the environment.
A value a knob does not take raises BadKnob, one line that names the variable (the CLI prints it and exits
with 2); an unset or empty variable means the default.

Tests that set a variable re-read it explicitly:

    monkeypatch.setenv("HYBRID_HUGEPAGES", "0")
    knobs.reset()          # the next knobs() parses the environment again

`python -m cpu_kernels.knobs` prints the README's reference table of them.

This module sits on the lowest floor (it imports nothing from the project), so cpu_kernels, placement and
hybrid all read it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class BadKnob(ValueError):
    """A HYBRID_* variable holds a value its knob does not take."""


@dataclass(frozen=True)
class Knob:
    """One environment variable: its name, default (as the variable would spell it), kind and meaning.

    kind: "bool" (0 or 1), "count" (a whole number >= 0), "choice" (one of `choices`), "path", "text", "secret"
    (text taken as written, never logged)."""

    name: str
    default: str
    kind: str
    meaning: str
    choices: tuple[str, ...] = ()

    @property
    def attr(self) -> str:
        """The Knobs attribute that holds its value: HYBRID_CPU_ISA -> cpu_isa."""
        return self.name.removeprefix("HYBRID_").lower()


# The words a choice of 0 / 1 also takes (HYBRID_FUSED_DECODE took them before it was listed here).
_SYNONYMS = {"off": "0", "false": "0", "no": "0", "on": "1", "true": "1", "yes": "1"}

KNOBS: tuple[Knob, ...] = (
    Knob("HYBRID_CPU_ISA", "", "text",
         "Force the CPU executor's ISA: amx, avx512_bf16, avx2 or ref (unset: the best this machine runs; "
         "one it cannot run is an error)."),
    Knob("HYBRID_HUGEPAGES", "1", "bool",
         "1: expert weights are advised into 2 MiB pages (fewer TLB misses while streaming them); 0: default pages."),
    Knob("HYBRID_SPIN_US", "2000", "count",
         "Microseconds the CPU executor's idle workers spin before sleeping during GPU decode (spinning skips a "
         "wake-up per layer; lower it on a machine shared with other work)."),
    Knob("HYBRID_CORE_SPLIT", "1", "bool",
         "On CUDA, 1: one core is kept off the CPU executor for the thread that launches GPU work, which is "
         "pinned there, and the CPU lane's thread is pinned; 0: the pool --cpu-threads asks for, nothing "
         "pinned (a machine shared with other work)."),
    Knob("HYBRID_FUSED_DECODE", "auto", "choice",
         "The Triton decode kernels: auto (on with CUDA compute capability 8.0+ and Triton), 0 (off: the "
         "unfused torch chain, a fallback), 1 (required: an error without Triton).",
         ("auto", "0", "1")),
    Knob("HYBRID_CACHE", "~/.cache/hybrid", "path",
         "Folder of the calibrated profile.json, the training corpus and the caches: packed experts (packed/; "
         "`hybrid cache list`, `hybrid cache rm`), GGUF tokenizers (gguf-tokenizers/) and GGUF headers "
         "(gguf-headers/)."),
    Knob("HYBRID_NO_PROGRESS", "0", "bool", "1: no progress bars while loading and packing a model (logs, CI)."),
    Knob("HYBRID_API_KEY", "", "secret",
         "`hybrid serve`'s bearer key when --api-key is not given (a variable keeps it off the command line, "
         "which other users can read)."),
)
KNOB = {k.name: k for k in KNOBS}


@dataclass(frozen=True)
class Knobs:
    """The parsed values, one attribute per knob (Knob.attr)."""

    cpu_isa: str | None = None  # None: choose the best available
    hugepages: bool = True
    spin_us: int = 2000
    core_split: bool = True
    fused_decode: str = "auto"  # "auto" | "0" | "1"
    cache: Path | None = None  # parse() fills in ~/.cache/hybrid
    no_progress: bool = False
    api_key: str | None = field(default=None, repr=False)  # a credential: kept out of logs


def _value(knob: Knob, raw: str):
    if knob.kind == "bool":
        if raw not in ("0", "1"):
            raise BadKnob(f"{knob.name} must be 0 or 1, not {raw!r}")
        return raw == "1"
    if knob.kind == "count":
        if not (raw.isascii() and raw.isdigit()):
            raise BadKnob(f"{knob.name} must be a whole number >= 0, not {raw!r}")
        return int(raw)
    if knob.kind == "choice":
        got = _SYNONYMS.get(raw.lower(), raw.lower())
        if got not in knob.choices:
            raise BadKnob(f"{knob.name} must be one of {', '.join(knob.choices)}, not {raw!r}")
        return got
    if knob.kind == "path":
        return Path(raw).expanduser()
    return raw


def parse(environ: Mapping[str, str]) -> Knobs:
    """Knobs from an environment mapping (os.environ or a test's dict); BadKnob names the first bad variable."""
    values = {}
    for knob in KNOBS:
        raw = environ.get(knob.name, "")
        if raw.strip():
            values[knob.attr] = raw if knob.kind == "secret" else _value(knob, raw.strip())
    values.setdefault("cache", Path.home() / ".cache" / "hybrid")
    return Knobs(**values)


_CACHED: Knobs | None = None


def knobs() -> Knobs:
    """This process's knobs: os.environ parsed on the first call, the same object after (see reset)."""
    global _CACHED
    if _CACHED is None:
        _CACHED = parse(os.environ)
    return _CACHED


def reset() -> None:
    """Forget the parsed knobs: the next knobs() reads os.environ again (tests, after setting a variable)."""
    global _CACHED
    _CACHED = None


def table() -> str:
    """The markdown reference table of every knob (README.md, section Knobs)."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for k in KNOBS:
        default = f"`{k.default}`" if k.default else "unset"
        rows.append(f"| `{k.name}` | {default} | {k.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
