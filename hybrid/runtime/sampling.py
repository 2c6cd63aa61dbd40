"""Token sampling: greedy (temperature 0), temperature, top-k, top-p, with a per-request seed.

Safe for every accepted value: a temperature of 1e-40, a top_p of 1e-300 or a top_k larger than the
vocabulary never overflow, never produce NaN and always keep at least the most likely token, so
`torch.multinomial` always gets a valid distribution. The work is done in float64 after subtracting the
row's maximum: scaled logits are then <= 0 (the best token exactly 0), so dividing by a tiny
temperature can only push the others towards -inf, never the sum of exp() to inf or 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


SEED_MOD = 1 << 64  # torch.Generator.manual_seed takes 0..2**64-1; other seeds wrap (two's complement for negatives)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, for the CLI and the server alike. The defaults are the CLI's (greedy); the
    server's request parsing passes its own (temperature 1, as OpenAI's API) explicitly."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request torch.Generator (same seed + prompt -> same tokens, batched or alone)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the earliest one

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # (NaN fails this too)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % SEED_MOD)
        return g


def _sanitized(logits: torch.Tensor) -> torch.Tensor:
    """float64 copy where NaN is -inf and, if any logit is +inf, those tokens share all the mass."""
    x = logits.to(torch.float64)
    if bool(torch.isfinite(x).all()):
        return x
    pos = torch.isposinf(x)
    if bool(pos.any()):
        return torch.where(pos, 0.0, float("-inf")).to(torch.float64)
    return torch.nan_to_num(x, nan=float("-inf"), posinf=float("-inf"))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> float64 temperature-scaled logits, everything outside top-k / top-p at -inf.
    The most likely token always stays finite (0), whatever the parameters."""
    x = _sanitized(logits)
    best = int(torch.argmax(x))
    if not math.isfinite(float(x[best])):
        raise ValueError("the model produced no finite logit (NaN or -inf everywhere)")
    x = (x - x[best]) / params.temperature  # <= 0; -inf stays -inf; 0 / t = 0 for the best token
    x[best] = 0.0  # exact, even if the subtraction rounded
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it
        # already does. The first token is never dropped (the mass before it is 0, and a top_p below
        # float64's range must not make "0 >= top_p" true).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        x = x.clone()
        x[idx[drop]] = float("-inf")
    return x


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> one token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)  # sums to >= 1 term of exp(0)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] -> one token id per row. Greedy rows share one argmax."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, generators[i])
    return out
