"""Token sampling: greedy (temperature 0), temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request torch.Generator; None = nondeterministic

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
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
            g.manual_seed(self.seed)
        return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] fp32 -> temperature-scaled logits with everything outside top-k / top-p at -inf."""
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it
        # already does (so the most likely token always survives).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.clone()
        x[idx[drop]] = float("-inf")
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row. Greedy rows share one argmax."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
