"""Routing statistics: tokens per expert per MoE layer (what `hybrid profile-routing` writes, what
`hybrid plan --stats` reads). The JSON schema is documented in hybrid/commands/profile_routing.py.

`counts[l, e]` is the number of tokens of the run that layer `layers[l]` routed to expert `e`, so each
row sums to `tokens * topk`; `share = counts / tokens` is the probability that a token uses the expert
(a row of shares sums to K). `series` holds the same counts per window of `window_tokens` tokens, in
order, for judging how long a hot set persists. `decode_counts` / `decode_tokens` are the part of them
that generated tokens routed (decode steps): decode can route very differently from prompts, so the
planner places and predicts decode by them and prefill by the rest, when they are recorded.

A count of 0 is a sampling artefact, not a promise that the expert is never used: the planner reads
decode shares with a prior (`decode_shares(prior=PRIOR_TOKENS)`, additive smoothing): every expert is
credited PRIOR_TOKENS pseudo-tokens on top of its count, and the token total grows so that a row still
sums to K: share = (count + a) / (tokens + a E / K). The prior weighs a / tokens against the data, so it
fades as more tokens are counted; an unseen expert gets about a / tokens, below any expert seen once,
so it is placed after every seen expert of its layer, but it is placed when VRAM is left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from placement.errors import UsageError
from placement.json_file import read_json, write_json

SCHEMA_VERSION = 1
KIND = "hybrid-routing-stats"
# More tokens than any profiling run records (a trillion); bounding them keeps every array the planner
# derives from the counts small (a hand-edited 1e12 once asked for a multi-TiB allocation).
MAX_TOKENS = 10**12
# Pseudo-tokens credited to every expert when shares are read with a prior: half a token, the
# Krichevsky-Trofimov (Jeffreys) estimate for a use/no-use outcome, small next to one observed token.
PRIOR_TOKENS = 0.5


def _counts(rows, what: str) -> np.ndarray:
    """JSON rows of non-negative integer counts -> int64 array; floats, bools, strings and huge values refused."""
    ok = isinstance(rows, list) and all(isinstance(r, list) for r in rows)
    if ok:
        for r in rows:
            if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_TOKENS * 64 for c in r):
                ok = False
                break
    if not ok:
        raise UsageError(f"{what} must be lists of integer token counts between 0 and {MAX_TOKENS * 64:.0e}")
    return np.array(rows, dtype=np.int64)


@dataclass(frozen=True)
class RoutingStats:
    num_experts: int  # E
    topk: int  # K
    layers: tuple[int, ...]  # model layer index of each MoE layer, in order
    counts: np.ndarray  # int64 [L, E]
    tokens: int  # tokens behind `counts` (each counted once per layer)
    window_tokens: int = 0
    series: tuple = ()  # ((tokens, counts [L, E]), ...) per window, in run order
    source: dict = field(default_factory=dict)
    decode_counts: np.ndarray | None = None  # int64 [L, E], the decode steps' part of counts; None: not split
    decode_tokens: int = 0

    def __post_init__(self):
        counts = np.asarray(self.counts, dtype=np.int64)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.num_experts < 1 or not 1 <= self.topk <= self.num_experts:
            raise UsageError(f"routing stats: need 1 <= topk ({self.topk}) <= num_experts ({self.num_experts})")
        if counts.shape != (len(self.layers), self.num_experts):
            raise UsageError(f"routing stats: counts have shape {counts.shape}, expected "
                             f"({len(self.layers)}, {self.num_experts}) for {len(self.layers)} MoE layers")
        if (counts < 0).any() or self.tokens < 0 or self.window_tokens < 0:
            raise UsageError("routing stats: counts, tokens and window must be non-negative")
        if self.tokens > MAX_TOKENS or self.window_tokens > MAX_TOKENS:
            raise UsageError(f"routing stats: {self.tokens} tokens (window {self.window_tokens}) is more than "
                             f"{MAX_TOKENS:.0e}; not a recorded run")
        if counts.size and int(counts.sum(axis=1).max()) > self.tokens * self.topk:
            raise UsageError(f"routing stats: a layer's counts sum to {int(counts.sum(axis=1).max())}, more than "
                             f"tokens x topk = {self.tokens * self.topk}")
        if len(set(self.layers)) != len(self.layers):
            raise UsageError("routing stats: a layer is listed twice")
        if self.decode_counts is not None:
            dc = np.asarray(self.decode_counts, dtype=np.int64)
            object.__setattr__(self, "decode_counts", dc)
            if dc.shape != counts.shape or (dc < 0).any() or (dc > counts).any():
                raise UsageError(f"routing stats: decode counts (shape {dc.shape}) must be a part of the counts "
                                 f"(shape {counts.shape}): non-negative and no larger")
            if not 0 <= self.decode_tokens <= self.tokens:
                raise UsageError(f"routing stats: {self.decode_tokens} decode tokens of {self.tokens} in all")
        elif self.decode_tokens:
            raise UsageError("routing stats: decode_tokens without decode counts")
        series = []
        for i, (n, c) in enumerate(self.series):
            c = np.asarray(c, dtype=np.int64)
            if c.shape != counts.shape or (c < 0).any() or int(n) < 0:
                raise UsageError(f"routing stats: window {i} has counts of shape {c.shape} (expected {counts.shape})")
            series.append((int(n), c))
        object.__setattr__(self, "series", tuple(series))

    # -- views ------------------------------------------------------------------------------------
    def shares(self) -> np.ndarray:
        """[L, E] probability that a token routes to each expert (rows sum to K); uniform without data."""
        return self._shares(self.counts, self.tokens)

    def decode_shares(self, prior: float = 0.0) -> np.ndarray:
        """[L, E] the same for generated tokens (decode steps); all tokens' when decode was not recorded.
        `prior`: pseudo-tokens added to every expert's count (see the module docstring; 0: the raw shares)."""
        if self.decode_counts is None or self.decode_tokens == 0:
            return self._shares(self.counts, self.tokens, prior)
        return self._shares(self.decode_counts, self.decode_tokens, prior)

    def prefill_shares(self) -> np.ndarray:
        """[L, E] the same for prompt tokens; all tokens' when there were no others."""
        if self.decode_counts is None or self.decode_tokens == self.tokens:
            return self.shares()
        return self._shares(self.counts - self.decode_counts, self.tokens - self.decode_tokens)

    def _shares(self, counts: np.ndarray, tokens: int, prior: float = 0.0) -> np.ndarray:
        if prior < 0:
            raise ValueError(f"a prior of {prior} pseudo-tokens; it must be >= 0")
        if tokens == 0:
            return np.full(self.counts.shape, self.topk / self.num_experts)
        # (count + a) / (tokens + a E / K): every expert gains a pseudo-tokens and a row still sums to K
        return (counts + prior) / (tokens + prior * self.num_experts / self.topk)

    @classmethod
    def uniform(cls, cfg) -> "RoutingStats":
        """No measurement: every expert equally likely (the planner then spreads residency evenly)."""
        layers = cfg.moe_layer_indices
        return cls(cfg.num_experts, cfg.experts_per_token, layers,
                   np.zeros((len(layers), cfg.num_experts), dtype=np.int64), 0, source={"kind": "uniform"})

    def check_model(self, cfg, origin: str = "routing stats") -> None:
        layers = cfg.moe_layer_indices
        if (self.num_experts, self.topk, self.layers) != (cfg.num_experts, cfg.experts_per_token, layers):
            raise UsageError(f"{origin} were recorded on another model shape (E={self.num_experts}, K={self.topk}, "
                             f"{len(self.layers)} MoE layers) than this one (E={cfg.num_experts}, "
                             f"K={cfg.experts_per_token}, {len(layers)} MoE layers); run `hybrid profile-routing` "
                             "on this model")

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "kind": KIND, "num_experts": self.num_experts, "topk": self.topk,
            "tokens": self.tokens, "window_tokens": self.window_tokens, "source": self.source,
            "layers": [{"layer": l, "counts": c.tolist(),
                        **({} if self.decode_counts is None else {"decode_counts": self.decode_counts[i].tolist()})}
                       for i, (l, c) in enumerate(zip(self.layers, self.counts))],
            "series": [{"tokens": n, "counts": c.tolist()} for n, c in self.series],
            **({} if self.decode_counts is None else {"decode_tokens": self.decode_tokens}),
        }

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @classmethod
    def from_json(cls, data, origin: str = "routing stats") -> "RoutingStats":
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise UsageError(f"{origin}: not a routing-statistics file (kind must be {KIND!r}; write one with "
                             "`hybrid profile-routing`)")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise UsageError(f"{origin}: schema_version {data.get('schema_version')!r} not supported "
                             f"(this build reads {SCHEMA_VERSION})")
        try:
            layers = data["layers"]
            split = "decode_tokens" in data
            for name in ("num_experts", "topk", "tokens", "window_tokens", "decode_tokens"):
                v = data.get(name, 0)
                if not isinstance(v, int) or isinstance(v, bool):
                    raise UsageError(f"{origin}: {name} must be an integer, got {v!r}")
            return cls(int(data["num_experts"]), int(data["topk"]), tuple(int(x["layer"]) for x in layers),
                       _counts([x["counts"] for x in layers], f"{origin}: counts").reshape(len(layers), -1),
                       int(data["tokens"]), int(data.get("window_tokens", 0)),
                       tuple((int(w["tokens"]), _counts(w["counts"], f"{origin}: series counts"))
                             for w in data.get("series", [])),
                       dict(data.get("source", {})),
                       _counts([x["decode_counts"] for x in layers], f"{origin}: decode counts").reshape(len(layers), -1)
                       if split else None, int(data["decode_tokens"]) if split else 0)
        except UsageError as exc:
            raise UsageError(str(exc) if str(exc).startswith(origin) else f"{origin}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise UsageError(f"{origin}: malformed ({type(exc).__name__}: {exc})") from None


def load_stats(path: str | os.PathLike) -> RoutingStats:
    return RoutingStats.from_json(read_json(path, "--stats"), origin=f"routing stats {str(Path(path).expanduser())!r}")
